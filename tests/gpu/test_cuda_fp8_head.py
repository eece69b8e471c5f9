# tests/gpu/test_cuda_fp8_head.py
#
# DFlash2's FP8 candidate head (draft_head="fp8") on the CUDA backend. Kernels: the per-row e4m3
# quantization equals the CPU backend's bit for bit; linear_fp8 against torch (dequantized
# weights, fp64 reference) over M 1 .. 512, odd V, H 64 / 4096, with poisoned outputs (nothing
# written outside out, every element written), determinism and CUDA-graph replay, every e4m3
# code converted exactly (identity x), and its refusals; the exact re-score against torch and
# the CPU backend. Sessions: the unary scores are the exact head's values of the chosen
# candidates, and a head the FP8 kernel cannot run is refused at load (greedy equality with the
# target and chi-squared exactness with draft_head="fp8" are in test_cuda_dflash2.py, which runs
# every session test with both heads).
from __future__ import annotations


import numpy as np
import pytest

import dflash
from dflash import _core
from tests.gpu.gpu_helpers import bf16_randn, gpu_dflash2, kernel_ops, torch
from tests.runtime_helpers import DRAFT_PROMPTS, target_config

pytestmark = pytest.mark.skipif(not _core.cuda_usable(), reason="needs the CUDA backend and a Hopper GPU")

DEV = "cuda"
PROMPTS = DRAFT_PROMPTS
MAX_TOKENS = 24  # greedy generations










def _head(v, h, seed):
    """A bf16 head with rows of very different magnitudes and small entries (subnormal codes)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(v, h, device=DEV, generator=g)
    w *= torch.pow(2.0, torch.randint(-8, 8, (v, 1), device=DEV, generator=g).float())
    w[:, ::7] *= 1e-3
    w[min(3, v - 1)] = 0.0  # a zero row: scale 1
    return w.to(torch.bfloat16)


def quantize(w):
    K = kernel_ops()
    q = torch.empty(w.shape, device=DEV, dtype=torch.uint8)
    scale = torch.empty(w.shape[0], device=DEV)
    K.cuda_fp8_quantize_rows(w, q, scale)
    return q, scale


def dequantize(q, scale):
    return q.view(torch.float8_e4m3fn).double() * scale.double()[:, None]


# --------------------------------------------------------------------------------------------
# Quantization


@pytest.mark.parametrize("v,h", [(1000, 64), (4099, 4096), (7, 16)])
def test_quantization_equals_the_cpu_backend_bit_for_bit(v, h):
    w = _head(v, h, seed=v)
    q, scale = quantize(w)
    cpu_q, cpu_scale = kernel_ops().cpu_fp8_rows(w.float().cpu().numpy())
    assert np.array_equal(scale.cpu().numpy(), cpu_scale)
    assert np.array_equal(q.cpu().numpy(), cpu_q)
    assert float(scale[min(3, v - 1)]) == 1.0 and not bool(q[min(3, v - 1)].any())
    assert torch.isfinite(dequantize(q, scale)).all()


# --------------------------------------------------------------------------------------------
# linear_fp8

_WEIGHTS: dict = {}


def _fp8_weights(v, h):
    if (v, h) not in _WEIGHTS:
        _WEIGHTS.clear()
        w = _head(v, h, seed=v + h)
        q, scale = quantize(w)
        _WEIGHTS[(v, h)] = (q, scale, dequantize(q, scale))
    return _WEIGHTS[(v, h)]


def run_linear(x, q, scale, guard_rows=2):
    """out [M, V] as a contiguous view of a NaN-poisoned buffer with guard rows after it."""
    m, v = x.shape[0], q.shape[0]
    buf = torch.full((m + guard_rows, v), float("nan"), device=DEV)
    out = buf[:m]
    kernel_ops().cuda_linear_fp8(x, q, scale, out)
    assert torch.isnan(buf[m:]).all(), "wrote past out"
    return out


@pytest.mark.parametrize("h", [64, 4096])
@pytest.mark.parametrize("v", [1000, 151936])
@pytest.mark.parametrize("m", [1, 7, 16, 33, 224, 512])
def test_linear_fp8_matches_torch(m, v, h):
    q, scale, deq = _fp8_weights(v, h)
    x = bf16_randn(m, h, seed=m)
    out = run_linear(x, q, scale)
    assert not torch.isnan(out).any(), "an output was not written"
    xd = x.double()
    want = xd @ deq.T
    bound = (xd.abs() @ deq.abs().T) * 3e-5 + 1e-30
    err = ((out.double() - want).abs() / bound).max().item()
    print(f"linear_fp8 M={m} V={v} H={h}: max error / bound {err:.3f}")
    assert err <= 1.0
    again = run_linear(x, q, scale)
    assert torch.equal(out, again)  # deterministic


def test_every_e4m3_code_converts_exactly():
    """x = identity rows: out[m, v] = scale[v] * e4m3(q[v, m]) with a single nonzero product, so
    every code's bf16 conversion (subnormals included) must be exact."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)  # 254 codes
    h, v = 256, 99
    g = torch.Generator().manual_seed(0)
    row = torch.cat([codes, codes[:2]])  # [256]: every finite code in every row
    q = torch.stack([row[torch.randperm(h, generator=g)] for _ in range(v)]).to(DEV)
    scale = torch.pow(2.0, torch.randint(-10, 10, (v,), generator=g).float()).to(DEV)
    for m0 in range(0, h, 128):
        x = torch.zeros(128, h, device=DEV, dtype=torch.bfloat16)
        x[torch.arange(128), m0 + torch.arange(128)] = 1.0
        out = run_linear(x, q, scale)
        want = (q[:, m0:m0 + 128].view(torch.float8_e4m3fn).float() * scale[:, None]).T
        assert torch.equal(out, want)


