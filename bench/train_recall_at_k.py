#!/usr/bin/env python3
"""Recall@K and target mass@K of drafters' unary heads on held-out rows of a training set:
the measurement behind DFlash2's K (how often the true next token is among a slot's top-K
candidates, and how much of the target's probability they hold).

For every supervised slot (teacher-forced blocks at deterministic anchors, as the trainer's
held-out evaluation): the unary logits (the target's LM head on the drafter's final state), the
rank of the true token (the target's own response token), and the target's softmax (T = 1) at
the slot's predecessor position.  recall@K = P(true token in the top-K); mass@K = E[target
probability of the top-K], overall and per slot.  A DFlash2 drafter also reports its selector's
teacher-forced top-1 accuracy over its own K candidates (the true predecessor given).

Usage: python bench/train_recall_at_k.py --data DATA.npz.xz --draft DIR [--draft DIR ...]
           [--target DIR] [--holdout 256] [--rows 64] [--anchors 64] [--out FILE]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_heldout import add_arguments, load_drafter, setup, write_report  # noqa: E402

KS = (1, 2, 4, 8, 16, 32, 64)


def measure(draft_dir: str, target, batches, ks) -> dict:
    from dflash.train import objective as O
    from dflash.train.dflash2_objective import _target_mass

    drafter, arch = load_drafter(draft_dir, target)
    kmax = max(ks)
    bs = drafter.config.block_size
    hits = {k: torch.zeros(bs - 1) for k in ks}
    mass = {k: torch.zeros(bs - 1) for k in ks}
    rows = torch.zeros(bs - 1)
    sel_correct = sel_rows = 0
    with torch.no_grad():
        for batch, anchors, keep in batches:
            t = O.unary_terms(drafter, target, batch, anchors, keep, gamma=None, top_k=kmax)
            labels = t.blocks["labels"][t.supervised]
            slot = torch.nonzero(t.supervised)[:, 2] - 1  # [n] draft slot 0 .. B-2
            found = t.top_ids == labels[:, None]  # [n, kmax]
            p = _target_mass(target, batch, t.supervised, t.blocks["block_pos"], t.top_ids, 4096, per_candidate=True)
            for k in ks:
                h = found[:, :k].any(-1).float()
                m = p[:, :k].sum(-1)
                hits[k].index_add_(0, slot, h)
                mass[k].index_add_(0, slot, m)
            rows.index_add_(0, slot, torch.ones_like(slot, dtype=torch.float32))
            if arch == "dflash2":
                from dflash.train.dflash2_objective import dflash2_loss

                _, st = dflash2_loss(drafter, target, batch, anchors, keep, gamma=None)
                sel_correct += st["selector_correct"]
                sel_rows += st["selector_rows"]
    out = {"draft": draft_dir, "arch": arch, "slots": int(rows.sum()),
           "recall_at_k": {k: float(hits[k].sum() / rows.sum()) for k in ks},
           "target_mass_at_k": {k: float(mass[k].sum() / rows.sum()) for k in ks},
           "recall_at_k_by_slot": {k: (hits[k] / rows.clamp_min(1)).tolist() for k in ks},
           "target_mass_at_k_by_slot": {k: (mass[k] / rows.clamp_min(1)).tolist() for k in ks}}
    if arch == "dflash2":
        out["selector_k"] = drafter.config.selector_top_k
        out["selector_acc_teacher_forced"] = sel_correct / max(1, sel_rows)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap, rows=64)
    ap.add_argument("--ks", default=",".join(map(str, KS)))
    ap.add_argument("--out", default="bench/results/train_smollm2/recall_at_k.json")
    args, target, batches, n_rows = setup(ap)
    ks = tuple(int(k) for k in args.ks.split(","))
    t0 = time.time()
    results = [measure(d, target, batches, ks) for d in args.draft]
    write_report(args, "recall@K and target mass@K (T = 1) of the unary head, teacher-forced on held-out rows",
                 n_rows, time.time() - t0, results)
    for r in results:
        print(r["draft"], r["arch"], r["slots"], "slots")
        print("  recall@K", {k: round(v, 3) for k, v in r["recall_at_k"].items()})
        print("  mass@K  ", {k: round(v, 3) for k, v in r["target_mass_at_k"].items()})
        if "selector_acc_teacher_forced" in r:
            print("  selector acc (teacher-forced, K", r["selector_k"], "):", round(r["selector_acc_teacher_forced"], 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
