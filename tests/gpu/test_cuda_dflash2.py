# tests/gpu/test_cuda_dflash2.py
#
# DFlash2 on the CUDA backend. Kernels (grouped conv, bf16 scale, edge scores) against short
# torch references over odd sizes; whole drafters (published layout too: sliding layers with
# is_causal false) in CUDA graphs, with the exact and the FP8 candidate head: greedy speculative
# output equals target greedy on the GPU
# (or diverges only where the fp32 top-2 gap is within the bf16 tolerance), graphs equal eager,
# the candidates / edges / walk of propose_details agree with the CPU backend and with each
# other, chi-squared exactness of the K-candidate proposal and of probabilistic DFlash (v1)
# drafts on the GPU, no leaked KV blocks, and refusals of geometries beyond the kernels' limits.
from __future__ import annotations


import numpy as np
import pytest

import dflash
from dflash import _core
from dflash.drafter_format import write_dflash_drafter
from tests.gpu.gpu_helpers import bf16_randn, gpu_dflash2, kernel_ops, torch
from tests.runtime_helpers import DRAFT_PROMPTS, assert_greedy_walk_like_walk, greedy_ids, target_config

pytestmark = pytest.mark.skipif(not _core.cuda_usable(), reason="needs the CUDA backend and a Hopper GPU")

DEV = "cuda"
PROMPTS = DRAFT_PROMPTS
MAX_TOKENS = 24  # greedy generations










# --------------------------------------------------------------------------------------------
# Kernels


def conv_ref(x, base, deltas, side, block, group):
    """The grouped dynamic conv's explicit loop (spec 2.1) over fp32 copies of the bf16 inputs."""
    n, h = x.shape
    taps = base.shape[1]
    groups = h // group
    d = deltas.float().view(n, 2, taps, groups)[:, side]  # [N, T, G]
    coef = base.float()[side].unsqueeze(0) + d.repeat_interleave(group, dim=2)  # [N, T, H]
    out = torch.zeros(n, h, device=x.device)
    pos = torch.arange(n, device=x.device) % block
    xf = x.float()
    for t in range(taps):
        shifted = torch.zeros_like(xf)
        shifted[t:] = xf[: n - t]
        out += coef[:, t] * shifted * (pos >= t).unsqueeze(1)
    return out