def test_linear_fp8_in_a_cuda_graph():
    q, scale, deq = _fp8_weights(1000, 64)
    x = bf16_randn(7, 64, seed=1)
    first = run_linear(x, q, scale).clone()
    out = torch.full((7, 1000), float("nan"), device=DEV)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kernel_ops().cuda_linear_fp8(x, q, scale, out, stream=stream.cuda_stream)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)


def test_linear_fp8_refuses_unsupported_shapes():
    K = kernel_ops()
    q, scale, _ = _fp8_weights(1000, 64)
    out = torch.empty(513, 1000, device=DEV)
    with pytest.raises(dflash.DFlashError, match="linear_fp8"):
        K.cuda_linear_fp8(bf16_randn(513, 64, seed=2), q, scale, out)  # M > kFp8GemvMaxRows
    assert K.cuda_fp8_gemv_max_rows == 512
    w40 = bf16_randn(10, 40, seed=3)
    q40, s40 = quantize(w40)
    with pytest.raises(dflash.DFlashError, match="linear_fp8"):
        K.cuda_linear_fp8(bf16_randn(2, 40, seed=4), q40, s40, torch.empty(2, 10, device=DEV))  # H % 16 != 0
    flat = torch.empty(2 * 64 + 1, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(dflash.DFlashError, match="linear_fp8"):
        K.cuda_linear_fp8(flat[1:].view(2, 64), q, scale, torch.empty(2, 1000, device=DEV))  # x misaligned


# --------------------------------------------------------------------------------------------
# rescore_candidates


@pytest.mark.parametrize("rows,k,v,h,multiplier,softcap", [
    (7, 16, 151936, 4096, 1.0, 0.0), (224, 16, 5000, 64, 0.5, 3.0), (3, 64, 999, 128, 1.0, 30.0),
    (1, 1, 10, 8, 2.0, 0.0),
])
def test_rescore_candidates_matches_torch_and_cpu(rows, k, v, h, multiplier, softcap):
    K = kernel_ops()
    hs = bf16_randn(rows, h, seed=rows)
    head = bf16_randn(v, h, seed=v, scale=0.5)
    g = torch.Generator(device=DEV).manual_seed(k)
    ids = torch.stack([torch.randperm(v, device=DEV, generator=g)[:k] for _ in range(rows)]).to(torch.int32)
    if k >= 2:
        head[ids[0, 1]] = head[ids[0, 0]]  # a tie in row 0: lowest id first
    got_ids, unary = ids.clone(), torch.full((rows, k), float("nan"), device=DEV)
    K.cuda_rescore_candidates(hs, head, got_ids, unary, multiplier, softcap)
    exact = torch.einsum("rh,rkh->rk", hs.double(), head.double()[ids.long()])  # [R, K] in the input order
    for r in range(rows):
        pos = {int(i): j for j, i in enumerate(ids[r].tolist())}
        order = [pos[int(i)] for i in got_ids[r].tolist()]
        assert sorted(order) == list(range(k))  # a permutation of the candidates
        vals = exact[r, order]
        want = vals * multiplier
        if softcap > 0:
            want = softcap * torch.tanh(want / softcap)
        torch.testing.assert_close(unary[r].double(), want, rtol=1e-5, atol=1e-4)
        # sorted by the exact value (near-ties within fp32 rounding may swap), equal values by id
        assert torch.all(vals[:-1] >= vals[1:] - 1e-4 * vals.abs().max())
    if k >= 2:
        row0 = got_ids[0].tolist()
        a, b = sorted(int(i) for i in ids[0, :2])
        assert row0.index(a) == row0.index(b) - 1
    cpu_ids, cpu_unary = K.cpu_rescore_candidates(hs.float().cpu().numpy(), head.float().cpu().numpy(),
                                                  ids.cpu().numpy(), multiplier, softcap)
    np.testing.assert_allclose(unary.cpu().numpy(), cpu_unary, rtol=1e-5, atol=1e-4)
    again_ids, again = ids.clone(), torch.empty_like(unary)
    K.cuda_rescore_candidates(hs, head, again_ids, again, multiplier, softcap)
    assert torch.equal(again_ids, got_ids) and torch.equal(again, unary)


# --------------------------------------------------------------------------------------------
# Sessions


def test_fp8_head_unary_is_exact_on_gpu(tmp_path, tiny_model_dirs):
    target = tiny_model_dirs["llama_hd64"]
    d = gpu_dflash2(tmp_path, target, block_size=8, selector_top_k=16, selector_rank=32, output_multiplier=0.7,
                 final_logit_softcapping=5.0)
    fp8 = dflash.Session(target, draft=d, device="cuda", draft_head="fp8")
    exact = dflash.Session(target, draft=d, device="cuda")
    cfg = target_config(target)
    assert fp8._core.stats().draft_weight_bytes == exact._core.stats().draft_weight_bytes + \
        cfg["vocab_size"] * cfg["hidden_size"] + 4 * cfg["vocab_size"]
    shared = []
    for prompt in PROMPTS:
        f, e = fp8.propose_details(prompt), exact.propose_details(prompt)
        logits = np.asarray(f["draft_logits"])
        n, k = logits.shape[0], f["k"]
        for s in range(n):
            ids = np.asarray(f["candidate_ids"][s])
            want = 5.0 * np.tanh(logits[s, ids] * 0.7 / 5.0)
            np.testing.assert_allclose(np.asarray(f["unary"]).reshape(n, k)[s], want, rtol=1e-5, atol=1e-4)
            shared.append(len(set(ids.tolist()) & set(np.asarray(e["candidate_ids"][s]).tolist())) / k)
        prev = 0
        for s in range(n):
            row = f["edges"][s, prev]
            assert np.array_equal(np.asarray(f["realized"]).reshape(n, k)[s], row)
            prev = int(np.argmax(row))
            assert f["draft_ids"][s] == f["candidate_ids"][s, prev]
    print(f"GPU fp8 vs exact candidates: {np.mean(shared) * 100:.1f} % shared")
    assert np.mean(shared) >= 0.75


def test_a_head_the_fp8_kernel_cannot_run_is_refused(tmp_path):
    from tests.fixtures.tiny_models import write_tiny_model

    target = write_tiny_model(tmp_path / "h72", arch="qwen3", hidden_size=72, num_heads=2, num_kv_heads=1,
                              head_dim=64)
    d = gpu_dflash2(tmp_path, target, conv_group_size=8, selector_rank=8)
    try:
        dflash.Session(target, draft=d, device="cuda")
    except Exception as e:  # noqa: BLE001 - this geometry is beyond another CUDA limit: nothing to test here
        pytest.skip(f"hidden 72 does not load on CUDA with the exact head either: {e}")
    with pytest.raises(dflash.DFlashError, match=r"draft_head='fp8' cannot run on the cuda backend.*multiple of 16"):
        dflash.Session(target, draft=d, device="cuda", draft_head="fp8")
    dflash.Session(target, draft=d, device="cpu", num_threads=1, draft_head="fp8")  # the CPU backend has no such limit
