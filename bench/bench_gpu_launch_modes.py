#!/usr/bin/env python3
"""Side-by-side timing of the CUDA backend's launch switches, all in one job on one GPU:
programmatic dependent launch (DFLASH_PDL, on by default) and the fused decoder-layer GEMMs
(DFLASH_FUSED, on by default), each on and off, both on with every small-batch linear layer
on the skinny kernel (DFLASH_GEMM=skinny), and both on with pipelined AR decoding (async_decode). Both are read once per process, so every mode
runs in its own worker process, one after the other, on the same model files.

Points (batch 1, context 512, CUDA graphs, bench/profile_gpu_step.py's profile()):
- SmolLM2-135M geometry (random weights; launch-bound): the AR step and the speculative step
  with the shipped drafter;
- Qwen3-8B geometry (random weights; bandwidth-bound): the AR step, also as a fraction of the
  copy bandwidth measured in the same job.
Per point and mode: the unprofiled step time, the GPU busy time and the split of the idle time
(between steps vs inside a step's graph), launches per step; and each mode's ratio to the
all-off mode.

Also the opt-in attention kernels (fused RoPE, staged K/V, both, tensor cores) with both on.

Usage (GPU machine, dflash installed):
  python bench/bench_gpu_launch_modes.py --out DIR [--modes a,b,...] [--repeats N] [--name FILE]
Writes DIR/gpu_h200_launch_modes.json (or --name); with --repeats the modes' worker runs are
interleaved and each point keeps its median run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import (  # noqa: E402
    QWEN3_8B, SMOLLM2_135M, copy_bandwidth, decode_step_bytes, decoder_weight_bytes, run_record, write_json,
    write_random_model)

MODES = {"pdl+fused": {}, "fused": {"DFLASH_PDL": "0"}, "pdl": {"DFLASH_FUSED": "0"},
         "off": {"DFLASH_PDL": "0", "DFLASH_FUSED": "0"},
         # every linear layer of up to 16 rows on the skinny kernel (Qwen3-8B's QKV, gate/up and
         # down too, so their norms and SiLU fuse as well): does it beat cuBLASLt with PDL?
         "pdl+fused+skinny_all": {"DFLASH_GEMM": "skinny"},
         # pipelined AR decoding (Session async_decode; the worker reads this variable): the AR
         # points only, the speculative one runs as in pdl+fused
         "pdl+fused+async": {"DFLASH_BENCH_ASYNC": "1"},
         # the opt-in attention kernels: RoPE and the K/V write fused into the decode attention
         # (one launch fewer per layer: a launch-bound step may gain what a bandwidth-bound one
         # does not), K/V staged in shared memory, both, and the tensor-core kernel
         "pdl+fused+rope": {"DFLASH_ROPE_ATTENTION": "1"},
         "pdl+fused+staged": {"DFLASH_ATTENTION": "staged"},
         "pdl+fused+rope+staged": {"DFLASH_ROPE_ATTENTION": "1", "DFLASH_ATTENTION": "staged"},
         "pdl+fused+tc": {"DFLASH_ATTENTION": "tensor_cores"}}
KV = {"max_model_len": 4096, "kv_cache_tokens": 16384}


def worker(args) -> None:
    """One mode: every point, printed as one JSON line."""
    import torch  # noqa: F401  (before dflash._core: importing torch after it segfaults on the device image)
    from bench_gpu_qwen3 import make_session
    from profile_gpu_step import profile

    out = {}
    for label, model, draft in json.loads(args.points):
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        async_ar = os.environ.get("DFLASH_BENCH_ASYNC") == "1" and not draft
        sess, _ = make_session(Path(model), draft_dir=Path(draft) if draft else None, graphs=True, kv=KV,
                               max_num_seqs=16, async_decode=async_ar)
        r = profile(sess, args.steps, warmup=3, vocab_size=vocab)
        out[label] = {k: v for k, v in r.items() if k != "top_kernels"}
        out[label]["launches_per_step"] = round(sum(f["launches_per_step"] for f in r["families"].values()), 1)
        del sess
    print("RESULT " + json.dumps(out), flush=True)


def select_modes(text: str | None) -> dict[str, dict[str, str]]:
    """The modes of a --modes list (None: all), in MODES order; ValueError for an unknown one."""
    if not text:
        return dict(MODES)
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODES]
    if unknown or not names:
        raise ValueError(f"unknown --modes {unknown or text!r}; choose from {list(MODES)}")
    return {m: MODES[m] for m in MODES if m in names}


def median_runs(runs: list[dict]) -> dict:
    """One mode's repeated worker results ({point: record}) as one: per point the run with the median
    unprofiled step time (the lower middle one for an even count), with every run's time beside it."""
    out = {}
    for point in runs[0]:
        recs = sorted((r[point] for r in runs if point in r), key=lambda x: x["wall_ms_per_step_unprofiled"])
        out[point] = {**recs[(len(recs) - 1) // 2],
                      "wall_ms_per_step_unprofiled_runs": [x["wall_ms_per_step_unprofiled"] for x in recs]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="gpu_h200_launch_modes.json", help="file name of the JSON in --out")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", default=None, help=f"comma list of modes (default all: {','.join(MODES)})")
    ap.add_argument("--repeats", type=int, default=1,
                    help="worker runs per mode, interleaved over the modes; per point the median run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--points", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    try:
        modes = select_modes(args.modes)
    except ValueError as e:
        ap.error(str(e))
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    from profile_gpu_step import SHIPPED_DRAFTER

    res = run_record("gpu_launch_modes")
    res["point"] = {"batch": 1, "context": 512, "cuda_graphs": True}
    res["modes"] = modes
    res["repeats"] = args.repeats
    work = Path(tempfile.mkdtemp(prefix="dflash_modes_"))
    smol, qwen = work / "smollm2", work / "qwen3"
    write_random_model(smol, SMOLLM2_135M, arch="llama")
    qwen_weights = write_random_model(qwen, QWEN3_8B)
    res["copy_bw_gbs"] = copy_bandwidth()
    points = [("smollm2_ar", str(smol), None), ("smollm2_spec", str(smol), str(SHIPPED_DRAFTER)),
              ("qwen3_ar", str(qwen), None)]
    res["results"] = {}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode, env in modes.items():
            if "error" in res["results"].get(mode, {}):
                continue
            p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--worker", "--steps", str(args.steps),
                                "--points", json.dumps(points)], env={**os.environ, **env}, capture_output=True,
                               text=True, timeout=600, check=False)
            lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode != 0 or not lines:
                res["results"][mode] = {"error": (p.stderr or p.stdout)[-2000:], "returncode": p.returncode}
                print(f"{mode}: failed (exit status {p.returncode})\n{(p.stderr or p.stdout)[-2000:]}", flush=True)
                continue
            runs[mode].append(json.loads(lines[-1][len("RESULT "):]))
            res["results"][mode] = median_runs(runs[mode])
            print(mode, {k: round(v["wall_ms_per_step_unprofiled"], 4) for k, v in runs[mode][-1].items()},
                  flush=True)
            write_json(Path(args.out) / args.name, res)
    # speedups over the all-off mode, or over the first mode when it did not run
    base = res["results"].get("off") or next(iter(res["results"].values()), {})
    if "error" in base:
        base = {}
    res["speedup_base"] = "off" if "off" in res["results"] else next(iter(res["results"]), None)
    # profile() decodes about 6 x steps + 4 tokens after a 512-token prompt: ~545 keys read on average
    step_bytes = decode_step_bytes(qwen_weights, 512 + 3 * args.steps + 3, QWEN3_8B)
    res["derived"] = {}
    for mode, r in res["results"].items():
        if "error" in r:
            continue
        d = {f"{k}_speedup_vs_{res['speedup_base']}": base[k]["wall_ms_per_step_unprofiled"] /
             v["wall_ms_per_step_unprofiled"] for k, v in r.items() if k in base}
        if "qwen3_ar" in r:
            d["qwen3_ar_fraction_of_copy_bw"] = (step_bytes / (r["qwen3_ar"]["wall_ms_per_step_unprofiled"] / 1e3)
                                                 / (res["copy_bw_gbs"] * 1e9))
        res["derived"][mode] = d
    res["qwen3_step_bytes"] = step_bytes
    res["weights_note"] = f"Qwen3-8B geometry weights read per step {decoder_weight_bytes(QWEN3_8B)} bytes + KV"
    write_json(Path(args.out) / args.name, res)
    print(json.dumps(res["derived"], indent=1))


if __name__ == "__main__":
    main()
