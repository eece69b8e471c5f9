# tests/gpu/test_cuda_models.py
#
# Whole models on the CUDA backend (bf16 weights and activations, fp32 logits) against the CPU
# backend (fp32) and transformers: logits within the stated bf16 tolerance; greedy generation
# equal, or diverging only where the fp32 reference's top-2 logit gap is below the bf16
# tolerance (the gap is printed); DFlash greedy vs target-only greedy likewise; exact speculative
# sampling (chi-squared) on the GPU. Skipped without a usable Hopper GPU.
from __future__ import annotations

import json

import numpy as np
import pytest

import dflash
from dflash import _core

pytestmark = pytest.mark.skipif(not _core.cuda_usable(), reason="needs the CUDA backend and a Hopper GPU")

# bf16 tolerance: each model's bf16 noise floor is measured as the max |logit| error of
# transformers' own bf16 forward on the GPU against our fp32 CPU forward (random-weight tiny
# models amplify rounding very differently). Our CUDA logits must be within
# TOL_FACTOR x floor (+ LOGIT_ABS) of the fp32 logits, and a greedy divergence is accepted only
# where the fp32 top-2 gap is below TOL_FACTOR x floor.
LOGIT_ABS, TOL_FACTOR = 0.05, 2.0

PRESETS = ["llama_hd64", "qwen3_hd128", "qwen3_hd64_tied_bf16"]  # head_dim 64 / 128


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 352, size=int(rng.integers(4, 24)))] for _ in range(n)]


@pytest.fixture(scope="module")
def sessions(tiny_model_dirs):
    cache = {}

    def get(name, device, **kw):
        key = (name, device, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = dflash.Session(tiny_model_dirs[name], device=device, **kw)
        return cache[key]

    return get


def _forced_logits(sess, prompt, forced):
    from tests.runtime_helpers import forced_run

    logits, _, _ = forced_run(sess, prompt, forced)
    return logits


_FLOORS = {}


def bf16_floor(name, tiny_model_dirs, cpu_sess):
    """Max |logit| error of transformers in bf16 on the GPU vs our fp32 CPU forward."""
    if name not in _FLOORS:
        import torch
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dirs[name]), dtype=torch.bfloat16).cuda().eval()
        worst = 0.0
        for prompt in _prompts(3, seed=1):
            forced = _prompts(1, seed=len(prompt))[0][:9]
            ref = _forced_logits(cpu_sess, prompt, forced)
            with torch.no_grad():
                got = hf(torch.tensor([prompt + forced], device="cuda")).logits[0].float().cpu().numpy()
            worst = max(worst, float(np.max(np.abs(got - ref))))
        _FLOORS[name] = worst
        print(f"{name}: bf16 noise floor (transformers bf16 vs fp32) = {worst:.4f}")
    return _FLOORS[name]


def _first_divergence_gap(cpu_sess, prompt, got, want):
    """Index of the first differing token and the fp32 top-2 gap there."""
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    logits = _forced_logits(cpu_sess, prompt, want[:i])[-1]
    top2 = np.sort(logits)[-2:]
    return i, float(top2[1] - top2[0])


def _check_greedy(cpu_sess, prompt, got, want, label, gap_tol):
    n = min(len(got), len(want))
    if got[:n] == want[:n]:
        return
    i, gap = _first_divergence_gap(cpu_sess, prompt, got, want)
    print(f"{label}: diverges at token {i}; fp32 top-2 gap there {gap:.4f} (tolerance {gap_tol:.4f})")
    assert gap < gap_tol, (label, i, gap)


@pytest.mark.parametrize("name", PRESETS)
def test_logits_cuda_vs_cpu(name, sessions, tiny_model_dirs):
    gpu, cpu = sessions(name, "cuda"), sessions(name, "cpu", num_threads=2)
    tol = LOGIT_ABS + TOL_FACTOR * bf16_floor(name, tiny_model_dirs, cpu)
    for prompt in _prompts(3, seed=1):
        forced = _prompts(1, seed=len(prompt))[0][:9]
        a, b = _forced_logits(gpu, prompt, forced), _forced_logits(cpu, prompt, forced)
        err = float(np.max(np.abs(a - b)))
        print(f"{name}: max |logit(cuda) - logit(cpu)| = {err:.4f} (tolerance {tol:.4f})")
        assert err <= tol


