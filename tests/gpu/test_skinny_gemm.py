# tests/gpu/test_skinny_gemm.py
#
# The skinny GEMM kernel (cuda/skinny_gemm.cu, through dflash._core.testing.cuda_skinny_gemm):
# out[M, N] = x[M, K] @ w[N, K]^T against an fp64 torch reference, over odd M, N and K, bf16 and
# fp32 outputs, every built kernel shape; bit-identical reruns; bad arguments raise; and the CUDA
# backend's dispatch (DFLASH_GEMM=cublaslt vs the default) on a tiny model.
#
# Tolerances (inputs: unit-variance bf16, so |out| ~ sqrt(K)): fp32 accumulation in a different
# order than the reference costs at most ~K * 2^-24 * E|x w| per output in the worst case, so
# fp32 outputs get atol = 2e-6 K (0.008 at K = 4096, where outputs are ~64) and rtol 1e-5; bf16
# outputs add one rounding, at most half an ulp: rtol 2^-8. A wrong index or a lost chunk of k
# errs by O(sqrt(32)) or more. Max errors are printed (run with -s). Skipped without a CUDA
# device or a CUDA build of dflash.
from __future__ import annotations

import math

import numpy as np
import pytest

from tests.gpu.gpu_helpers import kernel_ops, requires_cuda, torch

pytestmark = requires_cuda

DEV = "cuda"


_ops = kernel_ops


def bf16(*shape, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, device=DEV, generator=g).to(torch.bfloat16)


def reference(x, w):
    return x.double() @ w.double().T


def check(name, got, x, w):
    k = x.shape[1]
    want = reference(x, w)
    err = (got.double() - want).abs()
    print(f"{name}: max abs err {err.max().item():.3g} (max |out| {want.abs().max().item():.3g}, "
          f"err / sqrt(K) {err.max().item() / math.sqrt(k):.3g})")
    rtol = 2.0 ** -8 if got.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=2e-6 * k)


def run(x, w, out_dtype, **shape):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), device=DEV, dtype=out_dtype)
    _ops().cuda_skinny_gemm(x, w, out, **shape)
    return out


@pytest.mark.parametrize("out_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("k", [64, 576, 1000, 4096])
@pytest.mark.parametrize("n", [1, 17, 576, 1000, 6144])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 15, 16])
def test_skinny_gemm_vs_torch(m, n, k, out_dtype):
    dt = torch.bfloat16 if out_dtype == "bf16" else torch.float32
    x, w = bf16(m, k, seed=m), bf16(n, k, seed=1000 + n)
    check(f"skinny_gemm M={m} N={n} K={k} out={out_dtype}", run(x, w, dt), x, w)


@pytest.mark.parametrize("m", [17, 24, 32])
@pytest.mark.parametrize("n,k", [(17, 1000), (1000, 576), (4096, 4096)])
def test_skinny_gemm_up_to_32_rows(m, n, k):
    x, w = bf16(m, k, seed=m), bf16(n, k, seed=n)
    check(f"skinny_gemm M={m} N={n} K={k}", run(x, w, torch.float32), x, w)


# Every built kernel shape (warps, row_tiles, unroll) per column-tile count (M <= 8, 16, 32).
SHAPES = {1: [(1, 8), (1, 4), (2, 4)], 2: [(1, 4), (2, 2)], 4: [(1, 2), (2, 2)]}


@pytest.mark.parametrize("m", [1, 5, 12, 16, 29])
@pytest.mark.parametrize("warps", [1, 4, 8, 16])
@pytest.mark.parametrize("n,k", [(33, 1000), (1000, 4104), (4096, 576)])
def test_skinny_gemm_every_shape(m, warps, n, k):
    nt = 1 if m <= 8 else 2 if m <= 16 else 4
    x, w = bf16(m, k, seed=7), bf16(n, k, seed=8)
    for row_tiles, unroll in SHAPES[nt]:
        for dt in (torch.bfloat16, torch.float32):
            got = run(x, w, dt, warps=warps, row_tiles=row_tiles, unroll=unroll)
            check(f"M={m} N={n} K={k} warps={warps} row_tiles={row_tiles} unroll={unroll} {dt}", got, x, w)


def test_skinny_gemm_on_a_stream_and_large_n():
    # The LM-head shape with fp32 logits, launched on torch's current stream (no synchronisation
    # in the binding): what the benchmark and CUDA-graph capture use.
    x, w = bf16(3, 4096, seed=1), bf16(151936, 4096, seed=2)
    out = torch.empty(3, 151936, device=DEV, dtype=torch.float32)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # x and w are written on the current stream
    with torch.cuda.stream(s):
        _ops().cuda_skinny_gemm(x, w, out, stream=s.cuda_stream)
    s.synchronize()
    check("skinny_gemm lm_head M=3 on a stream", out, x, w)


@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (16, 1000, 12288), (7, 17, 1000)])
def test_skinny_gemm_is_deterministic(m, n, k):
    x, w = bf16(m, k, seed=3), bf16(n, k, seed=4)
    for dt in (torch.bfloat16, torch.float32):
        a, b = run(x, w, dt), run(x, w, dt)
        assert torch.equal(a.view(torch.int16 if dt == torch.bfloat16 else torch.int32),
                           b.view(torch.int16 if dt == torch.bfloat16 else torch.int32))


