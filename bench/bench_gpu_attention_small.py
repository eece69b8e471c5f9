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
  cuda_tc the tensor-core kernel forced at query length 1 too (tensor_cores=True);
  cuda_staged the CUDA-core kernel with K/V staged in shared memory by cp.async (staged=True, what
          DFLASH_ATTENTION=staged runs; the same bits, fewer registers), query length 1;
  rope_pair  what the AR step runs before and in attention with DFLASH_ROPE_ATTENTION off: the
          QKV norm / RoPE / K/V write kernel, then the CUDA decode attention (two launches);
  cuda_rope  the same work fused into the decode kernel (cuda::decode_attention_rope, one launch;
          what DFLASH_ROPE_ATTENTION=1 runs). Query length 1, Qwen3 q/k norms on;
  cuda_staged_rope  the fused kernel with K/V staged (both switches). Query length 1.
--geometry smollm2 times SmolLM2-135M's heads (9 query / 3 KV, head_dim 64) instead; --impls,
--batches, --qlens and --contexts narrow the run; --splits adds forced split counts for the CUDA
kernels (default 1), --triton-splits for the Triton ones (default 1,8): e.g. the verify rows'
split rule, --qlens 16 --splits 1,2,4,8 --triton-splits 1,2,4,8.
The automatic split counts are taken with max_kv_len as a captured graph sees it (max_model_len
4096 + 16) and exact.
Two timings per case: CUPTI kernel durations (torch.profiler; launch latency excluded, and with
programmatic dependent launch a kernel's duration includes its wait for the one before):
microseconds per call summed over the call's kernels, launches per call and K/V bytes read / time;
and `graph_us_per_call`, the wall time of one call in a CUDA graph of 20 back-to-back calls
(device events, median of 5 replays), where the K/V stay in L2 from call to call; and
`cold_graph_us_per_call` (unless --no-cold), the same with the L2 flushed before each call (a graph
of 10 flush + call pairs minus one of 10 flushes): what a step pays, whose K/V come from HBM.

Usage (GPU machine, dflash installed): python bench/bench_gpu_attention_small.py --out DIR
Writes DIR/gpu_h200_attention_small.json (DIR/gpu_h200_attention_small_smollm2.json with
--geometry smollm2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import cuda_kernel_totals, graph_time, run_record, write_json  # noqa: E402

GEOMETRIES = {"qwen3_8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # query heads, KV heads, head_dim
BS = 16
IMPLS = ("triton", "cuda", "cuda_tc", "cuda_staged", "rope_pair", "cuda_rope", "cuda_staged_rope", "triton_prefill",
         "triton_chunked")
# The batch-invariant attention of deterministic sessions: the chunked kernel (its own choice of
# split, and forced to fold in the kernel), beside the prefill kernel it replaced there.
INVARIANT_IMPLS = {"triton_prefill": 1, "triton_chunked": 3}  # force_variant
ROPE_IMPLS = ("rope_pair", "cuda_rope", "cuda_staged_rope")


def rope_inputs(torch, batch, qlen, ctx, bt, nh, nkv, hd):
    """The raw QKV rows of the batch's new tokens (the last qlen positions of each sequence), their
    positions and pool slots, the RoPE frequencies and q/k norm weights."""
    t = batch * qlen
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(ctx - qlen, ctx, device="cuda", dtype=torch.int32).repeat(batch)
    seq = torch.arange(batch, device="cuda").repeat_interleave(qlen)
    slots = (bt[seq, (pos // BS).long()] * BS + pos % BS).to(torch.int32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device="cuda", dtype=torch.float32) / hd))
    norm = torch.ones(hd, device="cuda", dtype=torch.bfloat16)
    return qkv, pos, slots, inv_freq, norm


def case(testing, torch, impl, batch, qlen, ctx, splits, max_kv_len, reps, geometry=GEOMETRIES["qwen3_8b"],
         cold=True):
    NH, NKV, HD = geometry
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
    if impl in INVARIANT_IMPLS:
        def call_on(stream):
            return testing.triton_paged_attention(q, kp, vp, o, qs, kl, bt, True, 0, qlen, max_kv_len, ws,
                                                  INVARIANT_IMPLS[impl], splits, stream, synchronize=False)[1]
    elif impl == "triton":
        def call_on(stream):
            return testing.triton_paged_attention(q, kp, vp, o, qs, kl, bt, True, 0, qlen, max_kv_len, ws, 2, splits,
                                                  stream, synchronize=False)[1]
    elif impl in ROPE_IMPLS:
        counters = torch.zeros(batch * NKV, device="cuda", dtype=torch.int32)
        qkv, pos, slots, inv_freq, norm = rope_inputs(torch, batch, qlen, ctx, bt, NH, NKV, HD)

        def call_on(stream):
            if impl != "rope_pair":
                return testing.cuda_decode_attention_rope(qkv, norm, norm, 1e-6, pos, inv_freq, slots, kp, vp, o, qs,
                                                          kl, bt, True, 0, qlen, max_kv_len, workspace=ws,
                                                          counters=counters, force_splits=splits, stream=stream,
                                                          staged=impl == "cuda_staged_rope")
            testing.cuda_qkv_norm_rope_write(qkv, norm, norm, 1e-6, pos, inv_freq, slots, NH, NKV, HD, q, kp, vp,
                                             stream=stream)
            return testing.cuda_decode_attention(q, kp, vp, o, qs, kl, bt, True, 0, qlen, max_kv_len, workspace=ws,
                                                 counters=counters, force_splits=splits, stream=stream)
    else:
        counters = torch.zeros(batch * NKV, device="cuda", dtype=torch.int32)

        def call_on(stream):
            return testing.cuda_decode_attention(q, kp, vp, o, qs, kl, bt, True, 0, qlen, max_kv_len, workspace=ws,
                                                 counters=counters, force_splits=splits, stream=stream,
                                                 tensor_cores=impl == "cuda_tc", staged=impl == "cuda_staged")

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
            "graph_us_per_call": round(graph_time(calls, trials=5, replays=1) * 1e6 / len(calls), 2),
            "cold_graph_us_per_call": cold_graph_us(torch, call) if cold else None}


_FLUSH = []  # the L2 flush's source buffer, allocated once


def cold_graph_us(torch, call, n=10):
    """Microseconds per call with the L2 cache flushed before each call, as in a decode step (where
    the K/V were last touched a layer's worth of weights ago): a graph of n (flush, call) pairs
    minus a graph of n flushes. The flush reads 256 MiB (five times the H200's L2), read-only, so no
    dirty lines are written back during the call."""
    if not _FLUSH:
        _FLUSH.append(torch.ones(64 << 20, device="cuda", dtype=torch.float32))

    def flush():
        return _FLUSH[0].sum()

    both = graph_time([flush, call] * n, trials=5, replays=1)
    alone = graph_time([flush] * n, trials=5, replays=1)
    return round((both - alone) * 1e6 / n, 2)


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-cold", action="store_true",
                    help="skip the cold-L2 graph timing (cold_graph_us_per_call: the L2 flushed before each call)")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="qwen3_8b")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {','.join(IMPLS)}")
    ap.add_argument("--batches", type=_ints, default=[1, 4, 16, 64])
    ap.add_argument("--qlens", type=_ints, default=[1, 16])
    ap.add_argument("--contexts", type=_ints, default=[512, 4096])
    ap.add_argument("--splits", type=_ints, default=[1], help="forced split counts of the CUDA kernels (default 1)")
    ap.add_argument("--triton-splits", type=_ints, default=[1, 8],
                    help="forced split counts of the Triton kernels (default 1,8)")
    args = ap.parse_args(argv)
    args.impls = [x for x in args.impls.split(",") if x]
    bad = sorted(set(args.impls) - set(IMPLS))
    if bad:
        ap.error(f"unknown --impls {bad}; choose from {list(IMPLS)}")
    return args


def plan(args):
    """The (impl, batch, qlen, ctx, forced splits, max_kv_len) cases of a run, in order: per
    point every implementation with its own split count (from the exact max_kv_len and from a
    captured graph's 4096 + 16) and the forced ones (--splits; Triton: --triton-splits; the chunked
    kernel: folded in the kernel; the prefill kernel: none, it does not split). The
    tensor-core, staged and RoPE variants are timed at query length 1 only (the verify rows go to
    tensor cores anyway)."""
    out = []
    for batch in args.batches:
        for qlen in args.qlens:
            for ctx in args.contexts:
                for impl in args.impls:
                    if qlen != 1 and impl in ("cuda_tc", "cuda_staged") + ROPE_IMPLS:
                        continue
                    forced = tuple(args.triton_splits if impl == "triton" else (1,) if impl == "triton_chunked"
                                   else () if impl == "triton_prefill" else args.splits)
                    for splits in (0,) + forced:  # 0: the implementation's own choice from max_kv_len
                        for max_kv in ((ctx, 4096 + 16) if splits == 0 else (ctx,)):
                            out.append((impl, batch, qlen, ctx, splits, max_kv))
    return out


def main():
    import torch
    from dflash._core import testing

    args = parse_args()
    res = run_record("gpu_attention_small")
    nh, nkv, hd = GEOMETRIES[args.geometry]
    res["geometry"] = {"name": args.geometry, "num_heads": nh, "num_kv_heads": nkv, "head_dim": hd, "block_size": BS}
    res["cases"] = []
    suffix = "" if args.geometry == "qwen3_8b" else f"_{args.geometry}"
    out = Path(args.out) / f"gpu_h200_attention_small{suffix}.json"
    for impl, batch, qlen, ctx, splits, max_kv in plan(args):
        r = case(testing, torch, impl, batch, qlen, ctx, splits, max_kv, args.reps, geometry=(nh, nkv, hd),
                 cold=not args.no_cold)
        res["cases"].append(r)
        print(f"{impl} b={batch} q={qlen} ctx={ctx} splits={splits}->{r['splits']} "
              f"max_kv={max_kv}: {r['us_per_call']} us, {r['launches_per_call']} launches "
              f"({r['kv_gbs']} GB/s), graph {r['graph_us_per_call']} us, cold L2 {r['cold_graph_us_per_call']} us",
              flush=True)
        write_json(out, res)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
