#!/usr/bin/env python3
"""Where the time of one decode step goes, on the GPU: the AR step and the speculative step of
the Qwen3-8B-geometry target (+ DFlash-b16 drafter) at batch 1, context 512, replayed from CUDA
graphs, profiled with torch.profiler (CUPTI kernel activity, which also sees the kernels of our
graphs). Per kernel family: time per step, launches per step; and GPU busy time vs the step's
wall time (the difference is launch gaps and host work).

With --model DIR (and optionally --draft DIR) it profiles that target (and drafter) instead,
e.g. SmolLM2-135M with the shipped drafter, a launch-bound pair where the gap between wall time
and GPU busy time shows what host/GPU overlap could win. --smollm2-geometry does the same with
random weights of SmolLM2-135M's shapes and the shipped drafter (no GGUF needed): host work
does not depend on the weights (acceptance does, so the speculative step's emit work is that of
~1 token per step). It also profiles random drafters of the shipped drafter's shape with 3 and 5
layers (spec_3_layers, spec_5_layers): what each drafter layer adds to a speculative step.

The step's wall time is taken twice: without the profiler (wall_ms_per_step_unprofiled: the
real step) and under it; host_gap_ms_per_step = unprofiled wall - GPU busy time is what the
GPU sits idle per step (launch latency + host work between graph replays). timeline_profiled
splits the profiled run's GPU idle time into the gaps between steps (host work, synchronisation,
graph launch: what host/GPU overlap could hide) and the gaps between kernels inside a step's
graph (what overlap cannot hide); under the profiler the between-step gaps are inflated.
host_us_per_step splits the unprofiled steps' host time by the session's counters (host_split):
staging, graph launch, waiting for the device, the results, and outside the decode step.

Usage (GPU machine, dflash installed): python bench/profile_gpu_step.py --out DIR
           [--model DIR [--draft DIR] [--name NAME] | --smollm2-geometry]
Writes DIR/gpu_h200_step_profile.json (or DIR/gpu_h200_step_profile_NAME.json with --model,
gpu_h200_step_profile_smollm2_geometry.json with --smollm2-geometry).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_qwen3 import make_session, synthetic_prompt, write_random_drafter  # noqa: E402
from gpu_common import (  # noqa: E402
    QWEN3_8B, REPO_ROOT, SMOLLM2_135M, cuda_kernel_intervals, cuda_kernel_totals, qwen3_config, run_record,
    split_idle_time, write_json, write_random_model)

SHIPPED_DRAFTER = REPO_ROOT / "python" / "dflash" / "drafters" / "SmolLM2-135M-Instruct"

FAMILIES = [  # (family, substrings of the kernel name), first match wins
    ("attention", ("paged_attention", "decode_attention")),
    ("gemm_skinny", ("skinny",)),
    ("gemm_cublas", ("gemm", "nvjet", "cutlass", "sm90", "xmma", "splitK", "Kernel2")),
    ("norm", ("rms_norm",)),
    ("rope_kv", ("rope", "kv_write")),
    ("silu", ("silu",)),
    ("embedding", ("embedding",)),
    ("sampling_accept", ("sample", "accept", "argmax", "assemble")),
    ("copy_columns_gather_add", ("copy_columns", "gather", "add_kernel")),
]


def family(name: str) -> str:
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "other"


def host_split(before: dict, after: dict, wall_s: float, steps: int) -> dict[str, float]:
    """Where the host's time of `steps` unprofiled steps went, microseconds per step, from the
    session's counters before and after (Session.stats() keys): staging the inputs, queueing the
    step (graph launch), waiting for the device, the rest of the decode step (the results: tokens,
    stop checks, metrics) and everything outside it (scheduling, the Python loop). With graphs,
    the GPU idles for all but the wait."""
    d = {k: (after[k] - before[k]) * 1e6 / steps for k in ("decode_time_s", "host_stage_s", "host_launch_s",
                                                            "host_wait_s")}
    out = {"stage": d["host_stage_s"], "launch": d["host_launch_s"], "wait": d["host_wait_s"],
           "results": d["decode_time_s"] - d["host_stage_s"] - d["host_launch_s"] - d["host_wait_s"],
           "outside_decode": wall_s * 1e6 / steps - d["decode_time_s"]}
    out["not_waiting"] = out["stage"] + out["launch"] + out["results"] + out["outside_decode"]
    return {k: round(v, 2) for k, v in out.items()}


def profile(sess, steps: int, warmup: int, vocab_size: int = 151936) -> dict:
    import torch
    from dflash import _core

    req = _core.RequestInput()
    req.prompt = [t % vocab_size for t in synthetic_prompt(0, 512)]
    s = _core.SamplingConfig()
    s.max_tokens, s.ignore_eos = 10 * (6 * steps + warmup) + 20, True
    req.sampling = s
    rid = sess.add_request(req)
    for _ in range(warmup + 1):
        sess.step()
    torch.cuda.synchronize()
    walls = []
    before = sess.stats().as_dict()
    for _ in range(5):  # the real step: no profiler, median of 5 runs of `steps` steps
        t0 = time.perf_counter()
        for _ in range(steps):
            sess.step()
        walls.append((time.perf_counter() - t0) / steps)
    host = host_split(before, sess.stats().as_dict(), sum(walls), 5 * steps)
    walls.sort()
    wall_plain = walls[len(walls) // 2]
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            sess.step()
        wall = (time.perf_counter() - t0) / steps
    sess.abort(rid)
    sess.take_result(rid)
    per_name = cuda_kernel_totals(prof)
    idle = split_idle_time(cuda_kernel_intervals(prof), steps)
    fams = collections.defaultdict(lambda: {"us_per_step": 0.0, "launches_per_step": 0.0})
    for name, (us, n) in per_name.items():
        f = fams[family(name)]
        f["us_per_step"] += us / steps
        f["launches_per_step"] += n / steps
    busy = sum(f["us_per_step"] for f in fams.values())
    top = sorted(((us / steps, n / steps, name[:120]) for name, (us, n) in per_name.items()), reverse=True)[:25]
    return {"wall_ms_per_step_unprofiled": wall_plain * 1e3, "wall_ms_per_step": wall * 1e3,
            "gpu_busy_ms_per_step": busy / 1e3, "gaps_ms_per_step": wall * 1e3 - busy / 1e3,
            "host_gap_ms_per_step": wall_plain * 1e3 - busy / 1e3,
            "host_gap_fraction": (wall_plain * 1e3 - busy / 1e3) / (wall_plain * 1e3),
            "host_us_per_step": host,
            "timeline_profiled": {k: round(v, 2) for k, v in idle.items()},
            "families": {k: {kk: round(vv, 2) for kk, vv in v.items()} for k, v in sorted(fams.items())},
            "top_kernels": [{"us_per_step": round(a, 2), "launches_per_step": b, "name": c} for a, b, c in top]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model", default=None, help="profile this HF target instead of the random Qwen3-8B geometry")
    ap.add_argument("--draft", default=None, help="its DFlash drafter (with --model; default: AR only)")
    ap.add_argument("--name", default="model", help="file suffix with --model")
    ap.add_argument("--smollm2-geometry", action="store_true",
                    help="random weights of SmolLM2-135M's shapes + the shipped drafter")
    ap.add_argument("--async-decode", action="store_true",
                    help="also profile the steps with pipelined decoding (async_decode; labels ar_async, spec_async)")
    args = ap.parse_args()
    res = run_record("gpu_step_profile")
    res["point"] = {"batch": 1, "context": 512, "cuda_graphs": True}
    if args.model:
        model, draft = Path(args.model), (Path(args.draft) if args.draft else None)
        out = Path(args.out) / f"gpu_h200_step_profile_{args.name}.json"
    elif args.smollm2_geometry:
        work = Path(tempfile.mkdtemp(prefix="dflash_prof_"))
        model, draft = work / "target", SHIPPED_DRAFTER
        write_random_model(model, SMOLLM2_135M, arch="llama")
        out = Path(args.out) / "gpu_h200_step_profile_smollm2_geometry.json"
    else:
        work = Path(tempfile.mkdtemp(prefix="dflash_prof_"))
        model, draft = work / "target", work / "drafter"
        write_random_model(model)
        write_random_drafter(draft, qwen3_config(QWEN3_8B))
        out = Path(args.out) / "gpu_h200_step_profile.json"
    res["model"], res["draft"] = str(model), (str(draft) if draft else None)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    kv = {"max_model_len": 4096, "kv_cache_tokens": 16384}
    runs = [("ar", None), ("spec", draft)]
    if args.async_decode:
        runs.insert(1, ("ar_async", None))
        runs.insert(3, ("spec_async", draft))
    if args.smollm2_geometry:
        ship = json.loads((SHIPPED_DRAFTER / "config.json").read_text())
        for n in (3, 5):
            d = work / f"drafter_{n}_layers"
            write_random_drafter(d, json.loads((model / "config.json").read_text()), geometry={
                "num_layers": n, "target_layer_ids": ship["dflash_config"]["target_layer_ids"],
                "block_size": ship["block_size"], "mask_token_id": ship["dflash_config"]["mask_token_id"]})
            runs.append((f"spec_{n}_layers", d))
    for label, d in runs:
        if label.startswith("spec") and d is None:
            continue
        sess, _ = make_session(model, draft_dir=d, graphs=True, kv=kv, max_num_seqs=16,
                               async_decode=label.endswith("_async"))
        res[label] = profile(sess, args.steps, warmup=3, vocab_size=vocab)
        print(label, {k: v for k, v in res[label].items() if k != "top_kernels"}, flush=True)
        for row in res[label]["top_kernels"][:12]:
            print("   ", row, flush=True)
        del sess
        write_json(out, res)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
