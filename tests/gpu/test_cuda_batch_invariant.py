# tests/gpu/test_cuda_batch_invariant.py
#
# Batch-invariant kernels (Session(deterministic=True), KernelOptions::batch_invariant): a row's
# bits must not depend on the other rows. Kernel level: the skinny GEMM and its fused forms on the
# batch-invariant shape give row i the same bits for every M (and stay within bf16 rounding of
# torch); more than 16 rows run as 16-row slices of one launch, each equal to its slice alone. Session level, on a random Qwen3 model with a real K split (hidden 1024,
# an intermediate size with a K tail, 8 and 16 warp launches): the logits of a position recorded
# by teacher forcing are bit-identical whether the position is a decode step alone, a decode row
# in a batch with other requests, a row of a prefill, or a row of a chunked prefill; and greedy
# speculative decoding (DFlash drafter, CUDA graphs) emits exactly the target-only greedy tokens,
# batched and alone. The long-context tests put positions past several key tiles of the attention
# kernel (BLOCK_N 64 in chunks of 256 keys), where a row's key tile takes the masked or the
# unmasked loop depending on the other queries of its launch (that is where the SmolLM2 pair
# first diverged: 25/32 GSM8K prompts identical before the attention kernel lost its FMA
# contraction) and a decode row's launch is split over the key chunks while a prefill's is not.
# Skipped without a usable Hopper GPU.
from __future__ import annotations

import json

import numpy as np
import pytest

import dflash
from dflash import _core
from tests.gpu.gpu_helpers import bf16_randn, kernel_ops, requires_cuda, torch
from tests.runtime_helpers import forced_run

pytestmark = requires_cuda

DEV = "cuda"


# ------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("n,k", [(1024, 1024), (5000, 1024), (1024, 2824), (24, 64)])
@pytest.mark.parametrize("out_f32", [False, True])
def test_skinny_gemm_rows_do_not_depend_on_m(n, k, out_f32):
    K = kernel_ops()
    x = bf16_randn(16, k, seed=1)
    w = bf16_randn(n, k, seed=2, scale=0.05)
    dtype = torch.float32 if out_f32 else torch.bfloat16
    full = torch.empty(16, n, device=DEV, dtype=dtype)
    K.cuda_skinny_gemm(x, w, full, batch_invariant=True)
    torch.cuda.synchronize()
    want = (x.double() @ w.double().T)
    tol = 2e-6 * k + (0 if out_f32 else 1) * want.abs() * 2 ** -7
    assert ((full.double() - want).abs() <= tol + 1e-3).all()
    for m in (1, 2, 3, 5, 8, 9, 15):
        part = torch.empty(m, n, device=DEV, dtype=dtype)
        K.cuda_skinny_gemm(x[:m].contiguous(), w, part, batch_invariant=True)
        assert torch.equal(part, full[:m]), f"m={m}: rows differ from the 16-row launch"
    # The rows of a launch that starts at another row are the same too (the backend's slices).
    tail = torch.empty(7, n, device=DEV, dtype=dtype)
    K.cuda_skinny_gemm(x[9:].contiguous(), w, tail, batch_invariant=True)
    assert torch.equal(tail, full[9:])


@pytest.mark.parametrize("mode", ["rms_norm", "silu_mul", "plain"])
def test_fused_skinny_gemm_rows_do_not_depend_on_m(mode):
    K = kernel_ops()
    n, k = 1024, 1024
    inp = bf16_randn(16, 2 * k if mode == "silu_mul" else k, seed=3)
    w = bf16_randn(n, k, seed=4, scale=0.05)
    gamma = bf16_randn(k, seed=5, scale=0.1) + 1 if mode == "rms_norm" else None
    add = mode != "rms_norm"
    base = bf16_randn(16, n, seed=6)
    full = base.clone()
    K.cuda_skinny_gemm_fused(inp, w, full, mode, gamma=gamma, add=add, batch_invariant=True)
    for m in (1, 4, 8, 11):
        part = base[:m].clone()
        K.cuda_skinny_gemm_fused(inp[:m].contiguous(), w, part, mode, gamma=gamma, add=add, batch_invariant=True)
        assert torch.equal(part, full[:m]), f"{mode} m={m}"


