#!/usr/bin/env python3
"""CPU GEMM benchmark: every weight GEMM of one SmolLM2-135M-Instruct step (30 decoder layers:
qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536]; the tied LM head
[49152, 576]; 538 MB of fp32 weights, each its own buffer, so none is in cache) at M rows, on each
CPU GEMM kernel the machine has (the backend's cpu_gemm option: avx512 and avx2 where the CPU has
them, blas = OpenBLAS on its own threads) and on auto, the default dispatch. The avx2 option runs
its kernel for 2..16 rows and, like auto on a CPU without AVX2, OpenBLAS per column block over the
backend's threads (one OpenBLAS thread each) for the other row counts.

M = 1 is a decode step of one request, M = 8 the verify step of one request with 7 drafts, 16..64
verify steps of 2..8 requests, 256 and 512 prefills. For each (kernel, M): the best of --repeats
passes after one untimed pass, its weight bytes per second and GFLOP/s. Kernels alternate per M so
drift in the machine hits all alike.

Usage: python bench/bench_cpu_gemm.py [--rows 1,2,4,8,16,32,64,256,512] [--repeats 5] [--threads 2]
Writes bench/results/cpu_gemm_smollm2.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path

from dflash._core import testing

LAYERS = 30
SHAPES = [[960, 576], [576, 576], [3072, 576], [576, 1536]] * LAYERS + [[49152, 576]]


def available(kernel: str) -> bool:
    import numpy as np

    try:
        testing.cpu_linear(np.ones((1, 16), np.float32), np.ones((1, 16), np.float32), cpu_gemm=kernel)
    except ValueError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="bench/results/cpu_gemm_smollm2.json")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    kernels = [k for k in ("avx512", "avx2") if available(k)] + ["blas"]  # and auto
    weight_bytes = sum(n * k * 4 for n, k in SHAPES)
    results = []
    for m in rows:
        row = {"rows": m}
        for kernel in kernels + ["auto"]:
            secs = testing.cpu_linear_pass_seconds(SHAPES, m, num_threads=args.threads, cpu_gemm=kernel,
                                                    repeats=args.repeats)
            best = min(secs)
            row[kernel] = {"best_s": best, "seconds": secs, "weight_GBps": weight_bytes / best / 1e9,
                           "GFLOPs": 2 * m * weight_bytes / 4 / best / 1e9}
        row["blas_over_auto"] = row["blas"]["best_s"] / row["auto"]["best_s"]
        results.append(row)
        print(f"M={m:4d}: " + "  ".join(f"{k} {row[k]['best_s'] * 1e3:7.2f} ms ({row[k]['weight_GBps']:5.1f} GB/s)"
                                       for k in kernels + ["auto"]) + f"  blas/auto {row['blas_over_auto']:.2f}x")
    record = {
        "benchmark": "cpu_gemm_smollm2",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
                    "loadavg": os.getloadavg()},
        "shapes": f"{LAYERS} x (qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536]) + "
                  "lm_head [49152, 576], fp32",
        "weight_bytes": weight_bytes, "kernels": kernels,
        "note": "auto = the backend's default dispatch (the AVX-512 skinny kernel for every GEMM where the CPU has "
                "AVX-512, else AVX2 for 2..16 rows and OpenBLAS split over the backend's threads for the rest); "
                "avx2 at 1 row and past 16 rows is that OpenBLAS split",
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
