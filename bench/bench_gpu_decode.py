#!/usr/bin/env python3
"""First GPU figures of the CUDA backend (before CUDA graphs), in one run on one GPU:

  copy_bw      device-to-device copy bandwidth of a 4 GiB buffer (torch, CUDA events, best of 5,
               counting read + write bytes): the roofline of this run.
  qwen3_8b     a Qwen3-8B-geometry target with random bf16 weights (36 layers, hidden 4096,
               32/8 heads, head_dim 128, intermediate 12288, vocab 151936): AR decode step
               latency at batch 1 and 16, context 512, through dflash's CUDA backend (eager:
               one host sync per step for sampling). bytes/step = every weight but the
               embedding table + the KV cache read; fraction = bytes / step time / copy_bw.
  kernels      micro-benchmarks through the test bindings: RMSNorm [65536, 4096] bf16, paged
               attention decode (64 sequences x 4096 keys, GQA 32/8, hd 128), sampling
               [256, 151936] fp32 (top-k 50): achieved GB/s vs copy_bw (the bindings synchronise,
               so small launch overheads are included).
SmolLM2-135M is not measured here: its GGUF (98 MB) exceeds what a device call can carry.

Usage (on the GPU machine, dflash installed): python bench/bench_gpu_decode.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import QWEN3_8B, copy_bandwidth, write_random_model  # noqa: E402


def timed(fn, reps=10, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def load_session(model_dir: Path):
    from dflash import _core

    cfg = _core.SessionConfig()
    cfg.device = "cuda"
    cfg.max_model_len = 4096
    cfg.kv_cache_tokens = 65536
    return _core.Session(str(model_dir), cfg)


def ar_step_latency(sess, batch: int, context: int, steps: int):
    from dflash import _core

    ids = []
    for r in range(batch):
        req = _core.RequestInput()
        req.prompt = [(7 * r + 13 * i) % 150000 + 10 for i in range(context)]
        s = _core.SamplingConfig()
        s.max_tokens = steps + 3
        s.ignore_eos = True
        req.sampling = s
        ids.append(sess.add_request(req))
    sess.step()  # prefill
    sess.step()
    sess.step()  # warm
    t0 = time.perf_counter()
    for _ in range(steps):
        sess.step()
    dt_step = (time.perf_counter() - t0) / steps
    while sess.has_unfinished():
        sess.step()
    for i in ids:
        sess.take_result(i)
    return dt_step


def kernels(copy_bw):
    from dflash._core import testing

    out = {}
    x = torch.randn(65536, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t = timed(lambda: testing.cuda_rms_norm(x, w, 1e-6, y))
    out["rms_norm_65536x4096"] = {"s": t, "gbs": 2 * x.numel() * 2 / t / 1e9}
    del x, y
    b, ctx, nkv, hd, nh, bs = 64, 4096, 8, 128, 32, 16
    blocks = b * ctx // bs
    kp = torch.randn(blocks, bs, nkv, hd, device="cuda", dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    q = torch.randn(b, nh, hd, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(q)
    qs = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    kl = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    bt = torch.randperm(blocks, device="cuda", dtype=torch.int32).reshape(b, ctx // bs)
    t = timed(lambda: testing.triton_paged_attention(q, kp, vp, o, qs, kl, bt, True, 0, 1, ctx))
    out["attention_decode_64x4096_gqa32_8_hd128"] = {"s": t, "gbs": 2 * kp.numel() * 2 / t / 1e9}
    del kp, vp
    logits = torch.randn(256, 151936, device="cuda", dtype=torch.float32)
    tok = torch.empty(256, device="cuda", dtype=torch.int32)
    n = 256
    t = timed(lambda: testing.cuda_sample(logits, [1.0] * n, [50] * n, [1.0] * n, list(range(n)), [5] * n, tok))
    out["sample_topk50_256x151936"] = {"s": t, "gbs": logits.numel() * 4 / t / 1e9}
    for v in out.values():
        v["fraction_of_copy_bw"] = v["gbs"] / copy_bw
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    res = {"benchmark": "gpu_decode_first_figures", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
           "machine": torch.cuda.get_device_name(0), "cuda_graphs": False}
    out_path = Path(args.out) / "gpu_decode_first_figures.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out_path.write_text(json.dumps(res, indent=2))

    bw = copy_bandwidth()
    res["copy_bw_gbs"] = bw
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    save()
    res["kernels"] = kernels(bw)
    print(json.dumps(res["kernels"], indent=1), flush=True)
    save()
    model = Path(tempfile.mkdtemp()) / "qwen3_8b_random"
    t0 = time.perf_counter()
    weights_read = write_random_model(model)
    print(f"wrote random Qwen3-8B geometry in {time.perf_counter() - t0:.0f} s", flush=True)
    c = QWEN3_8B
    kv_per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 2
    res["qwen3_8b"] = {"weights_read_per_step_bytes": weights_read, "context": 512}
    t0 = time.perf_counter()
    sess = load_session(model)
    res["qwen3_8b"]["load_s"] = time.perf_counter() - t0
    for batch in (1, 16):
        step = ar_step_latency(sess, batch, 512, args.steps)
        read = weights_read + batch * 512 * kv_per_token
        res["qwen3_8b"][f"batch_{batch}"] = {"step_s": step, "bytes_read": read,
                                             "fraction_of_copy_bw": read / step / (bw * 1e9)}
        print(f"qwen3-8b geometry batch {batch}: {step * 1e3:.2f} ms/step, "
              f"{read / step / (bw * 1e9) * 100:.1f} % of copy bandwidth", flush=True)
        save()
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