@pytest.mark.parametrize("m", [17, 40, 100, 256])
@pytest.mark.parametrize("n,k", [(1024, 1024), (5000, 1024), (24, 64)])
@pytest.mark.parametrize("out_f32", [False, True])
def test_one_launch_of_many_rows_equals_its_16_row_slices(m, n, k, out_f32):
    """More than 16 rows run in one launch (slices of 16 inside it, 2 or 4 slices per CTA: 2 with
    the 16-warp CTAs of N = 1024 and 24, 4 with the 8-warp CTAs of N = 5000 from 3 slices on; 40 and
    100 rows leave the last CTA of each w tile a slice short): every row has the bits of the launch
    of its slice alone, and of a launch of that row alone."""
    K = kernel_ops()
    x = bf16_randn(m, k, seed=7)
    w = bf16_randn(n, k, seed=8, scale=0.05)
    dtype = torch.float32 if out_f32 else torch.bfloat16
    full = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
    K.cuda_skinny_gemm(x, w, full, batch_invariant=True)
    torch.cuda.synchronize()
    for r0 in range(0, m, 16):
        rows = min(16, m - r0)
        part = torch.empty(rows, n, device=DEV, dtype=dtype)
        K.cuda_skinny_gemm(x[r0:r0 + rows].contiguous(), w, part, batch_invariant=True)
        assert torch.equal(part, full[r0:r0 + rows]), f"m={m}: slice at row {r0} differs"
    for r in (0, m // 2, m - 1):
        one = torch.empty(1, n, device=DEV, dtype=dtype)
        K.cuda_skinny_gemm(x[r:r + 1].contiguous(), w, one, batch_invariant=True)
        assert torch.equal(one, full[r:r + 1]), f"m={m}: row {r} alone differs"
    want = x.double() @ w.double().T
    tol = 2e-6 * k + (0 if out_f32 else 1) * want.abs() * 2 ** -7
    assert ((full.double() - want).abs() <= tol + 1e-3).all()


@pytest.mark.parametrize("m", [20, 72, 256])
@pytest.mark.parametrize("n", [1024, 5000])
@pytest.mark.parametrize("mode", ["rms_norm", "silu_mul", "plain"])
def test_one_fused_launch_of_many_rows_equals_its_16_row_slices(mode, n, m):
    """As above for the fused forms; the plain input with the residual add runs 2 (N = 1024) or 4
    (N = 5000) slices per CTA, the staged inputs one."""
    K = kernel_ops()
    k = 1024
    inp = bf16_randn(m, 2 * k if mode == "silu_mul" else k, seed=9)
    w = bf16_randn(n, k, seed=10, scale=0.05)
    gamma = bf16_randn(k, seed=11, scale=0.1) + 1 if mode == "rms_norm" else None
    add = mode != "rms_norm"
    base = bf16_randn(m, n, seed=12)
    full = base.clone()
    K.cuda_skinny_gemm_fused(inp, w, full, mode, gamma=gamma, add=add, batch_invariant=True)
    for r0 in range(0, m, 16):
        rows = min(16, m - r0)
        part = base[r0:r0 + rows].clone()
        K.cuda_skinny_gemm_fused(inp[r0:r0 + rows].contiguous(), w, part, mode, gamma=gamma, add=add,
                                 batch_invariant=True)
        assert torch.equal(part, full[r0:r0 + rows]), f"{mode} m={m}: slice at row {r0} differs"


STREAM_MODES = {"plain": ("plain", False, False), "plain_f32": ("plain", False, True), "add": ("plain", True, False),
                "rms_norm": ("rms_norm", False, False), "silu_mul_add": ("silu_mul", True, False)}


@pytest.mark.parametrize("mode", list(STREAM_MODES))
@pytest.mark.parametrize("n,k", [(5000, 1024), (4096, 4096), (3000, 576), (1024, 1024)])
def test_streaming_kernel_has_the_skinny_kernels_bits(mode, n, k):
    """Deterministic sessions run up to 16 rows on the streaming kernel, launched batch-invariant with
    the skinny kernel's warps, and more rows in the skinny kernel's slices: for every M <= 16 the two
    must give the same bits (N = 1024 asks for 16 warps, whose ring does not fit: the skinny kernel
    alone, as in the backend). Forms that one kernel's shared memory cannot hold are skipped there."""
    K = kernel_ops()
    kind, add, f32 = STREAM_MODES[mode]
    warps = K.cuda_batch_invariant_warps(n)
    assert warps == (16 if -(-n // 16) <= torch.cuda.get_device_properties(0).multi_processor_count else 8)
    w = bf16_randn(n, k, seed=21, scale=0.05)
    gamma = bf16_randn(k, seed=22, scale=0.1) + 1 if kind == "rms_norm" else None
    compared = 0
    for m in (1, 3, 8, 9, 16):
        inp = bf16_randn(m, 2 * k if kind == "silu_mul" else k, seed=23 + m)
        base = bf16_randn(m, n, seed=24 + m)
        a = base.clone().float() if f32 else base.clone()
        b = a.clone()
        try:
            if kind == "plain" and not add:
                K.cuda_skinny_gemm(inp, w, a, batch_invariant=True)
            else:
                K.cuda_skinny_gemm_fused(inp, w, a, kind, gamma=gamma, add=add, batch_invariant=True)
            K.cuda_stream_gemm(inp, w, b, mode=kind, gamma=gamma, add=add, warps=warps, batch_invariant=True)
        except ValueError as e:
            assert "unsupported" in str(e)
            continue
        torch.cuda.synchronize()
        assert torch.equal(a, b), f"{mode} N={n} K={k} M={m}: the streaming kernel differs from the skinny kernel"
        compared += 1
    if warps == 8 and kind == "plain":
        assert compared == 5, f"{mode} N={n} K={k}: the plain forms must run on both kernels"


# ------------------------------------------------------------------------------- sessions


@pytest.fixture(scope="module")
def invariant_model(tmp_path_factory):
    from tests.fixtures.tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("bi") / "qwen3_1k", arch="qwen3", hidden_size=1024,
                            num_layers=3, num_heads=16, num_kv_heads=4, head_dim=128, intermediate_size=2824,
                            vocab_size=5000, dtype="bfloat16", rope_theta=1000000.0, seed=11,
                            max_position_embeddings=2048)


@pytest.fixture(scope="module")
def invariant_model_hd64(tmp_path_factory):
    """SmolLM2-135M's layer geometry (hidden 576, 9 query / 3 KV heads of 64, intermediate 1536,
    tied embeddings): the head_dim-64 attention kernel and K = 576 / 1536 GEMMs."""
    from tests.fixtures.tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("bi64") / "llama_576", arch="llama", hidden_size=576,
                            num_layers=3, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                            vocab_size=5000, tie_word_embeddings=True, dtype="bfloat16", rope_theta=100000.0,
                            seed=12, max_position_embeddings=2048)


def _session(model, **kw):
    kw.setdefault("kv_cache_tokens", 16384)
    kw.setdefault("max_num_seqs", 8)
    return dflash.Session(model, device="cuda", deterministic=True, **kw)


def _forced_batch(session, requests):
    """Runs (prompt, forced) requests together; returns each one's logits [len(prompt) + len(forced), V]."""
    ids = []
    for prompt, forced in requests:
        req = _core.RequestInput()
        req.prompt = list(prompt)
        req.forced_tokens = list(forced) + [0]
        req.record_logits = req.record_prompt_logits = True
        s = _core.SamplingConfig()
        s.max_tokens, s.ignore_eos = len(forced) + 1, True
        req.sampling = s
        ids.append(session._core.add_request(req))
    while session._core.has_unfinished():
        session._core.step()
    vocab = session.model_config.vocab_size
    return [np.asarray(session._core.take_result(i).logits(vocab)) for i in ids]


def test_a_positions_logits_are_the_same_bits_in_every_kind_of_step(invariant_model):
    rng = np.random.default_rng(0)
    vocab = 5000
    prompt = [int(t) for t in rng.integers(3, vocab, size=37)]
    forced = [int(t) for t in rng.integers(3, vocab, size=20)]
    n = len(prompt) + len(forced)
    s = _session(invariant_model)
    assert s.stats()["deterministic"] is True
    alone, _, _ = forced_run(s, prompt, forced)  # prefill of 37 rows, then 20 one-row decode steps
    assert alone.shape[0] == n and np.isfinite(alone).all()
    # Every position as a row of one prefill.
    as_prefill, _, _ = forced_run(s, prompt + forced, [])
    assert np.array_equal(as_prefill[:n], alone), "prefill rows differ from decode rows"
    # Decoded in a batch beside requests of other lengths (prefill and decode rows mixed).
    others = [([int(t) for t in rng.integers(3, vocab, size=m)], [int(t) for t in rng.integers(3, vocab, size=f)])
              for m, f in ((5, 30), (90, 8), (13, 25), (1, 17))]
    batched = _forced_batch(s, [others[0], (prompt, forced), *others[1:]])
    assert np.array_equal(batched[1], alone), "rows differ when decoded in a batch"
    s.close()
    # Prefilled in chunks of 16 tokens (rows of a chunk boundary included).
    chunked = _session(invariant_model, max_num_batched_tokens=16)
    rows, _, _ = forced_run(chunked, prompt + forced, [])
    assert chunked.stats()["num_prefill_chunks"] >= 4
    assert np.array_equal(rows[:n], alone), "chunked prefill rows differ"
    chunked.close()


def test_default_kernels_are_not_batch_invariant_here(invariant_model):
    """The check above is not vacuous: without deterministic=True the same comparison differs
    somewhere (cuBLASLt and the CUDA decode kernel reduce in other orders)."""
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, 5000, size=37)]
    forced = [int(t) for t in rng.integers(3, 5000, size=20)]
    s = dflash.Session(invariant_model, device="cuda", kv_cache_tokens=16384, max_num_seqs=8)
    assert s.stats()["deterministic"] is False
    alone, _, _ = forced_run(s, prompt, forced)
    as_prefill, _, _ = forced_run(s, prompt + forced, [])
    s.close()
    n = len(prompt) + len(forced)
    # The same model within bf16 noise (a random model's logits drift by a few percent)...
    assert np.abs(as_prefill[:n] - alone).max() <= 0.1 * np.abs(alone).max()
    assert (as_prefill[:n].argmax(1) == alone.argmax(1)).mean() >= 0.9
    # ... but not the same bits.
    assert not np.array_equal(as_prefill[:n], alone)


