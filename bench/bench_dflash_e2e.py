#!/usr/bin/env python3
"""End-to-end speed of a target + DFlash drafter pair against the target alone, on the same
prompts, in one run: greedy, batch 1 (requests one after another; --concurrency C: C at a time),
--max-tokens new tokens.

Prompts: the first --num-prompts GSM8K test questions with the benchmark suffix ("reason step by
step ... \\boxed{}"), as chat messages. For each system: tokens/s = generated tokens / wall time
of the whole run (prefill included); the DFlash run also reports tau (tokens per draft-verify
step, bonus included), acceptance by position and the per-phase step times (eager steps only),
and the outputs are checked to be token-for-token identical to the target's greedy ones (on the
GPU, bf16: identical or a divergence where the target's top-2 gap is tiny; the count is
reported, not asserted).

--variants names the speculative systems, side by side in one job: "default" (what the Session
chooses by itself), "fixed", "adaptive" (speculation=...) and "fixed:N" (fixed with N drafts per
step), each optionally pipelined with "+async" (async_decode=True; not with adaptive). --ar-async
adds the target alone pipelined ("ar_async"). Every session stays loaded and each of --repeats rounds runs target-only and then every
variant, so drift in the machine's speed hits all alike; seconds are the median over rounds. The
first variant is the headline: its figures fill the top-level "dflash", "speedup" and
"identical_outputs" (the format of a one-variant run); "variants" holds each one's figures,
with the speculation mode its session reports, tokens per decode step (AR steps of adaptive
speculation included) and, for adaptive, the draft lengths it chose and its cost table.

Usage: python bench/bench_dflash_e2e.py --draft DRAFT_DIR [--model DIR] [--device cpu|cuda]
           [--num-prompts 8] [--max-tokens 128] [--variants default,adaptive,fixed:3] [--repeats 2]
           [--concurrency 1] [--deterministic] [--out bench/results] [--name FILE]
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
import statistics
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


def run(sess, prompts, max_tokens, concurrency=1):
    """Generates the prompts `concurrency` at a time (each group one batch, to the end of its
    longest request); returns the outputs and the wall time."""
    import dflash

    params = dflash.SamplingParams(max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = [o for i in range(0, len(prompts), concurrency) for o in sess.generate(prompts[i:i + concurrency], params)]
    return outs, time.perf_counter() - t0


def machine(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


def parse_variant(spec: str) -> tuple[str, dict]:
    """'default' (the Session's own choice), 'fixed', 'adaptive' or 'fixed:N' (N drafts per step),
    each optionally with '+async' (pipelined decoding, async_decode=True) -> (name, Session
    keyword arguments)."""
    base, plus, suffix = spec.partition("+")
    if plus and suffix != "async":
        raise SystemExit(f"--variants: unknown suffix {'+' + suffix!r} in {spec!r} (only +async)")
    extra = {"async_decode": True} if plus else {}
    if base == "default":
        return spec, extra
    if base in ("fixed", "adaptive"):
        return spec, {"speculation": base, **extra}
    kind, _, n = base.partition(":")
    if kind == "fixed" and n.isdigit() and int(n) >= 1:
        return spec, {"speculation": "fixed", "num_speculative_tokens": int(n), **extra}
    raise SystemExit(f"--variants: unknown variant {spec!r} (default, fixed, adaptive, fixed:N, each +async)")


def spec_record(before, after, outs, seconds, prompts, ar_outs) -> dict:
    """One speculative system's figures from its outputs and the stats() deltas of its timed runs."""
    steps = after["num_spec_steps"] - before["num_spec_steps"]
    rounds = len(seconds)
    # Tokens emitted by draft-verify steps (stats() reports them as acceptance_length x steps).
    emitted = round(after["acceptance_length"] * after["num_spec_steps"]
                    - before["acceptance_length"] * before["num_spec_steps"])
    decode_steps = sum(after["spec_length_steps"].values()) - sum(before["spec_length_steps"].values())
    # Every token after the first (which the prefill gives) over the decode steps, AR steps of
    # adaptive speculation included.
    decoded = sum(len(o.token_ids) for o in outs) - len(prompts) * rounds
    per_pos = [a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"])]
    tokens = sum(len(o.token_ids) for o in outs[:len(prompts)])
    s = statistics.median(seconds)
    rec = {"tokens": tokens, "seconds": s, "tokens_per_s": tokens / s,
           "tau": emitted / steps if steps else 0.0, "spec_steps": steps // rounds,
           "tokens_per_decode_step": decoded / decode_steps if decode_steps else 0.0,
           "decode_steps": decode_steps // rounds,
           "acceptance_rate_per_position": [c / steps for c in per_pos] if steps else [],
           "phase_s": {k: (v - before["spec_time_s"][k]) / rounds for k, v in after["spec_time_s"].items()},
           "speculation": after["speculation"], "num_speculative_tokens": after["num_speculative_tokens"],
           "identical_outputs": f"{sum(a.token_ids == b.token_ids for a, b in zip(ar_outs, outs))}/{len(outs)}",
           "seconds_per_round": seconds}
    if after["speculation"] == "adaptive":
        rec["spec_length_steps"] = {str(n): (c - before["spec_length_steps"].get(n, 0)) // rounds
                                    for n, c in after["spec_length_steps"].items()}
        rec["spec_cost_table"] = after["spec_cost_table"]
    return rec


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
    ap.add_argument("--variants", default="default",
                    help="comma-separated speculative systems: default (the Session's defaults), fixed, "
                         "adaptive, fixed:N (N drafts per step); the first is the headline 'dflash'")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over every system (target-only first in each); seconds are the median")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="requests generated together (groups of this many prompts, one after another)")
    ap.add_argument("--ar-async", action="store_true",
                    help="also time the target alone with async_decode=True (the 'ar_async' record)")
    ap.add_argument("--deterministic", action="store_true",
                    help="every session (target-only too) with deterministic=True: batch-invariant CUDA kernels, "
                         "so speculative greedy output should equal target-only greedy output token for token")
    ap.add_argument("--gsm8k", default=None, help="GSM8K test.jsonl")
    ap.add_argument("--label", default="", help="what drafter this is (recorded)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default=None, help="output file name (default by device and model)")
    args = ap.parse_args()
    if args.repeats < 1 or args.concurrency < 1:
        raise SystemExit("--repeats and --concurrency must be >= 1")
    model = args.model or str(default_model_dir())
    prompts = [[{"role": "user", "content": q + SUFFIX}] for q in gsm8k_questions(args.num_prompts, args.gsm8k)]
    variants = [parse_variant(v.strip()) for v in args.variants.split(",") if v.strip()]
    if not variants or len({n for n, _ in variants}) != len(variants):
        raise SystemExit("--variants needs at least one system, each once")
    # Every session stays loaded; each round runs them one after another, so drift in the
    # machine's speed hits every system alike.
    common = {"deterministic": True} if args.deterministic else {}
    if args.device == "cuda":
        # Every session stays loaded at once: a fixed KV cache each (the default takes what the
        # GPU has left, so the second session would get none).
        common["kv_cache_tokens"] = 65536
    ar = dflash.Session(model, draft="none", device=args.device, **common)
    ar_async = dflash.Session(model, draft="none", device=args.device, async_decode=True, **common) \
        if args.ar_async else None
    systems = {}
    for name, kw in variants:
        if args.num_speculative_tokens is not None:
            kw.setdefault("num_speculative_tokens", args.num_speculative_tokens)
        systems[name] = dflash.Session(model, draft=args.draft, device=args.device, **common, **kw)
    for sess in [ar, *([ar_async] if ar_async else []), *systems.values()]:
        run(sess, prompts[:1], 8)  # warm-up
    before = {name: sess.stats() for name, sess in systems.items()}
    ar_s, ar_async_s, sp_s = [], [], {name: [] for name in systems}
    sp_outs = {name: [] for name in systems}
    for _ in range(args.repeats):
        ar_outs, s = run(ar, prompts, args.max_tokens, args.concurrency)
        ar_s.append(s)
        if ar_async:
            ar_async_outs, s = run(ar_async, prompts, args.max_tokens, args.concurrency)
            ar_async_s.append(s)
        for name, sess in systems.items():
            outs, s = run(sess, prompts, args.max_tokens, args.concurrency)
            sp_s[name].append(s)
            sp_outs[name] += outs
    ntok = sum(len(o.token_ids) for o in ar_outs)
    ar_rec = {"tokens": ntok, "seconds": statistics.median(ar_s), "tokens_per_s": ntok / statistics.median(ar_s),
              "seconds_per_round": ar_s}
    ar_async_rec = None
    if ar_async:
        ar_async_rec = {"tokens_per_s": ntok / statistics.median(ar_async_s), "seconds": statistics.median(ar_async_s),
                        "seconds_per_round": ar_async_s,
                        "identical_outputs": f"{sum(a.token_ids == b.token_ids for a, b in zip(ar_outs, ar_async_outs))}"
                                             f"/{len(ar_outs)}"}
    recs = {name: spec_record(before[name], sess.stats(), sp_outs[name], sp_s[name], prompts,
                              ar_outs * args.repeats)
            for name, sess in systems.items()}
    for rec in recs.values():
        rec["speedup"] = rec["tokens_per_s"] / ar_rec["tokens_per_s"]
    head_name = variants[0][0]
    head = recs[head_name]
    res = {
        "benchmark": "dflash_e2e", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv), "machine": machine(args.device),
        "device": args.device, "model": model, "draft": args.draft, "draft_label": args.label,
        "prompts": f"GSM8K test[:{args.num_prompts}] + boxed suffix, chat", "max_tokens": args.max_tokens,
        "concurrency": args.concurrency, "deterministic": args.deterministic,
        "num_speculative_tokens": head["num_speculative_tokens"],
        "cuda_graphs": systems[head_name].stats().get("cuda_graphs", False),
        "repeats": args.repeats, "headline_variant": head_name,
        "ar": ar_rec,
        **({"ar_async": ar_async_rec} if ar_async_rec else {}),
        "dflash": {k: head[k] for k in ("tokens", "seconds", "tokens_per_s", "tau", "spec_steps",
                                        "acceptance_rate_per_position", "phase_s", "speculation")},
        "identical_outputs": head["identical_outputs"],
        "speedup": head["speedup"],
        "variants": recs,
    }
    name = args.name or (f"{args.device}_smollm2_dflash_e2e.json" if args.model is None
                         else f"{args.device}_dflash_e2e.json")
    out = Path(args.out) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"target-only: {ar_rec['tokens_per_s']:.1f} tok/s")
    for n, r in recs.items():
        mix = f" lengths {r['spec_length_steps']}" if "spec_length_steps" in r else ""
        print(f"{n:>10} ({r['speculation']}, {r['num_speculative_tokens']} drafts): {r['tokens_per_s']:.1f} tok/s, "
              f"{r['speedup']:.3f}x, tau {r['tau']:.2f}, identical {r['identical_outputs']}{mix}")
    print(f"wrote {out}")

if __name__ == "__main__":
    main()
