#!/usr/bin/env python3
"""SmolLM2-135M-Instruct on the GPU: dflash CUDA backend (with CUDA graphs when the build has
them: the JSON records cuda_graphs / graph_steps / eager_steps from stats()) vs transformers
generate (bf16, eager) on the same chat prompts, 64 new tokens each (ignore EOS /
min_new_tokens), batch 1 and 16, in one run: decode tokens/s and ms per step. A launch-bound
model: the roofline step (weights / copy bandwidth) is ~0.06 ms, so these figures measure
per-step overheads, which CUDA graphs attack.

Also sets `smollm2_ar_speedup_vs_hf` (batch 1) in DIR/headline.json (see gpu_common.py);
bench_gpu_qwen3.py calls run() when its `smollm2` section is selected.

Usage (on the GPU machine): python bench/bench_gpu_smollm2.py --out DIR
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import core_stats, free_cuda_memory, run_record, stat, update_headline, write_json  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain why the sky is blue.",
           "List three prime numbers.", "Translate 'good morning' into French.", "What is 12 times 13?",
           "Name a painting by Leonardo da Vinci.", "Give one tip for learning to code."]


def ours(model_dir, prompts, n, async_decode=False):
    from dflash import _core

    cfg = _core.SessionConfig()
    cfg.device = "cuda"
    cfg.kv_cache_tokens = 65536  # fixed: other sessions or torch may share the card
    cfg.async_decode = async_decode  # pipelined decoding (each step launched before the last is read)
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
    st = core_stats(sess)
    return {"decode_s": t, "steps": steps, "ms_per_step": t / steps * 1e3,
            "decode_tokens_per_s": len(prompts) * (n - 1) / t,
            "cuda_graphs": stat(st, "cuda_graphs"), "graph_steps": stat(st, "graph_steps"),
            "eager_steps": stat(st, "eager_steps"), "async_decode": async_decode,
            "pipelined_steps": stat(st, "pipelined_steps")}


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


def run(out_dir, new_tokens=64, batch_sizes=(1, 16)):
    """Both systems at each batch size; writes DIR/gpu_smollm2_ar.json and the headline key."""
    from dflash.default_model import default_model_dir
    from dflash.tokenizer import Tokenizer

    d = default_model_dir()
    tok = Tokenizer.from_model_dir(d)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    res = {**run_record("gpu_smollm2_ar"), "new_tokens": new_tokens}
    out = Path(out_dir) / "gpu_smollm2_ar.json"
    for bs in batch_sizes:
        batch = (prompts * ((bs + len(prompts) - 1) // len(prompts)))[:bs]
        o = ours(d, batch, new_tokens)
        free_cuda_memory()
        oa = ours(d, batch, new_tokens, async_decode=True)
        free_cuda_memory()
        h = hf(d, batch, new_tokens)
        free_cuda_memory()
        res["cuda_graphs"] = o["cuda_graphs"]
        res[f"batch_{bs}"] = {"dflash": o, "dflash_async": oa, "transformers": h,
                              "speedup": o["decode_tokens_per_s"] / h["decode_tokens_per_s"],
                              "speedup_async": oa["decode_tokens_per_s"] / h["decode_tokens_per_s"]}
        print(f"SmolLM2 batch {bs}: dflash {o['ms_per_step']:.3f} ms/step {o['decode_tokens_per_s']:.0f} tok/s "
              f"(async_decode {oa['ms_per_step']:.3f} ms/step); transformers {h['ms_per_step']:.3f} ms/step "
              f"{h['decode_tokens_per_s']:.0f} tok/s; speedup {res[f'batch_{bs}']['speedup']:.2f}x "
              f"(async {res[f'batch_{bs}']['speedup_async']:.2f}x)", flush=True)
        write_json(out, res)
    if "batch_1" in res:
        update_headline(out_dir, {"smollm2_ar_speedup_vs_hf": res["batch_1"]["speedup"],
                                  "smollm2_ar_async_speedup_vs_hf": res["batch_1"]["speedup_async"]},
                        stamp_prefix="smollm2_")
    print(f"wrote {out}", flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    run(args.out, args.new_tokens)


if __name__ == "__main__":
    main()
