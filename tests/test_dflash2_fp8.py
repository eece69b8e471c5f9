# tests/test_dflash2_fp8.py
#
# DFlash2's FP8 candidate head (draft_head="fp8") on the CPU backend: the host e4m3 codec against
# torch.float8_e4m3fn (every code, round-to-nearest-even ties, subnormals, saturation at +-448,
# NaN), the per-row quantization against a torch reference (zero rows get scale 1, never NaN),
# linear_fp8 against a torch dequantize-and-matmul reference, the exact re-score (values, order,
# ties), candidates picked on the FP8 head equal to the exact top-K when the logits are well
# separated; end to end: greedy speculative output with draft_head="fp8" equals target greedy,
# the unary scores of propose_details are the exact head's values of the chosen ids, the
# K-candidate proposal stays exact at T > 0 (chi-squared), and the refusals (no drafter, an
# unknown value; a DFlash v1 drafter takes the FP8 head too: tests/test_dflash_fp8_head.py).
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import dflash
from dflash import _core
from dflash.drafter_format import write_dflash_drafter
from tests.runtime_helpers import DRAFT_PROMPTS, assert_greedy_like_target, small_dflash2, target_config
from tests.test_dflash_sampling import check_sampled_second_token

K = _core.testing
PROMPTS = DRAFT_PROMPTS








def torch_encode(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def torch_decode(q: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)).view(torch.float8_e4m3fn).float().numpy()