@pytest.mark.parametrize("name", PRESETS)
def test_greedy_cuda_vs_cpu_and_transformers(name, sessions, tiny_model_dirs):
    import torch
    from transformers import AutoModelForCausalLM

    gpu, cpu = sessions(name, "cuda"), sessions(name, "cpu", num_threads=2)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dirs[name]), dtype=torch.bfloat16).cuda().eval()
    prompts = _prompts(6, seed=2)
    params = dflash.SamplingParams(max_tokens=32)
    got = gpu.generate(prompts, params)
    want = cpu.generate(prompts, params)
    eos = list(gpu.model_config.eos_token_ids)
    gap_tol = TOL_FACTOR * bf16_floor(name, tiny_model_dirs, cpu)
    for p, g, w in zip(prompts, got, want):
        _check_greedy(cpu, p, g.token_ids, w.token_ids, f"{name} cuda vs cpu", gap_tol)
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                              eos_token_id=eos, pad_token_id=0)[0, len(p):].tolist()
        _check_greedy(cpu, p, g.token_ids, ref, f"{name} cuda vs transformers(bf16, GPU)", gap_tol)
    st = gpu.stats()
    assert st["num_free_blocks"] == st["num_blocks"]


def test_unsupported_head_dim_is_a_clear_error(tiny_model_dirs):
    with pytest.raises(ValueError, match="head_dim 64 and 128"):
        dflash.Session(tiny_model_dirs["llama_gqa"], device="cuda")  # head_dim 16


@pytest.mark.parametrize("name", ["llama_hd64", "qwen3_hd128"])
def test_dflash_greedy_on_gpu(name, sessions, tiny_model_dirs, tmp_path):
    from dflash.drafter_format import write_dflash_drafter

    target = tiny_model_dirs[name]
    cfg = json.loads((target / "config.json").read_text())
    dr = write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=2, target_layer_ids=[0, 1], block_size=8)
    spec = dflash.Session(target, draft=dr, device="cuda")
    ar_gpu, cpu = sessions(name, "cuda"), sessions(name, "cpu", num_threads=2)
    prompts = _prompts(8, seed=3)
    params = dflash.SamplingParams(max_tokens=40)
    got = spec.generate(prompts, params)
    want = ar_gpu.generate(prompts, params)
    floor = bf16_floor(name, tiny_model_dirs, cpu)
    for p, g, w in zip(prompts, got, want):
        _check_greedy(cpu, p, g.token_ids, w.token_ids, f"{name} dflash(cuda) vs ar(cuda)", TOL_FACTOR * floor)
    # propose on the GPU vs the CPU backend (same drafter)
    spec_cpu = dflash.Session(target, draft=dr, device="cpu", num_threads=2)
    ids_g, logits_g = spec.propose(prompts[0])
    ids_c, logits_c = spec_cpu.propose(prompts[0])
    err = float(np.max(np.abs(logits_g - logits_c)))
    print(f"{name}: propose max |logit(cuda) - logit(cpu)| = {err:.4f}")
    assert err <= LOGIT_ABS + TOL_FACTOR * floor
    st = spec.stats()
    assert st["num_free_blocks"] == st["num_blocks"]


def test_speculative_sampling_chi_squared_on_gpu(tiny_model_dirs, tmp_path):
    from dflash.drafter_format import write_dflash_drafter
    from tests.test_dflash_sampling import _chi2_ok, _target_probs

    target = tiny_model_dirs["llama_hd64"]
    cfg = json.loads((target / "config.json").read_text())
    dr = write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=1, target_layer_ids=[0, 1], block_size=4)
    spec = dflash.Session(target, draft=dr, device="cuda", draft_sampling="greedy")  # oracle drafts: one-hot q
    prompt, first, T = [17, 42, 99, 7, 250, 31], 120, 0.8
    ar_gpu = dflash.Session(target, device="cuda")  # the distribution the GPU target defines
    for top_p in (1.0, 0.8):
        probs = _target_probs(ar_gpu, prompt, first, T, top_p)
        likeliest = int(np.argmax(probs))
        ids = []
        for seed in range(3000):
            req = _core.RequestInput()
            req.prompt = prompt
            req.forced_tokens = [first]
            req.oracle_drafts = [first, likeliest, likeliest, likeliest]
            sc = _core.SamplingConfig()
            sc.max_tokens, sc.temperature, sc.top_p, sc.seed, sc.ignore_eos = 2, T, top_p, seed, True
            req.sampling = sc
            ids.append(spec._core.add_request(req))
        while spec._core.has_unfinished():
            spec._core.step()
        second = np.array([spec._core.take_result(i).token_ids[1] for i in ids])
        chi2, dof, ok = _chi2_ok(second, probs)
        print(f"gpu top_p={top_p}: chi2={chi2:.1f} dof={dof}")
        assert ok
