#!/usr/bin/env python3
"""Paged attention at small batch (the latency-bound case of decode and verify steps), on the
GPU: Qwen3-8B geometry (32 query / 8 KV heads, head_dim 128, block 16), batch 1/4/16, query
length 1 (AR) and 16 (verify), context 512/4096, for each forced split count of the split-KV
path, and the plan's own choice (splits 0) with max_kv_len as a captured graph sees it
(max_model_len 4096 + 16) or exact.
Kernel durations come from CUPTI (torch.profiler), so launch latency is excluded: mean
microseconds per call of the decode kernel and of the split reduce, and K/V bytes read / time.

Usage (GPU machine, dflash installed): python bench/bench_gpu_attention_small.py --out DIR
Writes DIR/gpu_h200_attention_small.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import cuda_kernel_totals, run_record, write_json  # noqa: E402

NH, NKV, HD, BS = 32, 8, 128, 16


def case(testing, torch, batch, qlen, ctx, splits, max_kv_len, reps):
    blocks_per_seq = (ctx + BS - 1) // BS
    nblocks = batch * blocks_per_seq
    kp = torch.randn(nblocks, BS, NKV, HD, device="cuda", dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    t = batch * qlen
    q = torch.randn(t, NH, HD, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(q)
    qs = torch.arange(0, t + 1, qlen, device="cuda", dtype=torch.int32)
    kl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    bt = torch.randperm(nblocks, device="cuda", dtype=torch.int32).reshape(batch, blocks_per_seq)
    need = testing.triton_paged_attention_workspace_bytes(t, NH, HD, max(splits, 16))
    ws = torch.empty(max(need, 64 << 20), device="cuda", dtype=torch.uint8)
    args = (q, kp, vp, o, qs, kl, bt, True, 0, qlen, max_kv_len, ws, 2, splits)
    testing.triton_paged_attention(*args)
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            testing.triton_paged_attention(*args)
    per = {name: us / reps for name, (us, _) in cuda_kernel_totals(prof).items()}
    total = sum(per.values())
    kv_bytes = 2 * batch * ctx * NKV * HD * 2
    return {"batch": batch, "query_len": qlen, "context": ctx, "force_splits": splits, "max_kv_len": max_kv_len,
            "us_per_call": round(total, 2), "kernels_us": {k[:60]: round(v, 2) for k, v in per.items()},
            "kv_gbs": round(kv_bytes / (total * 1e-6) / 1e9, 1) if total else None}


def main():
    import torch
    from dflash._core import testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    res = run_record("gpu_attention_small")
    res["geometry"] = {"num_heads": NH, "num_kv_heads": NKV, "head_dim": HD, "block_size": BS}
    res["cases"] = []
    out = Path(args.out) / "gpu_h200_attention_small.json"
    for batch in (1, 4, 16):
        for qlen in (1, 16):
            for ctx in (512, 4096):
                for splits in (0, 1, 2, 4, 8, 16):  # 0: the plan's own choice from max_kv_len
                    for max_kv in ((ctx, 4096 + 16) if splits == 0 else (ctx,)):
                        r = case(testing, torch, batch, qlen, ctx, splits, max_kv, args.reps)
                        res["cases"].append(r)
                        print(f"b={batch} q={qlen} ctx={ctx} splits={splits} max_kv={max_kv}: "
                              f"{r['us_per_call']} us ({r['kv_gbs']} GB/s)", flush=True)
                write_json(out, res)
    write_json(out, res)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
