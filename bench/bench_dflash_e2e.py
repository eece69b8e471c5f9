#!/usr/bin/env python3
"""End-to-end speed of a target + DFlash drafter pair against the target alone, on the same
prompts, in one run: greedy, batch 1 (requests one after another), --max-tokens new tokens.

Prompts: the first --num-prompts GSM8K test questions with the benchmark suffix ("reason step by
step ... \\boxed{}"), as chat messages. For each system: tokens/s = generated tokens / wall time
of the whole run (prefill included); the DFlash run also reports tau (tokens per draft-verify
step, bonus included), acceptance by position and the per-phase step times (eager steps only),
and the outputs are checked to be token-for-token identical to the target's greedy ones (on the
GPU, bf16: identical or a divergence where the target's top-2 gap is tiny; the count is
reported, not asserted).

Usage: python bench/bench_dflash_e2e.py --draft DRAFT_DIR [--model DIR] [--device cpu|cuda]
           [--num-prompts 8] [--max-tokens 128] [--out bench/results]
Writes OUT/<device>_smollm2_dflash_e2e.json (or <device>_dflash_e2e.json for another model).
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

SUFFIX = " Please reason step by step, and put your final answer within \\boxed{}."


def gsm8k_questions(n: int, path: str | None) -> list[str]:
    if path is None:
        hits = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k",
                                             "**", "test.jsonl"), recursive=True))
        if not hits:
            raise SystemExit("GSM8K test.jsonl not found; pass --gsm8k PATH")
        path = hits[0]
    with open(path) as f:
        return [json.loads(line)["question"] for line in f][:n]


def run(sess, prompts, max_tokens):
    import dflash

    params = dflash.SamplingParams(max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = [sess.generate([p], params)[0] for p in prompts]
    return outs, time.perf_counter() - t0


def machine(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


def main():
    import dflash
    from dflash.default_model import default_model_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="target directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=None)
    ap.add_argument("--gsm8k", default=None, help="GSM8K test.jsonl")
    ap.add_argument("--label", default="", help="what drafter this is (recorded)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    model = args.model or str(default_model_dir())
    prompts = [[{"role": "user", "content": q + SUFFIX}] for q in gsm8k_questions(args.num_prompts, args.gsm8k)]
    ar = dflash.Session(model, device=args.device)
    run(ar, prompts[:1], 8)  # warm-up
    ar_outs, ar_s = run(ar, prompts, args.max_tokens)
    del ar
    spec = dflash.Session(model, draft=args.draft, device=args.device,
                          num_speculative_tokens=args.num_speculative_tokens)
    run(spec, prompts[:1], 8)
    before = spec.stats()
    sp_outs, sp_s = run(spec, prompts, args.max_tokens)
    st = spec.stats()
    steps = st["num_spec_steps"] - before["num_spec_steps"]
    emitted = sum(len(o.token_ids) for o in sp_outs) - len(prompts)  # the first token comes from the prefill
    ntok = sum(len(o.token_ids) for o in ar_outs)
    identical = sum(a.token_ids == b.token_ids for a, b in zip(ar_outs, sp_outs))
    per_pos = [a - b for a, b in zip(st["accepted_per_position"], before["accepted_per_position"])]
    res = {
        "benchmark": "dflash_e2e", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv), "machine": machine(args.device),
        "device": args.device, "model": model, "draft": args.draft, "draft_label": args.label,
        "prompts": f"GSM8K test[:{args.num_prompts}] + boxed suffix, chat", "max_tokens": args.max_tokens,
        "num_speculative_tokens": st["num_speculative_tokens"], "cuda_graphs": st.get("cuda_graphs", False),
        "ar": {"tokens": ntok, "seconds": ar_s, "tokens_per_s": ntok / ar_s},
        "dflash": {"tokens": sum(len(o.token_ids) for o in sp_outs), "seconds": sp_s,
                   "tokens_per_s": sum(len(o.token_ids) for o in sp_outs) / sp_s,
                   "tau": emitted / steps if steps else 0.0, "spec_steps": steps,
                   "acceptance_rate_per_position": [c / steps for c in per_pos] if steps else [],
                   "phase_s": st["spec_time_s"]},
        "identical_outputs": f"{identical}/{len(prompts)}",
    }
    res["speedup"] = res["dflash"]["tokens_per_s"] / res["ar"]["tokens_per_s"]
    name = f"{args.device}_smollm2_dflash_e2e.json" if args.model is None else f"{args.device}_dflash_e2e.json"
    out = Path(args.out) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(json.dumps({k: res[k] for k in ("ar", "dflash", "speedup", "identical_outputs")}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