def quantize_ref(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row e4m3 quantization in torch: scale = max|w| / 448 (1 for a zero row), q = e4m3(w / scale)."""
    t = torch.from_numpy(w.astype(np.float32))
    scale = t.abs().amax(dim=1) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (t / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return q.numpy(), scale.numpy()


# --------------------------------------------------------------------------------------------
# The e4m3 codec


def test_decode_matches_torch_for_every_code():
    codes = np.arange(256, dtype=np.uint8)
    got, want = K.cpu_fp8_decode(codes), torch_decode(codes)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got).sum() == 2  # 0x7F and 0xFF
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok], want[ok])
    assert got[0x7E] == 448.0 and got[0xFE] == -448.0 and got[0x01] == 2.0 ** -9


def test_encode_round_trips_every_finite_code():
    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=np.uint8)
    assert np.array_equal(K.cpu_fp8_encode(K.cpu_fp8_decode(codes)), codes)


def test_encode_matches_torch_rounding():
    g = np.random.default_rng(0)
    finite = np.sort(np.unique(K.cpu_fp8_decode(np.arange(0, 0x7F, dtype=np.uint8))))  # 0 .. 448
    mids = (finite[1:] + finite[:-1]) / 2  # exact ties: round half to even
    near = np.concatenate([mids, np.nextafter(mids, np.inf, dtype=np.float32),
                           np.nextafter(mids, -np.inf, dtype=np.float32)]).astype(np.float32)
    values = np.concatenate([
        near, -near,
        g.uniform(-464, 464, 20000),
        g.standard_normal(20000) * 2.0 ** g.integers(-14, 8, 20000),  # every binade, subnormals included
        g.uniform(-2.0 ** -6, 2.0 ** -6, 5000),  # the subnormal range
        [0.0, -0.0, 2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -20, 448.0, 460.0, 464.0, -464.0],
    ]).astype(np.float32)
    got, want = K.cpu_fp8_encode(values), torch_encode(values)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(float(values[i]), int(got[i]), int(want[i])) for i in bad[:10]]


def test_encode_saturates_and_keeps_nan():
    values = np.array([464.5, 480.0, 500.0, 1e30, np.inf, -500.0, -np.inf, np.nan], dtype=np.float32)
    assert K.cpu_fp8_encode(values).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F]


# --------------------------------------------------------------------------------------------
# Ops


def _weights(v, h, seed, spread=True):
    g = np.random.default_rng(seed)
    w = g.standard_normal((v, h)).astype(np.float32)
    if spread:  # rows of very different magnitudes, and small entries that land on subnormal codes
        w *= (2.0 ** g.integers(-8, 8, v)).astype(np.float32)[:, None]
        w[:, ::7] *= 1e-3
    return w


def test_fp8_rows_matches_the_torch_quantization():
    w = _weights(300, 96, seed=1)
    w[5] = 0.0  # a zero row: scale 1, all zero bytes, no NaN
    w[6, 3] = -0.0
    w[7] = 1e-30  # a tiny row (scale a subnormal float)
    q, scale = K.cpu_fp8_rows(w)
    want_q, want_scale = quantize_ref(w)
    assert q.dtype == np.uint8 and q.shape == w.shape and scale.shape == (300,)
    assert np.array_equal(scale, want_scale)
    assert np.array_equal(q, want_q)
    assert scale[5] == 1.0 and not q[5].any()
    deq = torch_decode(q) * scale[:, None]
    assert np.isfinite(deq).all()
    # every row uses its full range: the largest magnitude lands on +-448
    assert np.all(np.abs(torch_decode(q[np.arange(300) != 5])).max(axis=1) == 448.0)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 above the subnormal range
    big = np.abs(w) >= scale[:, None] * 2.0 ** -6
    assert np.all(np.abs(deq - w)[big] <= np.abs(w)[big] * 2.0 ** -4)


@pytest.mark.parametrize("m,v,h", [(1, 1000, 64), (7, 513, 96), (33, 77, 160), (3, 5, 16)])
def test_linear_fp8_matches_torch(m, v, h):
    g = np.random.default_rng(m * 1000 + v)
    q, scale = K.cpu_fp8_rows(_weights(v, h, seed=v))
    x = g.standard_normal((m, h)).astype(np.float32)
    out = K.cpu_linear_fp8(x, q, scale)
    deq = torch.from_numpy(torch_decode(q)).double() * torch.from_numpy(scale).double()[:, None]
    want = (torch.from_numpy(x).double() @ deq.T).numpy()
    bound = (np.abs(x) @ np.abs(deq.numpy()).T) * 1e-6 + 1e-30
    assert out.shape == (m, v) and out.dtype == np.float32
    assert np.all(np.abs(out - want) <= bound)


def _rank(values, ids):
    """topk_candidates' order: value descending, lowest id first on ties."""
    return sorted(range(len(ids)), key=lambda j: (-values[j], ids[j]))


@pytest.mark.parametrize("multiplier,softcap", [(1.0, 0.0), (0.5, 3.0)])
def test_rescore_candidates_exact_values_and_order(multiplier, softcap):
    g = np.random.default_rng(4)
    v, h, r, k = 400, 48, 6, 12
    head = g.standard_normal((v, h)).astype(np.float32)
    head[11] = head[10]  # a tie: lowest id first
    hs = g.standard_normal((r, h)).astype(np.float32)
    ids = np.stack([12 + g.permutation(v - 12)[:k] for _ in range(r)]).astype(np.int32)
    ids[0, :2] = [11, 10]
    out_ids, unary = K.cpu_rescore_candidates(hs, head, ids, multiplier, softcap)
    for row in range(r):
        exact = hs[row].astype(np.float64) @ head[ids[row]].astype(np.float64).T
        order = _rank(np.float32(exact), ids[row])
        assert out_ids[row].tolist() == ids[row][order].tolist()
        want = exact[order] * multiplier
        if softcap > 0:
            want = softcap * np.tanh(want / softcap)
        np.testing.assert_allclose(unary[row], want, rtol=1e-5, atol=1e-5)
    pos = out_ids[0].tolist()
    assert pos.index(10) == pos.index(11) - 1


def test_fp8_candidates_equal_the_exact_top_k_when_well_separated():
    """Each row's top K logits (10 .. 2.5) far above the rest (-5 .. -4), beyond the FP8 head's
    error: the FP8 top-K is the exact top-K set, and after the re-score the ids, their order and
    the unary values are those of the exact path."""
    g = np.random.default_rng(9)
    v, h, r, k = 2000, 128, 5, 16
    u = np.linalg.qr(g.standard_normal((h, r)))[0].T.astype(np.float32)  # r orthonormal rows
    c = g.uniform(-5.0, -4.0, (r, v))
    for row in range(r):
        c[row, g.permutation(v)[:k]] = 10.0 - 0.5 * np.arange(k)
    head = (c.T @ u).astype(np.float32) + g.standard_normal((v, h)).astype(np.float32) * 1e-4
    exact = (u @ head.T).astype(np.float32)
    q, scale = K.cpu_fp8_rows(head)
    fp8 = K.cpu_linear_fp8(u, q, scale)
    err = float(np.max(np.abs(fp8 - exact)))
    print(f"max |fp8 logit - exact logit| {err:.3f} (gap 6.5)")
    assert err < 3.0
    ids, _ = K.cpu_topk_candidates(fp8, k, 1.0, 0.0)
    ids = np.asarray(ids, dtype=np.int32).reshape(r, k)
    got_ids, got_unary = K.cpu_rescore_candidates(u, head, ids, 0.7, 2.0)
    want_ids, want_unary = K.cpu_topk_candidates(exact, k, 0.7, 2.0)
    assert got_ids.reshape(-1).tolist() == list(want_ids)
    np.testing.assert_allclose(got_unary, want_unary, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Sessions


@pytest.fixture
def target(tiny_model_dirs):
    return tiny_model_dirs["llama_gqa"]


@pytest.mark.parametrize("geometry", [
    dict(block_size=4, conv_kernel_size=2, conv_group_size=8, selector_top_k=4),
    dict(block_size=8, conv_kernel_size=2, conv_group_size=16, selector_top_k=32, output_multiplier=0.5,
         final_logit_softcapping=3.0, input_embedding_scale=1.5),
])
def test_greedy_speculative_output_with_fp8_head_equals_target_greedy(tmp_path, target, geometry):
    d = small_dflash2(tmp_path, target, **geometry)
    spec = dflash.Session(target, draft=d, device="cpu", num_threads=2, draft_head="fp8")
    ar = dflash.Session(target, device="cpu", num_threads=2)
    assert_greedy_like_target(spec, ar, PROMPTS)


def test_fp8_head_unary_is_the_exact_head_and_weights_are_counted(tmp_path, tiny_model_dirs):
    target = tiny_model_dirs["qwen3"]
    d = small_dflash2(tmp_path, target, block_size=6, selector_top_k=8, output_multiplier=0.25,
                 final_logit_softcapping=2.0, seed=3)
    exact = dflash.Session(target, draft=d, device="cpu", num_threads=1)
    fp8 = dflash.Session(target, draft=d, device="cpu", num_threads=1, draft_head="fp8")
    cfg = json.loads((target / "config.json").read_text())
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    assert fp8._core.stats().draft_weight_bytes == exact._core.stats().draft_weight_bytes + v * h + 4 * v
    shared = []
    for prompt in PROMPTS:
        e, f = exact.propose_details(prompt), fp8.propose_details(prompt)
        np.testing.assert_array_equal(f["draft_logits"], e["draft_logits"])  # the exact head's, as before
        logits = f["draft_logits"]
        for s in range(logits.shape[0]):
            ids = f["candidate_ids"][s]
            # the re-score: exact values of the chosen ids, in topk_candidates' order (the
            # re-score's own fp32 dots may order values within rounding of each other differently)
            vals = logits[s, ids]
            assert np.all(vals[:-1] >= vals[1:] - 1e-5 * np.abs(vals).max())
            want = 2.0 * np.tanh(logits[s, ids] * 0.25 / 2.0)
            np.testing.assert_allclose(f["unary"][s], want, rtol=1e-5, atol=1e-6)
            shared.append(len(set(ids) & set(e["candidate_ids"][s])) / len(ids))
        # the walk runs on exact scores: its rows are the edges of the chosen candidates
        prev = 0
        for s in range(logits.shape[0]):
            row = f["edges"][s, prev]
            np.testing.assert_array_equal(f["realized"][s], row)
            prev = int(np.argmax(row))
            assert f["draft_ids"][s] == f["candidate_ids"][s, prev]
    print(f"fp8 vs exact candidates: {np.mean(shared) * 100:.1f} % shared")
    assert np.mean(shared) >= 0.75


N = 2000


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_k_candidate_sampling_with_fp8_head_matches_target_distribution(tmp_path, target, top_p):
    d = small_dflash2(tmp_path, target, block_size=4, selector_top_k=256, seed=5, init_std=0.02,
                 output_multiplier=1e-3)
    spec = dflash.Session(target, draft=d, device="cpu", num_threads=2, draft_head="fp8")
    ar = dflash.Session(target, device="cpu", num_threads=2)
    check_sampled_second_token(spec, ar, [17, 42, 99, 7, 250, 31], 120, 0.8, top_p, N, "DFlash2 fp8 head")


def test_draft_head_refusals(tmp_path, target):
    d2 = small_dflash2(tmp_path, target)
    d1 = write_dflash_drafter(tmp_path / "d1", target_config=target_config(target), num_layers=1, target_layer_ids=[0, 1],
                              block_size=4)
    with pytest.raises(ValueError, match="draft_head must be 'exact' or 'fp8'"):
        dflash.Session(target, draft=d2, device="cpu", num_threads=1, draft_head="bf16")
    with pytest.raises(ValueError, match="needs a draft model"):
        dflash.Session(target, device="cpu", num_threads=1, draft_head="fp8")
    # the runtime's own checks (what the Python layer mirrors)
    for draft_dir, head, match in [(str(d2), "FP8", "draft_head must be"), ("", "fp8", "needs a draft model")]:
        cfg = _core.SessionConfig()
        cfg.device, cfg.num_threads, cfg.draft_dir, cfg.draft_head = "cpu", 1, draft_dir, head
        with pytest.raises(ValueError, match=match):
            _core.Session(str(target), cfg)
    # exact is the default; both heads are accepted with either drafter
    assert _core.SessionConfig().draft_head == "exact"
    for head in ("exact", "fp8"):
        dflash.Session(target, draft=d1, device="cpu", num_threads=1, draft_head=head)
