#!/usr/bin/env python3
"""Expected acceptance at T = 1 of drafters' draft distributions, teacher-forced on held-out rows:
why a DFlash2 walk accepts less than DFlash's probabilistic drafts at T = 1, and how much a
draft-temperature scale c (q = softmax(scores / c)) would change that.

For every supervised slot (teacher-forced blocks at deterministic anchors, as the trainer's
held-out evaluation), with p the target's softmax at T = 1 for the slot's token:
- unary (DFlash probabilistic drafts): q = softmax(logits / c) over the vocabulary;
- unary top-K: the same logits restricted to the slot's K candidates;
- walk (DFlash2 drafters): q = softmax(selector scores / c) over the K candidates, given the true
  predecessor (the walk's own predecessor is a drafted token, so from slot 2 on this is an
  upper-side proxy; for the first slot the predecessor is the verified bonus token, as here).
The expected acceptance of one slot is sum_x min(p(x), q(x)), exactly the probability that
rejection sampling accepts the draft. Sums run over the top-M unary candidates (M = --support,
64 by default), so the figures are lower bounds; the mass q puts outside them is reported too.

Usage: python bench/train_overlap_t1.py --data DATA.npz.xz --draft DIR [--draft DIR ...]
           [--scales 0.5,1,1.5,2] [--rows 24] [--out FILE]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_heldout import add_arguments, load_drafter, setup, write_report  # noqa: E402


def _overlap(p: torch.Tensor, logits: torch.Tensor, scale: float, full: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """p [n, M] target probabilities at the candidates, logits [n, M] draft scores there; full [n, V]:
    normalise over the vocabulary instead of the M candidates. (sum min(p, q) [n], q mass kept [n])."""
    if full is None:
        q = torch.softmax(logits / scale, dim=-1)
    else:
        q = torch.exp(logits / scale - torch.logsumexp(full / scale, dim=-1, keepdim=True))
    return torch.minimum(p, q).sum(-1), q.sum(-1)


def measure(draft_dir: str, target, batches, scales, support: int) -> dict:
    from dflash.train import objective as O
    from dflash.train.dflash2_objective import _target_mass

    drafter, arch = load_drafter(draft_dir, target)
    bs = drafter.config.block_size
    k = int(drafter.config.selector_top_k) if arch == "dflash2" else 16
    names = ["unary", f"unary_top{k}"] + (["walk"] if arch == "dflash2" else [])
    acc = {(m, c): torch.zeros(bs - 1) for m in names for c in scales}
    kept = {(m, c): torch.zeros(bs - 1) for m in names for c in scales}
    rows = torch.zeros(bs - 1)
    with torch.no_grad():
        for batch, anchors, keep in batches:
            t = O.unary_terms(drafter, target, batch, anchors, keep, gamma=None, top_k=support)
            slot = torch.nonzero(t.supervised)[:, 2] - 1
            p = _target_mass(target, batch, t.supervised, t.blocks["block_pos"], t.top_ids, 4096, per_candidate=True)
            full = torch.cat([F_logits(drafter, t.rows[i:i + 2048]) for i in range(0, t.rows.shape[0], 2048)])
            vals, ids = t.top_values.float(), t.top_ids
            walk_scores = None
            if arch == "dflash2":
                labels_full, block_ids = t.blocks["labels"], t.blocks["block_ids"]
                anchor = block_ids[..., :1]
                prev_full = torch.cat((anchor, anchor, labels_full[..., 1:-1]), dim=-1)
                prev = prev_full[t.supervised]
                walk_scores = drafter.candidate_selector.scores(t.rows, prev, ids[:, :k], vals[:, :k])
            for c in scales:
                parts = {"unary": _overlap(p, vals, c, full), f"unary_top{k}": _overlap(p[:, :k], vals[:, :k], c)}
                if walk_scores is not None:
                    parts["walk"] = _overlap(p[:, :k], walk_scores, c)
                for m, (a, q_kept) in parts.items():
                    acc[(m, c)].index_add_(0, slot, a)
                    kept[(m, c)].index_add_(0, slot, q_kept)
            rows.index_add_(0, slot, torch.ones_like(slot, dtype=torch.float32))
    n = rows.clamp_min(1)
    out = {"draft": draft_dir, "arch": arch, "slots": int(rows.sum()), "support": support, "k": k, "modes": {}}
    for m in names:
        out["modes"][m] = {
            f"{c:g}": {"expected_acceptance_first_slot": float(acc[(m, c)][0] / n[0]),
                       "expected_acceptance_mean": float(acc[(m, c)].sum() / rows.sum()),
                       "expected_acceptance_by_slot": (acc[(m, c)] / n).tolist(),
                       "q_mass_in_support": float(kept[(m, c)].sum() / rows.sum())}
            for c in scales}
    return out


def F_logits(drafter, h: torch.Tensor) -> torch.Tensor:
    """The unary head's full-vocabulary logits [n, V] of final-normed slot states h [n, H]."""
    return drafter.logits(h).float()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap, rows=24)
    ap.add_argument("--support", type=int, default=64, help="unary candidates the sums run over")
    ap.add_argument("--scales", default="0.75,1,1.25,1.5,2,3")
    ap.add_argument("--out", default="bench/results/train_smollm2/overlap_t1.json")
    args, target, batches, n_rows = setup(ap)
    scales = [float(x) for x in args.scales.split(",")]
    t0 = time.time()
    results = [measure(d, target, batches, scales, args.support) for d in args.draft]
    write_report(args, "expected acceptance sum_x min(p, q) at T = 1, teacher-forced on held-out rows, "
                 "by draft-temperature scale",
                 n_rows, time.time() - t0, results)
    for r in results:
        print(r["draft"], r["arch"], r["slots"], "slots")
        for m, by_scale in r["modes"].items():
            row = "  ".join(f"c={c}: {v['expected_acceptance_first_slot']:.3f}/{v['expected_acceptance_mean']:.3f}"
                            for c, v in by_scale.items())
            print(f"  {m:<12} first/mean  {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
