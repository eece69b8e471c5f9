#!/usr/bin/env python3
"""SmolLM2-135M-Instruct on the GPU: dflash CUDA backend (with CUDA graphs when the build has
them: the JSON records cuda_graphs / graph_steps / eager_steps from stats()) vs transformers
generate (bf16, eager) on the same chat prompts, 64 new tokens each (ignore EOS /
min_new_tokens), batch 1 and 16, in one run: decode tokens/s and ms per step. A launch-bound
model: the roofline step (weights / copy bandwidth) is ~0.06 ms, so these figures measure
per-step overheads, which CUDA graphs attack. The same run times our speculative decoding with
the shipped DFlash drafter (greedy, the same prompts): ms per speculative step, tokens per step,
the speculative step over the AR step, and tokens/s over our AR decoding and over transformers.

Also sets `smollm2_ar_speedup_vs_hf` (batch 1), `smollm2_spec_step_over_ar_bs1` and
`smollm2_spec_speedup_vs_hf` in DIR/headline.json (see gpu_common.py); bench_gpu_qwen3.py calls
run() when its `smollm2` section is selected.

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


def ours(model_dir, prompts, n, async_decode=False, draft_dir=None, device="cuda", kv_cache_tokens=65536):
    """Our decode of `prompts` (n tokens each, greedy, EOS ignored) timed after one untimed run:
    target-only, or speculative with the drafter in draft_dir."""
    from dflash import _core

    cfg = _core.SessionConfig()
    cfg.device = device
    cfg.kv_cache_tokens = kv_cache_tokens  # fixed: other sessions or torch may share the card
    cfg.async_decode = async_decode  # pipelined decoding (each step launched before the last is read)
    if draft_dir is not None:
        cfg.draft_dir = str(draft_dir)
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
        first = sum(len(o.new_tokens) for o in sess.step())  # prefill + first token
        t0 = time.perf_counter()
        steps = 0
        while sess.has_unfinished():
            sess.step()
            steps += 1
        t = time.perf_counter() - t0
        for i in ids:
            sess.take_result(i)
        return t, steps, first

    run()
    before = core_stats(sess)
    t, steps, first = run()
    st = core_stats(sess)
    decoded = len(prompts) * n - first  # tokens of the timed steps
    spec_steps = (stat(st, "num_spec_steps") or 0) - (stat(before, "num_spec_steps") or 0)
    return {"decode_s": t, "steps": steps, "ms_per_step": t / steps * 1e3,
            "decode_tokens_per_s": decoded / t, "tokens_per_step_per_request": decoded / steps / len(prompts),
            "speculative": draft_dir is not None, "spec_steps": spec_steps,
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


def spec_ratios(spec, ar, hf_run):
    """The speculative run against our AR run and transformers (empty without a speculative run)."""
    if spec is None:
        return {}
    return {"spec_step_over_ar_step": spec["ms_per_step"] / ar["ms_per_step"],
            "spec_speedup_over_ar": spec["decode_tokens_per_s"] / ar["decode_tokens_per_s"],
            "spec_speedup_vs_hf": spec["decode_tokens_per_s"] / hf_run["decode_tokens_per_s"]}


def run(out_dir, new_tokens=64, batch_sizes=(1, 16)):
    """Both systems at each batch size; writes DIR/gpu_smollm2_ar.json and the headline key."""
    from dflash.default_model import default_drafter_dir, default_model_dir
    from dflash.tokenizer import Tokenizer

    d = default_model_dir()
    tok = Tokenizer.from_model_dir(d)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    res = {**run_record("gpu_smollm2_ar"), "new_tokens": new_tokens}
    out = Path(out_dir) / "gpu_smollm2_ar.json"
    drafter = default_drafter_dir()
    res["drafter"] = str(drafter) if drafter is not None else None
    for bs in batch_sizes:
        batch = (prompts * ((bs + len(prompts) - 1) // len(prompts)))[:bs]
        o = ours(d, batch, new_tokens)
        free_cuda_memory()
        oa = ours(d, batch, new_tokens, async_decode=True)
        free_cuda_memory()
        sp = ours(d, batch, new_tokens, draft_dir=drafter) if drafter is not None else None
        free_cuda_memory()
        h = hf(d, batch, new_tokens)
        free_cuda_memory()
        res["cuda_graphs"] = o["cuda_graphs"]
        res[f"batch_{bs}"] = r = {"dflash": o, "dflash_async": oa, "dflash_spec": sp, "transformers": h,
                                  "speedup": o["decode_tokens_per_s"] / h["decode_tokens_per_s"],
                                  "speedup_async": oa["decode_tokens_per_s"] / h["decode_tokens_per_s"],
                                  **spec_ratios(sp, o, h)}
        spec = "" if sp is None else (f"; speculative {sp['ms_per_step']:.3f} ms/step ({r['spec_step_over_ar_step']:.2f}x "
                                      f"the AR step, {sp['tokens_per_step_per_request']:.2f} tokens/step) "
                                      f"{sp['decode_tokens_per_s']:.0f} tok/s, {r['spec_speedup_vs_hf']:.2f}x transformers")
        print(f"SmolLM2 batch {bs}: dflash {o['ms_per_step']:.3f} ms/step {o['decode_tokens_per_s']:.0f} tok/s "
              f"(async_decode {oa['ms_per_step']:.3f} ms/step); transformers {h['ms_per_step']:.3f} ms/step "
              f"{h['decode_tokens_per_s']:.0f} tok/s; speedup {r['speedup']:.2f}x "
              f"(async {r['speedup_async']:.2f}x){spec}", flush=True)
        write_json(out, res)
    if "batch_1" in res:
        b1 = res["batch_1"]
        head = {"smollm2_ar_speedup_vs_hf": b1["speedup"], "smollm2_ar_async_speedup_vs_hf": b1["speedup_async"]}
        if "spec_step_over_ar_step" in b1:
            head.update(smollm2_spec_step_over_ar_bs1=b1["spec_step_over_ar_step"],
                        smollm2_spec_speedup_vs_hf=b1["spec_speedup_vs_hf"])
        update_headline(out_dir, head, stamp_prefix="smollm2_")
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
