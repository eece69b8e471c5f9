#!/usr/bin/env python3
"""Skinny GEMMs (cuda/skinny_gemm.cu, cuda/stream_gemm.cu) against cuBLASLt on the decode GEMMs
of a Qwen3-8B geometry, on one GPU, in one run:

  copy_bw       device-to-device copy of a 4 GiB buffer (torch, CUDA events, best of 5, counting
                read + write bytes): the roofline of this run.
  shapes        every weight GEMM shape of the target and the drafter (N, K; the LM head with fp32
                logits) at M = 1, 4, 8, 16 rows: time per GEMM, GB/s of weight bytes read and its
                fraction of copy_bw for
                  read      (once per shape) a Triton kernel that only streams the weight's bytes
                            (best of READ_CONFIGS): the size-matched roofline, ramp and tail
                            included, that no GEMV of that shape can beat,
                  skinny    the skinny kernel's default shape (DFLASH_GEMM=skinny / auto),
                  stream    the streaming kernel's default shape (DFLASH_GEMM=stream),
                  cublaslt  the CUDA backend's cuBLASLt plan (through testing.cuda_cublaslt_gemm),
                  torch     torch.mm (cuBLAS) as a second reference,
                  sweep     (--sweep skinny|stream) every built shape of that kernel (skinny: warps x
                            row tiles x unroll; stream: warps x stages x unroll), best one.
                Each figure: one CUDA graph of >= 20 GEMMs that rotate over distinct weight
                copies (together >= 4 x the L2 size, so L2 never serves w), replayed; the best of
                --trials timings (CUDA events) divided by the number of GEMMs.
  step          every weight GEMM of a decode step (36 x fused QKV, O, fused gate/up, down, and
                the LM head; distinct weights per layer, 15.1 GB) in one CUDA graph, at M = 1 and
                16, skinny vs stream vs cublaslt vs torch. Compare with the cuBLAS floor of
                shared/spec/build-facts.md (4.22 ms, 83.5 % of the copy bandwidth at M = 1).
  drafter_step  a DFlash-b16 drafter's GEMMs (fc, stacked K/V of 5 layers, 5 layers) + the LM head
                at M = 15 (floor there: 1.00 ms, 77.9 %).
The kernels launch on torch's current stream (the bindings' stream argument), so they are
captured into the graphs like torch's own kernels. Weights are random bf16 (values do not
change the timing).

Usage (GPU machine, dflash installed):
  python bench/bench_gpu_gemv.py [--out FILE] [--sweep stream|skinny|none]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common  # noqa: E402

H, INTER, VOCAB, LAYERS = 4096, 12288, 151936, 36
TARGET_SHAPES = [  # name, N, K, fp32 out
    ("qkv", 6144, H, False),
    ("o", H, H, False),
    ("gate_up", 2 * INTER, H, False),
    ("down", H, INTER, False),
    ("lm_head", VOCAB, H, True),
    ("drafter_fc", H, 5 * H, False),
    ("drafter_kv", 5 * 2048, H, False),
]
ROWS = [1, 4, 8, 16]
# Built kernel shapes (row_tiles, unroll) per column-tile count (M <= 8, 16, 32); see kernels.h.
KERNEL_SHAPES = {1: [(1, 8), (1, 4), (2, 4)], 2: [(1, 4), (2, 2)], 4: [(1, 2), (2, 2)]}
SWEEP_WARPS = [4, 8, 16]
# Built streaming shapes (unroll, stages); unroll 8 only for M <= 8 and at most 8 warps.
STREAM_SHAPES = [(4, 3), (4, 4), (4, 6), (8, 3), (8, 4), (8, 6)]
METHODS = ("skinny", "stream", "cublaslt", "torch")


def ops():
    from dflash._core import testing

    return testing


def stream():
    return torch.cuda.current_stream().cuda_stream


def skinny(x, w, out, **shape):
    return lambda: ops().cuda_skinny_gemm(x, w, out, stream=stream(), **shape)


def stream_gemm(x, w, out, **shape):
    return lambda: ops().cuda_stream_gemm(x, w, out, stream=stream(), **shape)


def cublaslt(x, w, out):
    return lambda: ops().cuda_cublaslt_gemm(x, w, out, stream=stream())


def torch_mm(x, w, out):
    if out.dtype == torch.float32:
        return lambda: torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
    return lambda: torch.mm(x, w.t(), out=out)


def copy_bandwidth():
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / best / 1e9


def graph_time(calls, trials, replays=3):
    """Seconds per replay of one CUDA graph of `calls` (best of `trials`), or None if one fails."""
    try:
        return gpu_common.graph_time(calls, trials=trials, replays=replays, best=True)
    except Exception as e:  # noqa: BLE001 - e.g. a torch without torch.mm(out_dtype=...)
        print(f"  ({type(e).__name__}: {e})", flush=True)
        torch.cuda.synchronize()
        return None


def figure(seconds, weight_bytes, copy_bw):
    if seconds is None:
        return None
    gbs = weight_bytes / seconds / 1e9
    return {"s": seconds, "weight_gbs": gbs, "fraction_of_copy_bw": gbs / copy_bw}


def num_col_tiles(m):
    return 1 if m <= 8 else 2 if m <= 16 else 4


def default_shape(m, n, sms):
    """The launcher's default (cuda/skinny_gemm.cu), for the record."""
    nt = num_col_tiles(m)
    unroll = {1: 8, 2: 4, 4: 2}[nt]
    blocks = (n + 15) // 16
    return {"warps": 16 if blocks <= sms else 8, "row_tiles": 1, "unroll": unroll}