def _drafter(tmp_path, target):
    from dflash.drafter_format import write_dflash_drafter

    cfg = json.loads((target / "config.json").read_text())
    return write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=1, target_layer_ids=[0, 2],
                                block_size=8)


@pytest.mark.parametrize("which,lengths,max_tokens,kind", [
    ("hd128", (7, 33, 64, 12, 90, 3), 48, "dflash"),
    # 160 tokens from prompts of 50..200: verify blocks of 8 rows straddle the 64-key tiles.
    ("hd64", (50, 121, 200, 77), 160, "dflash"),
    # DFlash2 (greedy lattice walk): its verify rows are the candidates' paths, 8 rows a block.
    ("hd128", (7, 33, 64, 12, 90, 3), 48, "dflash2"),
    ("hd64", (50, 121, 200, 77), 160, "dflash2"),
])
def test_speculative_greedy_equals_target_only_greedy(which, lengths, max_tokens, kind, invariant_model,
                                                       invariant_model_hd64, tmp_path):
    model = invariant_model_hd64 if which == "hd64" else invariant_model
    rng = np.random.default_rng(1 if which == "hd128" else 3)
    prompts = [[int(t) for t in rng.integers(3, 5000, size=m)] for m in lengths]
    greedy = dflash.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    target_only = _session(model, draft="none")
    want_batched = [o.token_ids for o in target_only.generate(prompts, greedy)]
    want_alone = [target_only.generate([p], greedy)[0].token_ids for p in prompts[:3]]
    assert target_only.stats()["graph_steps"] > 0
    target_only.close()
    from tests.runtime_helpers import oracle_run, small_dflash2

    drafter = _drafter(tmp_path, model) if kind == "dflash" else small_dflash2(tmp_path, model, block_size=8)
    spec = _session(model, draft=str(drafter), draft_sampling="greedy")
    # DFlash: oracle drafts (the target's own greedy tokens) make every verify row count; the
    # random drafter's own drafts are rejected at various positions.
    oracle = None
    if kind == "dflash":
        oracle = [list(r.token_ids) for r in oracle_run(spec, prompts, want_batched, max_tokens=max_tokens,
                                                         ignore_eos=True)]
    got_batched = [o.token_ids for o in spec.generate(prompts, greedy)]
    got_alone = [spec.generate([p], greedy)[0].token_ids for p in prompts[:3]]
    stats = spec.stats()
    spec.close()
    assert stats["num_spec_steps"] > 0 and stats["graph_steps"] > 0 and stats["deterministic"] is True
    if kind == "dflash2":
        assert stats["draft_sampling"] == "greedy_walk"
    assert want_alone == want_batched[:3]
    assert got_batched == want_batched
    assert got_alone == want_alone
    if oracle is not None:
        assert oracle == [list(w) for w in want_batched], "verify rows (oracle drafts) differ from target-only decode"


