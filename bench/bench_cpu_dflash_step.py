#!/usr/bin/env python3
"""CPU benchmark of the DFlash draft-verify step vs the autoregressive step, SmolLM2-135M.

In one run, on the same prompts and lengths:
  ar      dflash.Session(model) decoding --new-tokens tokens per request (ignore_eos), batch 1
          and --batch: seconds per decode step (decode wall time / decode steps).
  dflash  dflash.Session(model, draft=D) with D a random-weight drafter of DFlash geometry
          scaled to the target (5 layers, the target's hidden size and heads, block 16,
          target_layer_ids by the published rule): seconds per draft-verify step, split into
          draft (drafter forward + lm_head + argmax), verify (target forward over the block with
          taps), accept (acceptance + commit) and context update (fc + K/V of every drafter layer),
          from the engine's own phase timers; tau (tokens per step) and the resulting tokens/s.
With random drafter weights tau is about 1 (drafts are almost never right): this measures the
cost of a step; the real tau comes with a trained drafter (see the training issue). The
projection tokens/s = tau_published x steps/s is printed for the published tau values, clearly
labelled as a projection.

Usage: python bench/bench_cpu_dflash_step.py [--batch 8] [--new-tokens 32] [--threads N]
Writes bench/results/cpu_smollm2_dflash_step.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import dflash
from dflash import _core
from dflash.default_model import default_model_dir
from dflash.drafter_format import write_dflash_drafter

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain why the sky is blue.",
    "List three prime numbers.", "Translate 'good morning' into French.", "What is 12 times 13?",
    "Name a painting by Leonardo da Vinci.", "Give one tip for learning to code.",
]
PUBLISHED_TAU = {"gsm8k": 6.54, "humaneval": 6.50, "mtbench": 4.24}


def run(sess, prompts, new_tokens):
    ids = []
    for p in prompts:
        req = _core.RequestInput()
        req.prompt = p
        sc = _core.SamplingConfig()
        sc.max_tokens = new_tokens
        sc.ignore_eos = True
        req.sampling = sc
        ids.append(sess._core.add_request(req))
    before = sess.stats()
    t0 = time.perf_counter()
    sess._core.step()  # prefill (and the first token)
    t1 = time.perf_counter()
    steps = 0
    while sess._core.has_unfinished():
        sess._core.step()
        steps += 1
    t2 = time.perf_counter()
    results = [sess._core.take_result(i) for i in ids]
    after = sess.stats()
    tokens = sum(len(r.token_ids) for r in results) - len(results)
    out = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": steps,
           "step_s": (t2 - t1) / max(steps, 1), "decode_tokens": tokens,
           "decode_tokens_per_s": tokens / (t2 - t1)}
    if after.get("num_spec_steps"):
        # Phase timers cover every draft-verify step (the prefill step included when it
        # drafts nothing); per engine step = divided by the engine steps that drafted.
        phases = {k: (after["spec_time_s"][k] - before["spec_time_s"][k]) for k in after["spec_time_s"]}
        out["request_spec_steps"] = after["num_spec_steps"] - before["num_spec_steps"]
        out["phase_s_per_step"] = {k: v / max(steps, 1) for k, v in phases.items()}
        emitted = sum(r.metrics.num_spec_emitted for r in results)
        out["tau"] = emitted / max(sum(r.metrics.num_spec_steps for r in results), 1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="bench/results/cpu_smollm2_dflash_step.json")
    args = ap.parse_args()

    model = default_model_dir()
    cfg = json.loads((model / "config.json").read_text())
    draft_dir = Path(tempfile.mkdtemp()) / "draft"
    write_dflash_drafter(draft_dir, target_config=cfg, num_layers=5, block_size=16, seed=0, init_std=0.05)
    ar = dflash.Session(model, device="cpu", num_threads=args.threads)
    spec = dflash.Session(model, draft=draft_dir, device="cpu", num_threads=args.threads)
    tok = ar.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    results = {}
    for bs in sorted({1, args.batch}):
        batch = (prompts * ((bs + len(prompts) - 1) // len(prompts)))[:bs]
        run(ar, batch, 4)  # warm-up
        run(spec, batch, 4)
        a = run(ar, batch, args.new_tokens)
        s = run(spec, batch, args.new_tokens)
        steps_per_s = 1.0 / s["step_s"]
        results[f"batch_{bs}"] = {
            "ar": a, "dflash": s,
            "spec_step_over_ar_step": s["step_s"] / a["step_s"],
            "projection_tokens_per_s_per_request_at_published_tau": {
                k: tau * steps_per_s for k, tau in PUBLISHED_TAU.items()},
        }
        print(f"batch {bs}: AR step {a['step_s'] * 1e3:.1f} ms ({a['decode_tokens_per_s']:.1f} tok/s); "
              f"DFlash step {s['step_s'] * 1e3:.1f} ms = " +
              " + ".join(f"{k} {v * 1e3:.1f}" for k, v in s["phase_s_per_step"].items()) +
              f" ms; tau {s['tau']:.2f} (random drafter); step ratio {s['step_s'] / a['step_s']:.2f}x")
    record = {
        "benchmark": "cpu_smollm2_dflash_step",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(x) for x in [sys.executable] + sys.argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
                    "loadavg": os.getloadavg()},
        "model": str(model), "drafter": "random weights, 5 layers, hidden 576, block 16 (15 drafts)",
        "new_tokens": args.new_tokens,
        "note": "tau ~1 with random drafter weights; projections use published tau and are not measurements",
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
