#!/usr/bin/env python3
"""Paged attention at small batch (the latency-bound case of decode and verify steps), on the
GPU: Qwen3-8B geometry (32 query / 8 KV heads, head_dim 128, block 16), batch 1/4/16/64, query
length 1 (AR) and 16 (verify), context 512/4096, side by side in one run:
  triton  the AOT Triton kernels (decode + split reduce), the plan's own split count (splits 0)
          and forced ones;
  cuda    the CUDA decode attention as the backend routes it (one launch, the last CTA combines
          the splits): up to 16 rows per KV head (query length 1) on CUDA cores
          (cuda/decode_attention.cu), 17..64 rows (query length 16) on tensor cores
          (cuda/decode_attention_mma.cu); its own split count and one split;
  cuda_tc the tensor-core kernel forced at query length 1 too (tensor_cores=True).
The automatic split counts are taken with max_kv_len as a captured graph sees it (max_model_len
4096 + 16) and exact.
Two timings per case: CUPTI kernel durations (torch.profiler; launch latency excluded, and with
programmatic dependent launch a kernel's duration includes its wait for the one before):
microseconds per call summed over the call's kernels, launches per call and K/V bytes read / time;
and `graph_us_per_call`, the wall time of one call in a CUDA graph of 20 back-to-back calls
(device events, median of 5 replays): what a step pays.

Usage (GPU machine, dflash installed): python bench/bench_gpu_attention_small.py --out DIR
Writes DIR/gpu_h200_attention_small.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import cuda_kernel_totals, graph_time, run_record, write_json  # noqa: E402

NH, NKV, HD, BS = 32, 8, 128, 16


def case(testing, torch, impl, batch, qlen, ctx, splits, max_kv_len, reps):
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
    # the CUDA backend's workspace size, or what a forced split count needs
    need = testing.triton_paged_attention_workspace_bytes(t, NH, HD, max(splits, 1))
    ws = torch.empty(max(64 << 20, need), device="cuda", dtype=torch.uint8)
    if impl == "triton":
        def call_on(stream):
            return testing.triton_paged_attention(q, kp, vp, o, qs, kl, bt, True, 0, qlen, max_kv_len, ws, 2, splits,
                                                  stream, synchronize=False)[1]
    else:
        counters = torch.zeros(batch * NKV, device="cuda", dtype=torch.int32)

        def call_on(stream):
            return testing.cuda_decode_attention(q, kp, vp, o, qs, kl, bt, True, 0, qlen, max_kv_len, workspace=ws,
                                                 counters=counters, force_splits=splits, stream=stream,
                                                 tensor_cores=impl == "cuda_tc")

    def call():
        return call_on(torch.cuda.current_stream().cuda_stream)

    calls = [call] * 20  # the graph's back-to-back calls

    launched_splits = call()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    totals = cuda_kernel_totals(prof)
    per = {name: us / reps for name, (us, _) in totals.items()}
    total = sum(per.values())
    kv_bytes = 2 * batch * ctx * NKV * HD * 2
    return {"impl": impl, "batch": batch, "query_len": qlen, "context": ctx, "force_splits": splits,
            "max_kv_len": max_kv_len, "splits": launched_splits, "us_per_call": round(total, 2),
            "launches_per_call": sum(n for _, n in totals.values()) / reps,
            "kernels_us": {k[:60]: round(v, 2) for k, v in per.items()},
            "kv_gbs": round(kv_bytes / (total * 1e-6) / 1e9, 1) if total else None,
            "graph_us_per_call": round(graph_time(calls, trials=5, replays=1) * 1e6 / len(calls), 2)}


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
    for batch in (1, 4, 16, 64):
        for qlen in (1, 16):
            for ctx in (512, 4096):
                for impl in ("triton", "cuda", "cuda_tc") if qlen == 1 else ("triton", "cuda"):
                    forced = (1,) if impl != "triton" else (1, 8)
                    for splits in (0,) + forced:  # 0: the implementation's own choice from max_kv_len
                        for max_kv in ((ctx, 4096 + 16) if splits == 0 else (ctx,)):
                            r = case(testing, torch, impl, batch, qlen, ctx, splits, max_kv, args.reps)
                            res["cases"].append(r)
                            print(f"{impl} b={batch} q={qlen} ctx={ctx} splits={splits}->{r['splits']} "
                                  f"max_kv={max_kv}: {r['us_per_call']} us, {r['launches_per_call']} launches "
                                  f"({r['kv_gbs']} GB/s), graph {r['graph_us_per_call']} us", flush=True)
                write_json(out, res)
    write_json(out, res)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