@pytest.mark.parametrize("rows,block,hidden,group,taps", [
    (8, 8, 4096, 16, 2), (16, 8, 5120, 16, 2), (15, 5, 128, 8, 3), (12, 4, 72, 4, 4), (7, 7, 24, 24, 1),
    (32, 16, 120, 12, 2),
])
@pytest.mark.parametrize("side", [0, 1])
def test_grouped_conv(rows, block, hidden, group, taps, side):
    K = kernel_ops()
    x = bf16_randn(rows, hidden, seed=rows + hidden)
    base = bf16_randn(2, taps, hidden, seed=3, scale=0.5)
    deltas = bf16_randn(rows, 2 * taps * (hidden // group), seed=4, scale=0.5)
    want = conv_ref(x, base, deltas, side, block, group)
    out = torch.full((rows, hidden), float("nan"), device=DEV, dtype=torch.bfloat16)
    K.cuda_grouped_conv(x, base, deltas, side, block, group, False, out)
    torch.testing.assert_close(out.float(), want, rtol=2 ** -7, atol=1e-2)
    # accumulate: a residual stream gets the conv added (one rounding)
    residual = bf16_randn(rows, hidden, seed=9)
    acc = residual.clone()
    K.cuda_grouped_conv(x, base, deltas, side, block, group, True, acc)
    torch.testing.assert_close(acc.float(), residual.float() + want, rtol=2 ** -7, atol=2e-2)


def test_grouped_conv_refusals():
    K = kernel_ops()
    x = bf16_randn(6, 64, seed=1)
    base = bf16_randn(2, 2, 64, seed=2)
    deltas = bf16_randn(6, 2 * 2 * 4, seed=3)
    out = torch.empty_like(x)
    with pytest.raises(Exception, match="grouped_conv"):
        K.cuda_grouped_conv(x, base, deltas, 0, 4, 16, False, out)  # 6 rows are not whole blocks of 4
    with pytest.raises(Exception, match="grouped_conv"):
        K.cuda_grouped_conv(x, base, deltas, 2, 3, 16, False, out)  # side 2


@pytest.mark.parametrize("n", [1, 7, 4096, 5121])
def test_scale_bf16(n):
    x = bf16_randn(n, seed=n)
    want = x.float() * 1.7
    kernel_ops().cuda_scale_bf16(x, 1.7)
    torch.testing.assert_close(x.float(), want, rtol=2 ** -8, atol=0)


def edges_ref(ids, unary, gate, anchors, A, B):
    r, s, k = ids.shape
    pred = torch.empty_like(ids)
    pred[:, 0, :] = anchors.view(r, 1)
    pred[:, 1:, :] = ids[:, :-1, :]
    a = A.float()[pred.long()]  # [R, S, K, r]
    b = B.float()[ids.long()]  # [R, S, K, r]
    return unary.unsqueeze(2) + torch.einsum("bspj,bsj,bscj->bspc", a, gate, b)


@pytest.mark.parametrize("reqs,slots,k,rank,vocab", [
    (1, 7, 16, 256, 151936), (8, 7, 16, 256, 5000), (3, 15, 5, 24, 300), (2, 3, 64, 1024, 2000), (32, 7, 16, 256, 999),
    (1, 1, 1, 7, 10),
])
def test_edge_scores(reqs, slots, k, rank, vocab):
    g = torch.Generator(device=DEV).manual_seed(reqs * 100 + k)
    ids = torch.stack([torch.randperm(vocab, device=DEV, generator=g)[:k] for _ in range(reqs * slots)]).view(
        reqs, slots, k).to(torch.int32)
    unary = torch.randn(reqs, slots, k, device=DEV, generator=g)
    gate = torch.randn(reqs, slots, rank, device=DEV, generator=g)
    anchors = torch.randint(0, vocab, (reqs,), device=DEV, generator=g, dtype=torch.int32)
    A = bf16_randn(vocab, rank, seed=5, scale=0.3)
    B = bf16_randn(vocab, rank, seed=6, scale=0.3)
    edges = torch.full((reqs, slots, k, k), float("nan"), device=DEV)
    kernel_ops().cuda_edge_scores(ids, unary, gate, anchors, A, B, edges)
    want = edges_ref(ids, unary, gate, anchors, A, B)
    err = (edges - want).abs().max().item()
    print(f"edges R={reqs} S={slots} K={k} r={rank}: max abs err {err:.3g}")
    torch.testing.assert_close(edges, want, rtol=1e-5, atol=1e-4)
    # slot 0: every predecessor row is the anchor's
    assert torch.equal(edges[:, 0, 0], edges[:, 0, -1])
    again = torch.empty_like(edges)
    kernel_ops().cuda_edge_scores(ids, unary, gate, anchors, A, B, again)
    assert torch.equal(edges, again)


# --------------------------------------------------------------------------------------------
# Whole drafters


GEOMETRIES = [
    ("llama_hd64", dict(block_size=4, conv_kernel_size=2, conv_group_size=16, selector_top_k=8)),
    ("llama_hd64", dict(block_size=8, conv_kernel_size=3, conv_group_size=8, selector_top_k=32, output_multiplier=0.5,
                        final_logit_softcapping=3.0, input_embedding_scale=1.5, num_layers=2)),
    # the published layout: sliding layers with is_causal false (symmetric windows)
    ("qwen3_hd128", dict(block_size=8, num_layers=2, layer_types=["sliding_attention"] * 2, sliding_window=4,
                         is_causal=False, selector_top_k=16, dtype="bfloat16")),
    ("qwen3_hd64_tied_bf16", dict(block_size=16, conv_group_size=16, selector_top_k=64, selector_rank=64)),
]


@pytest.mark.parametrize("draft_head", ["exact", "fp8"])
@pytest.mark.parametrize("preset,geometry", GEOMETRIES)
def test_greedy_speculative_equals_target_greedy_on_gpu(tmp_path, tiny_model_dirs, preset, geometry, draft_head):
    from tests.gpu.test_cuda_models import TOL_FACTOR, _check_greedy, bf16_floor

    target = tiny_model_dirs[preset]
    d = gpu_dflash2(tmp_path, target, **geometry)
    spec = dflash.Session(target, draft=d, device="cuda", draft_head=draft_head)
    eager = dflash.Session(target, draft=d, device="cuda", cuda_graphs=False, draft_head=draft_head)
    ar = dflash.Session(target, device="cuda")
    cpu = dflash.Session(target, device="cpu", num_threads=2)
    got, want = greedy_ids(spec, PROMPTS, MAX_TOKENS), greedy_ids(ar, PROMPTS, MAX_TOKENS)
    floor = bf16_floor(preset, tiny_model_dirs, cpu)
    for p, g, w in zip(PROMPTS, got, want):
        _check_greedy(cpu, p, g, w, f"{preset} dflash2 {draft_head} head (cuda) vs ar(cuda)", TOL_FACTOR * floor)
    alone = [greedy_ids(spec, [p], MAX_TOKENS)[0] for p in PROMPTS]
    for p, a, w in zip(PROMPTS, alone, want):
        _check_greedy(cpu, p, a, w, f"{preset} dflash2 {draft_head} head (cuda) alone vs ar(cuda)", TOL_FACTOR * floor)
    assert greedy_ids(eager, PROMPTS, MAX_TOKENS) == got  # graph replay == eager
    st = spec.stats()
    assert st["graph_steps"] > 0 and st["eager_steps"] == 0
    assert eager.stats()["graph_steps"] == 0
    assert st["num_free_blocks"] == st["num_blocks"]


def test_propose_details_on_gpu_match_cpu_and_are_consistent(tmp_path, tiny_model_dirs):
    target = tiny_model_dirs["llama_hd64"]
    d = gpu_dflash2(tmp_path, target, block_size=8, selector_top_k=16, selector_rank=32, output_multiplier=0.7,
                 final_logit_softcapping=5.0)
    gpu = dflash.Session(target, draft=d, device="cuda")
    cpu = dflash.Session(target, draft=d, device="cpu", num_threads=2)
    for prompt in PROMPTS:
        g, c = gpu.propose_details(prompt), cpu.propose_details(prompt)
        k = g["k"]
        n = len(g["draft_ids"])
        # the walk follows its own lattice: draft s = candidate argmax of the row of the previous pick
        prev = 0
        for s in range(n):
            row = g["edges"][s, prev]
            assert np.array_equal(np.asarray(g["realized"]).reshape(n, k)[s], row)
            idx = int(np.argmax(row))
            assert g["draft_ids"][s] == g["candidate_ids"][s, idx]
            prev = idx
        # candidates: the GPU's top-K of its own LM-head logits (bf16 rounding can reorder near-ties)
        logits = np.asarray(g["draft_logits"])
        for s in range(n):
            top = np.sort(logits[s])[::-1][:k]
            chosen = logits[s][g["candidate_ids"][s]]
            np.testing.assert_allclose(np.sort(chosen)[::-1], top, rtol=0, atol=0)
        # against the CPU backend (fp32): the K best values agree within the bf16 tolerance of the
        # logits (ids of near-ties may swap), and most candidates are the same tokens
        err = float(np.max(np.abs(np.asarray(g["draft_logits"]) - np.asarray(c["draft_logits"]))))
        gu, cu = np.asarray(g["unary"]).reshape(n, k), np.asarray(c["unary"]).reshape(n, k)
        shared = np.mean([len(set(g["candidate_ids"][s]) & set(c["candidate_ids"][s])) / k for s in range(n)])
        print(f"propose: max |logit(cuda) - logit(cpu)| {err:.4f}; max |unary diff| "
              f"{float(np.max(np.abs(gu - cu))):.4f}; {shared * 100:.0f} % of candidates shared")
        np.testing.assert_allclose(gu, cu, atol=2 * err + 1e-3, rtol=0)
        assert shared >= 0.6


N = 2000


def _assert_exact_sampling(spec, target, top_p, label):
    """The token sampled after a forced first token through the speculative step (its first draft
    goes through acceptance) follows the GPU target's distribution (chi-squared over N seeds), at
    T = 1.5 (a flat enough target: several tokens under top-p), with both branches of the
    rejection sampler exercised."""
    from tests.test_dflash_sampling import check_sampled_second_token

    ar = dflash.Session(target, device="cuda")  # the distribution the GPU target defines
    # (the greedy walk: one fixed draft of target probability ~ 1/V, rarely accepted)
    _, dof = check_sampled_second_token(spec, ar, [17, 42, 99, 7, 250, 31], 120, 1.5, top_p, N, f"GPU {label}",
                                        min_accepted=0 if label.endswith("greedy walk") else 10)
    assert dof >= (3 if top_p == 1.0 else 1)  # a distribution, not one certain token


@pytest.mark.parametrize("draft_head", ["exact", "fp8"])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_k_candidate_sampling_is_exact_on_gpu(tmp_path, tiny_model_dirs, top_p, draft_head):
    target = tiny_model_dirs["llama_hd64"]
    # K = 64 of a tiny vocabulary and nearly flat scores, so drafts are accepted often enough.
    d = gpu_dflash2(tmp_path, target, block_size=4, selector_top_k=64, seed=5, init_std=0.02, output_multiplier=1e-3)
    spec = dflash.Session(target, draft=d, device="cuda", draft_head=draft_head)
    _assert_exact_sampling(spec, target, top_p, f"DFlash2 {draft_head} head")


def test_greedy_walk_is_exact_on_gpu_and_drafts_like_the_cpu(tmp_path, tiny_model_dirs):
    """draft_sampling="greedy" (the argmax walk at T > 0, one-hot proposals) on the GPU: the
    default walk's drafts at T = 0 with realized rows one-hot at the walked candidate, and exact
    sampling (chi-squared)."""
    target = tiny_model_dirs["llama_hd64"]
    d = gpu_dflash2(tmp_path, target, block_size=4, selector_top_k=64, seed=5, init_std=0.02, output_multiplier=1e-3)
    spec = dflash.Session(target, draft=d, device="cuda", draft_sampling="greedy")
    assert spec.stats()["draft_sampling"] == "greedy_walk"
    walk = dflash.Session(target, draft=d, device="cuda")
    assert_greedy_walk_like_walk(spec, walk, PROMPTS[:3])
    _assert_exact_sampling(spec, target, 1.0, "DFlash2 greedy walk")


@pytest.mark.parametrize("draft_head", ["exact", "fp8"])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_probabilistic_dflash_drafts_are_exact_on_gpu(tmp_path, tiny_model_dirs, top_p, draft_head):
    target = tiny_model_dirs["llama_hd64"]
    d1 = write_dflash_drafter(tmp_path / "d1", target_config=target_config(target), num_layers=1, target_layer_ids=[0, 1],
                              block_size=4, init_std=0.02)
    spec = dflash.Session(target, draft=d1, device="cuda", draft_sampling="probabilistic", draft_head=draft_head)
    _assert_exact_sampling(spec, target, top_p, f"probabilistic DFlash {draft_head} head")


def test_seeded_sampling_on_gpu_is_reproducible(tmp_path, tiny_model_dirs):
    target = tiny_model_dirs["qwen3_hd128"]
    d = gpu_dflash2(tmp_path, target, block_size=5, selector_top_k=16)
    spec = dflash.Session(target, draft=d, device="cuda")
    params = [dflash.SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=11 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    first = [o.token_ids for o in spec.generate(PROMPTS, params)]
    again = [o.token_ids for o in spec.generate(PROMPTS, params)]
    assert first == again
    st = spec.stats()
    assert st["num_free_blocks"] == st["num_blocks"]


@pytest.mark.parametrize("draft_head", ["exact", "fp8"])
@pytest.mark.parametrize("draft_sampling", ["probabilistic", "greedy"])
def test_dflash_at_temperature_zero_is_greedy_on_gpu(tmp_path, tiny_model_dirs, draft_sampling, draft_head):
    from tests.gpu.test_cuda_models import TOL_FACTOR, _check_greedy, bf16_floor

    preset = "qwen3_hd128"
    target = tiny_model_dirs[preset]
    d1 = write_dflash_drafter(tmp_path / "d1", target_config=target_config(target), num_layers=1, target_layer_ids=[0, 1],
                              block_size=5)
    spec = dflash.Session(target, draft=d1, device="cuda", draft_sampling=draft_sampling, draft_head=draft_head)
    ar = dflash.Session(target, device="cuda")
    cpu = dflash.Session(target, device="cpu", num_threads=2)
    floor = bf16_floor(preset, tiny_model_dirs, cpu)
    label = f"{draft_sampling} dflash {draft_head} head (cuda) at T=0 vs ar(cuda)"
    for p, g, w in zip(PROMPTS, greedy_ids(spec, PROMPTS, MAX_TOKENS), greedy_ids(ar, PROMPTS, MAX_TOKENS)):
        _check_greedy(cpu, p, g, w, label, TOL_FACTOR * floor)
    st = spec.stats()
    assert st["graph_steps"] > 0 and st["num_spec_steps"] > 0
    assert st["num_free_blocks"] == st["num_blocks"]


def test_geometry_beyond_the_kernel_limits_is_refused(tmp_path, tiny_model_dirs):
    target = tiny_model_dirs["llama_hd64"]
    d = gpu_dflash2(tmp_path, target, selector_top_k=65)
    with pytest.raises(dflash.DFlashError, match=r"selector_top_k 65 is above the CUDA top-K"):
        dflash.Session(target, draft=d, device="cuda")
    dflash.Session(target, draft=d, device="cpu", num_threads=1)  # the CPU backend has no such limit
    d = gpu_dflash2(tmp_path, target, name="r", selector_rank=2048)
    with pytest.raises(dflash.DFlashError, match=r"selector_rank 2048"):
        dflash.Session(target, draft=d, device="cuda")