# Read-only streaming of a weight: (elements per load block, blocks per program); the fastest of
# these is the shape's read roofline.
READ_CONFIGS = [(2048, 4), (4096, 4), (4096, 8), (8192, 8)]


def _read_kernel():
    """A Triton kernel that streams x (bf16) once and writes one fp32 sum per program: the size-matched
    roofline of a GEMV that reads the same bytes (launch ramp and tail included, no math)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        base = pid.to(tl.int64) * BLOCK * ITERS
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc))

    return read_sum


def read_calls(ws, calls_per_graph, block, iters):
    """calls_per_graph reads rotating over the weight copies ws, one output buffer each."""
    kernel = _read_kernel()
    n = ws[0].numel()
    programs = -(-n // (block * iters))
    outs = [torch.empty(programs, device="cuda", dtype=torch.float32) for _ in range(2)]
    return [(lambda w=ws[i % len(ws)], o=outs[i % 2]: kernel[(programs,)](w, o, n, BLOCK=block, ITERS=iters,
                                                                         num_warps=8))
            for i in range(calls_per_graph)]


def bench_read(ws, copy_bw, trials):
    """The fastest READ_CONFIGS read of one weight shape (graph of >= 20 reads over its copies)."""
    calls_per_graph = len(ws) * math.ceil(20 / len(ws))
    w_bytes = ws[0].numel() * 2
    best = None
    for block, iters in READ_CONFIGS:
        t = graph_time(read_calls(ws, calls_per_graph, block, iters), trials)
        f = figure(None if t is None else t / calls_per_graph, w_bytes, copy_bw)
        if f is not None and (best is None or f["s"] < best["s"]):
            best = {**f, "block": block, "iters": iters}
    return best


def bench_one(name, n, k, f32, m, ws, gen, copy_bw, trials, sweep, sms, read=None):
    """One (shape, M): every method, and the sweep of kernel shapes."""
    copies, w_bytes = len(ws), n * k * 2
    calls_per_graph = copies * math.ceil(20 / copies)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    out_dtype = torch.float32 if f32 else torch.bfloat16
    outs = [torch.empty(m, n, device="cuda", dtype=out_dtype) for _ in range(2)]

    def timed(make, **kw):
        calls = [make(x, ws[i % copies], outs[i % 2], **kw) for i in range(calls_per_graph)]
        t = graph_time(calls, trials)
        return figure(None if t is None else t / calls_per_graph, w_bytes, copy_bw)

    row = {"name": name, "n": n, "k": k, "m": m, "out": "fp32" if f32 else "bf16", "weight_bytes": w_bytes,
           "weight_copies": copies, "gemms_per_graph": calls_per_graph, "default_shape": default_shape(m, n, sms),
           "read": read}
    for label, make in zip(METHODS, (skinny, stream_gemm, cublaslt, torch_mm)):
        row[label] = timed(make)
    # agreement of the two paths on one GEMM (bf16 / fp32 rounding only)
    a, b = torch.empty_like(outs[0]), torch.empty_like(outs[0])
    ops().cuda_skinny_gemm(x, ws[0], a)
    ops().cuda_cublaslt_gemm(x, ws[0], b)
    row["max_abs_diff_skinny_vs_cublaslt"] = (a.float() - b.float()).abs().max().item()
    ops().cuda_stream_gemm(x, ws[0], a)
    row["max_abs_diff_stream_vs_cublaslt"] = (a.float() - b.float()).abs().max().item()
    if sweep == "skinny":
        row["sweep"] = []
        for warps in SWEEP_WARPS:
            for row_tiles, unroll in KERNEL_SHAPES[num_col_tiles(m)]:
                shape = {"warps": warps, "row_tiles": row_tiles, "unroll": unroll}
                f = timed(skinny, **shape)
                if f is not None:
                    row["sweep"].append({**shape, **f})
    elif sweep == "stream":
        row["sweep"] = []
        for warps in SWEEP_WARPS:
            for unroll, stages in STREAM_SHAPES:
                if unroll == 8 and (m > 8 or warps > 8):
                    continue
                shape = {"warps": warps, "unroll": unroll, "stages": stages}
                try:
                    f = timed(stream_gemm, **shape)
                except Exception:  # noqa: BLE001 - a shape whose shared memory does not fit
                    continue
                if f is not None:
                    row["sweep"].append({**shape, **f})
        if row["sweep"]:
            row["sweep_best"] = min(row["sweep"], key=lambda r: r["s"])
    line = f"{name:11s} N={n:6d} K={k:5d} M={m:2d}:"
    for label in METHODS:
        f = row[label]
        line += f"  {label} " + ("failed" if f is None else
                                 f"{f['s'] * 1e6:7.1f} us {f['fraction_of_copy_bw'] * 100:5.1f} %")
    if read is not None:
        line += f"  read {read['fraction_of_copy_bw'] * 100:5.1f} %"
    if row.get("sweep_best"):
        sb = row["sweep_best"]
        line += f"  best {sweep} shape " + " ".join(f"{k}={sb[k]}" for k in ("warps", "row_tiles", "unroll", "stages")
                                                   if k in sb) + f" {sb['fraction_of_copy_bw'] * 100:5.1f} %"
    print(line, flush=True)
    return row


def bench_shapes(copy_bw, l2_bytes, trials, sweep, sms, rows=ROWS, shapes=TARGET_SHAPES):
    """Every (shape, M) of `shapes` x `rows`: bench_one's row each, with the shape's read roofline."""
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k, f32 in shapes:
        copies = max(2, math.ceil(4 * l2_bytes / (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(copies)]
        read = bench_read(ws, copy_bw, trials)
        for m in rows:
            results.append(bench_one(name, n, k, f32, m, ws, gen, copy_bw, trials, sweep, sms, read=read))
        del ws
        torch.cuda.empty_cache()
    return results


def make_weights(gen):
    layers = []
    for _ in range(LAYERS):
        layers.append({name: torch.empty(n, k, device="cuda", dtype=torch.bfloat16).normal_(generator=gen)
                       for name, n, k, _ in TARGET_SHAPES[:4]})
    lm_head = torch.empty(VOCAB, H, device="cuda", dtype=torch.bfloat16).normal_(generator=gen)
    fc = torch.empty(H, 5 * H, device="cuda", dtype=torch.bfloat16).normal_(generator=gen)
    kv = torch.empty(5 * 2048, H, device="cuda", dtype=torch.bfloat16).normal_(generator=gen)
    return layers, lm_head, fc, kv


def gemm_list(layers, lm_head, extra, m, gen):
    """(x, w, out) of every GEMM of the sequence; the same inputs are reused (bandwidth only)."""
    xs = {k: torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16) for k in (H, INTER, 5 * H)}
    seq = []
    for w in extra:
        seq.append((xs[w.shape[1]], w, torch.empty(m, w.shape[0], device="cuda", dtype=torch.bfloat16)))
    for layer in layers:
        for w in layer.values():
            seq.append((xs[w.shape[1]], w, torch.empty(m, w.shape[0], device="cuda", dtype=torch.bfloat16)))
    seq.append((xs[H], lm_head, torch.empty(m, VOCAB, device="cuda", dtype=torch.float32)))
    return seq


def bench_sequence(seq, trials, copy_bw):
    w_bytes = sum(w.numel() * 2 for _, w, _ in seq)
    res = {"gemms": len(seq), "weight_bytes": w_bytes}
    for label, make in zip(METHODS, (skinny, stream_gemm, cublaslt, torch_mm)):
        res[label] = figure(graph_time([make(x, w, o) for x, w, o in seq], trials, replays=2), w_bytes, copy_bw)
    return res


def _sequence_line(what, r):
    return f"{what} ({r['gemms']} GEMMs, {r['weight_bytes'] / 1e9:.2f} GB): " + "  ".join(
        f"{k} {r[k]['s'] * 1e3:.3f} ms {r[k]['fraction_of_copy_bw'] * 100:.1f} %" if r[k] else f"{k} failed"
        for k in METHODS)


def bench_steps(copy_bw, trials, rows=(1, 16), drafter=True, save=None):
    """Every weight GEMM of a decode step in one graph at each M of `rows` ({"step_m<M>": ...}),
    and with `drafter` the drafter's GEMMs + LM head at M = 15 ("drafter_step_m15"); the 15 GB of
    distinct per-layer weights are freed before returning. save(partial dict) after each figure."""
    out = {}
    gen = torch.Generator(device="cuda").manual_seed(1)
    layers, lm_head, fc, kv = make_weights(gen)
    try:
        for m in rows:
            out[f"step_m{m}"] = r = bench_sequence(gemm_list(layers, lm_head, [], m, gen), trials, copy_bw)
            print(_sequence_line(f"decode step GEMMs M={m:2d}", r), flush=True)
            if save:
                save(out)
        if drafter:
            out["drafter_step_m15"] = r = bench_sequence(gemm_list(layers[:5], lm_head, [fc, kv], 15, gen), trials,
                                                        copy_bw)
            print(_sequence_line("drafter GEMMs + LM head M=15", r), flush=True)
            if save:
                save(out)
    finally:
        del layers, lm_head, fc, kv
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/gpu_h200_skinny_gemm.json")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--sweep", choices=("stream", "skinny", "none"), default="stream",
                    help="which kernel's built shapes to sweep (default stream)")
    ap.add_argument("--no-sweep", action="store_true", help="the same as --sweep none")
    args = ap.parse_args()
    import dflash

    assert dflash.built_with_cuda() and torch.cuda.is_available(), "needs a GPU and a CUDA build of dflash"
    prop = torch.cuda.get_device_properties(0)
    l2 = int(getattr(prop, "L2_cache_size", 50 << 20))
    res = {"benchmark": "gpu_skinny_gemm", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
           "machine": torch.cuda.get_device_name(0), "sms": prop.multi_processor_count, "l2_bytes": l2,
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "method": "CUDA graphs of GEMMs on torch's current stream, CUDA events, best of --trials; "
                     "weight_gbs = weight bytes / time; fraction = weight_gbs / copy_bw_gbs"}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out_path.write_text(json.dumps(res, indent=2))

    t0 = time.perf_counter()
    bw = copy_bandwidth()
    res["copy_bw_gbs"] = bw
    print(f"{res['machine']}: copy bandwidth {bw:.0f} GB/s (read + write)", flush=True)
    save()
    res["shapes"] = bench_shapes(bw, l2, args.trials, "none" if args.no_sweep else args.sweep,
                                 prop.multi_processor_count)
    save()

    bench_steps(bw, args.trials, save=lambda part: (res.update(part), save()))
    res["wall_s"] = time.perf_counter() - t0
    save()
    print(f"wrote {out_path} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
