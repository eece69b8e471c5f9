# tests/gpu/test_skinny_gemm_fused.py
#
# The fused skinny GEMM variants (cuda/skinny_gemm.cu, skinny_gemm_fused, through
# dflash._core.testing.cuda_skinny_gemm_fused) that a decoder layer runs on the CUDA backend for
# up to 16 rows: RMSNorm staged into the GEMM's input, silu(gate) * up staged into it, and the
# residual add in the epilogue. Each is checked against torch doing the unfused steps with the
# same roundings (the norm / activation rounded to bf16 before an fp64 product; the sum rounded
# to bf16 once). The staged input may differ from the unfused kernels' in one bf16 ulp where the
# sum of squares is added in another order, so the tolerance is the bf16 output rounding plus
# that: rtol 2^-7, atol 2e-6 K. Also: M past 16 or K % 8 != 0 are refused with a ValueError;
# the dispatch of the CUDA backend's layer ops is covered by the model tests (test_cuda_models,
# test_cuda_graphs), which compare whole forwards with the CPU backend. Skipped without CUDA.
from __future__ import annotations

import math

import pytest

from tests.gpu.gpu_helpers import kernel_ops, requires_cuda, torch

pytestmark = requires_cuda

DEV = "cuda"
EPS = 1e-5


def bf16(*shape, seed=0, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(torch.bfloat16)


def rms_norm_bf16(x, gamma):
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (gamma.float() * (xf * inv)).to(torch.bfloat16)


def silu_mul_bf16(gate_up):
    k = gate_up.shape[1] // 2
    a, b = gate_up[:, :k].float(), gate_up[:, k:].float()
    return (a / (1.0 + torch.exp(-a)) * b).to(torch.bfloat16)


def compare(name, got, want, k):
    err = (got.double() - want).abs()
    print(f"{name}: max abs err {err.max().item():.3g} (max |out| {want.abs().max().item():.3g}, "
          f"err / sqrt(K) {err.max().item() / math.sqrt(k):.3g})")
    torch.testing.assert_close(got.double(), want, rtol=2.0 ** -7, atol=2e-6 * k)


SHAPES = [(m, n, k) for m in (1, 2, 7, 8, 9, 15, 16) for n, k in ((17, 64), (576, 576), (1000, 1000), (576, 1536))]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_rms_norm_staged_into_the_gemm(m, n, k):
    x, w, gamma = bf16(m, k, seed=1, scale=3.0), bf16(n, k, seed=2), bf16(k, seed=3)
    out = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    kernel_ops().cuda_skinny_gemm_fused(x, w, out, "rms_norm", gamma=gamma, eps=EPS)
    compare(f"rms_norm m{m} n{n} k{k}", out, rms_norm_bf16(x, gamma).double() @ w.double().T, k)


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_silu_mul_staged_into_the_gemm(m, n, k, add):
    gate_up, w = bf16(m, 2 * k, seed=4), bf16(n, k, seed=5)
    residual = bf16(m, n, seed=6, scale=4.0)
    out = residual.clone() if add else torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    kernel_ops().cuda_skinny_gemm_fused(gate_up, w, out, "silu_mul", add=add)
    want = silu_mul_bf16(gate_up).double() @ w.double().T
    compare(f"silu_mul add={add} m{m} n{n} k{k}", out, want + residual.double() if add else want, k)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_residual_add_in_the_epilogue(m, n, k):
    x, w, residual = bf16(m, k, seed=7), bf16(n, k, seed=8), bf16(m, n, seed=9, scale=4.0)
    out = residual.clone()
    kernel_ops().cuda_skinny_gemm_fused(x, w, out, "plain", add=True)
    compare(f"add m{m} n{n} k{k}", out, residual.double() + x.double() @ w.double().T, k)


def test_fused_is_deterministic():
    x, w, gamma = bf16(9, 576, seed=10), bf16(1000, 576, seed=11), bf16(576, seed=12)
    outs = []
    for _ in range(3):
        out = torch.empty((9, 1000), device=DEV, dtype=torch.bfloat16)
        kernel_ops().cuda_skinny_gemm_fused(x, w, out, "rms_norm", gamma=gamma, eps=EPS)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_fused_bad_arguments_raise():
    ops = kernel_ops()
    w = bf16(32, 64, seed=13)
    with pytest.raises(ValueError, match="unsupported"):  # 17 rows: past the fused kernels' 16
        ops.cuda_skinny_gemm_fused(bf16(17, 64), w, torch.empty((17, 32), device=DEV, dtype=torch.bfloat16),
                                   "rms_norm", gamma=bf16(64))
    with pytest.raises(ValueError, match="gamma"):
        ops.cuda_skinny_gemm_fused(bf16(2, 64), w, torch.empty((2, 32), device=DEV, dtype=torch.bfloat16), "rms_norm")
    with pytest.raises(ValueError, match="columns"):  # silu_mul wants [M, 2K]
        ops.cuda_skinny_gemm_fused(bf16(2, 64), w, torch.empty((2, 32), device=DEV, dtype=torch.bfloat16),
                                   "silu_mul", add=True)
    with pytest.raises(ValueError, match="mode"):
        ops.cuda_skinny_gemm_fused(bf16(2, 64), w, torch.empty((2, 32), device=DEV, dtype=torch.bfloat16), "gelu")
    with pytest.raises(ValueError, match="unsupported"):  # plain without add is skinny_gemm itself
        ops.cuda_skinny_gemm_fused(bf16(2, 64), w, torch.empty((2, 32), device=DEV, dtype=torch.bfloat16), "plain")