def test_skinny_gemm_empty_is_a_no_op():
    K = _ops()
    x, w = bf16(0, 64), bf16(5, 64)
    out = torch.empty(0, 5, device=DEV, dtype=torch.bfloat16)
    K.cuda_skinny_gemm(x, w, out)
    x, w = bf16(2, 64), bf16(0, 64)
    K.cuda_skinny_gemm(x, w, torch.empty(2, 0, device=DEV, dtype=torch.bfloat16))


def test_skinny_gemm_bad_arguments_raise():
    K = _ops()
    out = torch.empty(2, 5, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="skinny_gemm"):  # K % 8 != 0
        K.cuda_skinny_gemm(bf16(2, 12), bf16(5, 12), out)
    with pytest.raises(RuntimeError, match="skinny_gemm"):  # M > 32
        K.cuda_skinny_gemm(bf16(33, 64), bf16(5, 64), torch.empty(33, 5, device=DEV, dtype=torch.bfloat16))
    buf = bf16(2 * 64 + 8)
    misaligned = buf[1:1 + 2 * 64].view(2, 64)  # 2 bytes past a 16-byte boundary
    with pytest.raises(RuntimeError, match="skinny_gemm"):
        K.cuda_skinny_gemm(misaligned, bf16(5, 64), out)
    wbuf = bf16(5 * 64 + 8)
    with pytest.raises(RuntimeError, match="skinny_gemm"):
        K.cuda_skinny_gemm(bf16(2, 64), wbuf[4:4 + 5 * 64].view(5, 64), out)
    for bad_shape in ({"unroll": 3}, {"row_tiles": 3}, {"warps": 17}, {"warps": -1}):
        with pytest.raises(RuntimeError, match="skinny_gemm"):
            K.cuda_skinny_gemm(bf16(2, 64), bf16(5, 64), out, **bad_shape)
    with pytest.raises(RuntimeError, match="skinny_gemm"):  # unroll 8 is built for M <= 16 only
        K.cuda_skinny_gemm(bf16(20, 64), bf16(5, 64), torch.empty(20, 5, device=DEV, dtype=torch.float32),
                           unroll=8)
    with pytest.raises(ValueError):  # shapes that do not match
        K.cuda_skinny_gemm(bf16(2, 64), bf16(5, 72), out)
    with pytest.raises(ValueError):
        K.cuda_skinny_gemm(bf16(2, 64), bf16(6, 64), out)
    with pytest.raises(ValueError):  # out dtype
        K.cuda_skinny_gemm(bf16(2, 64), bf16(5, 64), torch.empty(2, 5, device=DEV, dtype=torch.float16))
    with pytest.raises(ValueError):  # x dtype
        K.cuda_skinny_gemm(bf16(2, 64).half(), bf16(5, 64), out)
    # the device is still usable after the refused launches
    x, w = bf16(2, 64), bf16(5, 64)
    check("after errors", run(x, w, torch.float32), x, w)


# --------------------------------------------------------------------------------------------
# The backend's dispatch: a tiny model with the skinny kernel (default) and with cuBLASLt only.


def test_backend_gemm_env(tiny_model_dirs, monkeypatch):
    import gc

    import dflash

    from tests.gpu.test_cuda_models import LOGIT_ABS, TOL_FACTOR, bf16_floor
    from tests.runtime_helpers import forced_run

    name = "qwen3_hd128"
    prompt, forced = [5, 17, 42, 7, 99, 3], [11, 12, 13, 14, 15, 16, 17]

    def logits(env):
        if env is None:
            monkeypatch.delenv("DFLASH_GEMM", raising=False)
        else:
            monkeypatch.setenv("DFLASH_GEMM", env)
        sess = dflash.Session(tiny_model_dirs[name], device="cuda", kv_cache_tokens=1024)
        out, _, _ = forced_run(sess, prompt, forced)
        del sess
        gc.collect()
        return out

    lt, skinny, auto, default = logits("cublaslt"), logits("skinny"), logits("auto"), logits(None)
    assert np.array_equal(auto, default)
    # tiny weights: the auto rule sends them all to the skinny kernel
    assert np.array_equal(skinny, auto)
    # Every row here (a 6-row prefill, then one row per step) has <= 16 rows, so the two sessions
    # share no GEMM kernel: they differ by bf16 rounding only, as the CUDA backend and the fp32
    # CPU backend do in test_cuda_models (same tolerance).
    cpu = dflash.Session(tiny_model_dirs[name], device="cpu", num_threads=2)
    tol = LOGIT_ABS + TOL_FACTOR * bf16_floor(name, tiny_model_dirs, cpu)
    err = float(np.max(np.abs(skinny - lt)))
    print(f"{name}: max |logit(skinny) - logit(cublaslt)| = {err:.4g} (tolerance {tol:.4g})")
    assert err <= tol
    monkeypatch.setenv("DFLASH_GEMM", "bogus")
    with pytest.raises(ValueError, match="DFLASH_GEMM"):
        dflash.Session(tiny_model_dirs[name], device="cuda", kv_cache_tokens=1024)
