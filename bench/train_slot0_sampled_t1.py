#!/usr/bin/env python3
"""First-slot expected acceptance at T = 1 along text the target itself samples at T = 1, by how far
into the answer: where a K-candidate (DFlash2) draft loses to a full-vocabulary (DFlash) one.

For each GSM8K test question (chat template, the benchmark's "reason step by step" suffix) the
target samples --tokens new tokens at T = 1 (transformers, seeded). At every --stride-th answer
position L the drafters draft one block after the sampled anchor x[L] from the context x[:L] (the
trainer's models, which the runtime matches); with p the target's T = 1 distribution of x[L+1]:
- dflash: sum min(p, softmax(unary logits)) over the vocabulary (probabilistic DFlash drafts);
- dflash2_unary: the same for a DFlash2 drafter's own unary head;
- dflash2_unary_topk: its unary logits restricted to its K candidates;
- dflash2_walk: its walk's first-slot proposal, softmax(selector scores) over the K candidates;
- dflash2_walk_with_tail: a proposal the runtime does not have (yet): the walk's q scaled to the
  unary softmax's mass on the K candidates, plus the unary softmax outside them (what a walk with
  a full-vocabulary tail would be accepted with);
- target_mass_on_candidates / target_top1 / target_topk_mass: how flat p is.
Positions are binned by their offset into the answer (--bins, token offsets).

Usage: python bench/train_slot0_sampled_t1.py --dflash DIR --dflash2 DIR --gsm8k test.jsonl [--prompts 8] [--tokens 512]
           [--out bench/results/train_smollm2/slot0_sampled_t1.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import time
from pathlib import Path

import torch

SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dflash", required=True, help="a DFlash (v1) drafter dir")
    ap.add_argument("--dflash2", required=True, help="a DFlash2 drafter dir")
    ap.add_argument("--gsm8k", required=True, help="GSM8K test.jsonl")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512, help="sampled answer tokens per prompt")
    ap.add_argument("--stride", type=int, default=8)
    ap.add_argument("--bins", default="160,340", help="offsets splitting early / mid / late")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="bench/results/train_smollm2/slot0_sampled_t1.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.default_model import default_model_dir
    from dflash.train.dflash2_model import load_published_drafter
    from dflash.train.objective import target_features

    torch.manual_seed(args.seed)
    model_dir = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    d1 = load_published_drafter(args.dflash, target, "dflash").eval()
    d2 = load_published_drafter(args.dflash2, target, "dflash2").eval()
    if d1.config.target_layer_ids != d2.config.target_layer_ids or d1.config.block_size != d2.config.block_size:
        raise SystemExit("the two drafters need the same target layers and block size")
    cfg, k = d1.config, int(d2.config.selector_top_k)
    edges = [int(x) for x in args.bins.split(",")]
    names = ["early", "mid", "late"][: len(edges) + 1] if len(edges) <= 2 else [f"bin{i}" for i in range(len(edges) + 1)]

    def bin_of(offset: int) -> str:
        return names[sum(offset >= e for e in edges)]

    sums: dict = collections.defaultdict(float)
    counts: dict = collections.defaultdict(int)
    questions = [json.loads(line)["question"] for line in open(args.gsm8k, encoding="utf-8")][: args.prompts]
    t0 = time.time()
    with torch.no_grad():
        for q in questions:
            ids = tok.apply_chat_template([{"role": "user", "content": q + SUFFIX}], add_generation_prompt=True,
                                          return_tensors="pt")
            if not torch.is_tensor(ids):
                ids = ids["input_ids"]
            seq = target.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                  max_new_tokens=args.tokens, min_new_tokens=args.tokens)
            p_len = ids.shape[1]
            feats = target_features(target, seq, cfg.target_layer_ids)
            logits = target(input_ids=seq).logits[0].float()
            n = cfg.block_size - 1
            for pos in range(p_len + 4, seq.shape[1] - 2, args.stride):
                anchor = int(seq[0, pos])
                p = torch.softmax(logits[pos], -1)
                block = torch.tensor([[[anchor] + [cfg.mask_token_id] * n]])
                rope = torch.arange(pos, pos + n + 1)[None, None]
                ctx_pos, mask = torch.arange(pos)[None], torch.ones(1, 1, pos, dtype=torch.bool)
                b = bin_of(pos - p_len)
                h1 = d1(block, rope, feats[:, :pos], ctx_pos, mask)[0, 0, 1:2].float()
                q1 = torch.softmax(d1.logits(h1).float()[0], -1)
                h2 = d2(block, rope, feats[:, :pos], ctx_pos, mask)[0, 0, 1:2].float()
                lg2 = d2.logits(h2).float()[0]
                vals, cand = torch.sort(lg2, descending=True, stable=True)
                vals, cand = vals[:k], cand[:k]
                walk = torch.softmax(d2.candidate_selector.scores(h2, torch.tensor([anchor]), cand[None], vals[None])[0], -1)
                unary2 = torch.softmax(lg2, -1)
                inside = unary2[cand].sum()
                tail = unary2.clone()
                tail[cand] = walk * inside
                figures = {
                    "dflash": torch.minimum(p, q1).sum(),
                    "dflash2_unary": torch.minimum(p, unary2).sum(),
                    "dflash2_unary_topk": torch.minimum(p[cand], torch.softmax(vals, -1)).sum(),
                    "dflash2_walk": torch.minimum(p[cand], walk).sum(),
                    "dflash2_walk_with_tail": torch.minimum(p, tail).sum(),
                    "target_mass_on_candidates": p[cand].sum(),
                    "target_top1": p.max(),
                    "target_topk_mass": p.topk(k).values.sum(),
                }
                for name, v in figures.items():
                    sums[(name, b)] += float(v)
                    sums[(name, "all")] += float(v)
                counts[b] += 1
                counts["all"] += 1
    bins = names + ["all"]
    table = {name: {b: sums[(name, b)] / counts[b] for b in bins if counts[b]}
             for name in sorted({n for n, _ in sums})}
    out = {"what": "first-slot expected acceptance sum min(p, q) at T = 1 along target-sampled (T = 1) GSM8K answers",
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv),
           "machine": f"{platform.machine()} CPU ({torch.get_num_threads()} threads)", "k": k,
           "bins": {"edges": edges, "names": names}, "positions": dict(counts), "seconds": round(time.time() - t0, 1),
           "dflash": args.dflash, "dflash2": args.dflash2, "table": table}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    for name, row in table.items():
        print(f"{name:<28}" + "  ".join(f"{b} {v:.3f}" for b, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
