#!/usr/bin/env python3
"""SmolLM2-135M-Instruct on the GPU: dflash CUDA backend (eager, no CUDA graphs yet) vs
transformers generate (bf16, eager) on the same chat prompts, 64 new tokens each (ignore EOS /
min_new_tokens), batch 1 and 16, in one run: decode tokens/s and ms per step. A launch-bound
model: the roofline step (weights / copy bandwidth) is ~0.06 ms, so these figures measure
per-step overheads, which CUDA graphs (the next issue) attack.

Usage (on the GPU machine): python bench/bench_gpu_smollm2.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import time
from pathlib import Path

import torch

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain why the sky is blue.",
           "List three prime numbers.", "Translate 'good morning' into French.", "What is 12 times 13?",
           "Name a painting by Leonardo da Vinci.", "Give one tip for learning to code."]


def ours(model_dir, prompts, n):
    from dflash import _core

    cfg = _core.SessionConfig()
    cfg.device = "cuda"
    sess = _core.Session(str(model_dir), cfg)

    def run():
        ids = []
        for p in prompts:
            r = _core.RequestInput()
            r.prompt = p
            s = _core.SamplingConfig()
            s.max_tokens, s.ignore_eos = n, True
            r.sampling = s
            ids.append(sess.add_request(r))
        sess.step()  # prefill + first token
        t0 = time.perf_counter()
        steps = 0
        while sess.has_unfinished():
            sess.step()
            steps += 1
        t = time.perf_counter() - t0
        for i in ids:
            sess.take_result(i)
        return t, steps

    run()
    t, steps = run()
    return {"decode_s": t, "steps": steps, "ms_per_step": t / steps * 1e3,
            "decode_tokens_per_s": len(prompts) * (n - 1) / t}


def hf(model_dir, prompts, n):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")

    def gen(k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            m.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(n)
    first, total = gen(1), gen(n)
    t = total - first
    return {"decode_s": t, "ms_per_step": t / (n - 1) * 1e3, "decode_tokens_per_s": len(prompts) * (n - 1) / t}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    from dflash.default_model import default_model_dir
    from dflash.tokenizer import Tokenizer

    d = default_model_dir()
    tok = Tokenizer.from_model_dir(d)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    res = {"benchmark": "gpu_smollm2_ar", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
           "machine": torch.cuda.get_device_name(0), "cuda_graphs": False, "new_tokens": args.new_tokens}
    for bs in (1, 16):
        batch = (prompts * 2)[:bs]
        o, h = ours(d, batch, args.new_tokens), hf(d, batch, args.new_tokens)
        res[f"batch_{bs}"] = {"dflash": o, "transformers": h,
                              "speedup": o["decode_tokens_per_s"] / h["decode_tokens_per_s"]}
        print(f"batch {bs}: dflash {o['ms_per_step']:.3f} ms/step {o['decode_tokens_per_s']:.0f} tok/s; "
              f"transformers {h['ms_per_step']:.3f} ms/step {h['decode_tokens_per_s']:.0f} tok/s; "
              f"speedup {res[f'batch_{bs}']['speedup']:.2f}x", flush=True)
    out = Path(args.out) / "gpu_smollm2_ar.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