@pytest.mark.parametrize("which", ["hd64", "hd128"])
def test_positions_past_many_key_tiles_keep_their_bits(which, invariant_model, invariant_model_hd64):
    """Positions 0..619 cross the 64-key tiles and the 256-key chunks of the attention kernel several
    times: a decode row alone (one query in its launch, split over its 3 key chunks), the same
    position as a row of a 620-row prefill (its tile's first query up to 63 positions earlier,
    the chunks folded in the kernel) and as a row of 16-token prefill chunks get the same bits."""
    model = invariant_model_hd64 if which == "hd64" else invariant_model
    rng = np.random.default_rng(2)
    prompt = [int(t) for t in rng.integers(3, 5000, size=560)]
    forced = [int(t) for t in rng.integers(3, 5000, size=60)]
    n = len(prompt) + len(forced)
    s = _session(model)
    alone, _, _ = forced_run(s, prompt, forced)
    assert alone.shape[0] == n and np.isfinite(alone).all()
    as_prefill, _, _ = forced_run(s, prompt + forced, [])
    s.close()
    differ = np.flatnonzero((as_prefill[:n] != alone).any(axis=1))
    assert differ.size == 0, f"{which}: prefill rows differ from decode rows at positions {differ[:10].tolist()}"
    chunked = _session(model, max_num_batched_tokens=16)
    rows, _, _ = forced_run(chunked, prompt + forced, [])
    chunked.close()
    differ = np.flatnonzero((rows[:n] != alone).any(axis=1))
    assert differ.size == 0, f"{which}: chunked-prefill rows differ at positions {differ[:10].tolist()}"
