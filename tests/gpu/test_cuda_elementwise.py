# tests/gpu/test_cuda_elementwise.py
#
# The element-wise CUDA kernels of cuda/kernels.h (embedding, RMS norm, add + RMS norm, SiLU-mul,
# add, bf16/f32 conversions, row gathers, column copies) against torch over odd sizes; bf16
# outputs within a few ulps (2^-8 relative each). Max errors printed with -s. Skipped without a
# CUDA device or a CUDA build of dflash.
from __future__ import annotations

import pytest

from tests.gpu.gpu_helpers import DEV, assert_bf16_close, bf16, kernel_ops, requires_cuda, torch

pytestmark = requires_cuda

_ops = kernel_ops


@pytest.mark.parametrize("rows", [1, 3, 17, 1000])
@pytest.mark.parametrize("hidden", [64, 576, 4096, 111])
def test_embedding(rows, hidden):
    K = _ops()
    vocab = 1000
    table = bf16(vocab, hidden, seed=1)
    g = torch.Generator(device=DEV).manual_seed(rows)
    ids = torch.randint(0, vocab, (rows,), device=DEV, generator=g, dtype=torch.int32)
    bad = rows >= 3
    if bad:
        ids[1] = vocab
        ids[-1] = -5
    out = torch.full((rows, hidden), 7.0, device=DEV, dtype=torch.bfloat16)
    flag = torch.zeros(1, device=DEV, dtype=torch.int32)
    K.cuda_embedding(table, ids, out, flag)
    want = table[ids.clamp(0, vocab - 1).long()]
    if bad:
        want[1] = 0
        want[-1] = 0
    assert torch.equal(out, want)
    assert flag.item() == int(bad)


def ref_rms_norm(x, w, eps):
    xf = x.float()
    return w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows", [1, 3, 17, 1000])
@pytest.mark.parametrize("hidden", [64, 576, 4096, 111, 16384])
def test_rms_norm(rows, hidden):
    K = _ops()
    x = bf16(rows, hidden, scale=3.0, seed=2)
    w = bf16(hidden, scale=0.5, offset=1.0, seed=3)
    out = torch.empty_like(x)
    K.cuda_rms_norm(x, w, 1e-6, out)
    assert_bf16_close(f"rms_norm rows={rows} hidden={hidden}", out, ref_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("rows", [1, 3, 17, 1000])
@pytest.mark.parametrize("hidden", [64, 576, 4096, 111])
def test_add_rms_norm(rows, hidden):
    K = _ops()
    residual = bf16(rows, hidden, scale=3.0, seed=4)
    x = bf16(rows, hidden, seed=5)
    w = bf16(hidden, scale=0.5, offset=1.0, seed=6)
    new_residual = (residual.float() + x.float()).to(torch.bfloat16)  # bf16 residual stream
    out = torch.empty_like(x)
    K.cuda_add_rms_norm(residual, x, w, 1e-5, out)
    assert torch.equal(residual, new_residual)
    assert_bf16_close(f"add_rms_norm rows={rows} hidden={hidden}", out, ref_rms_norm(new_residual, w, 1e-5))


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("inter", [64, 576, 4096, 111])
def test_silu_mul(rows, inter):
    K = _ops()
    gate_up = bf16(rows, 2 * inter, scale=3.0, seed=7)
    out = torch.empty(rows, inter, device=DEV, dtype=torch.bfloat16)
    K.cuda_silu_mul(gate_up, out)
    g, u = gate_up[:, :inter].float(), gate_up[:, inter:].float()
    assert_bf16_close(f"silu_mul rows={rows} inter={inter}", out, torch.nn.functional.silu(g) * u)


@pytest.mark.parametrize("n", [1, 7, 129, 1000, 17 * 4096 + 3])
def test_add(n):
    K = _ops()
    a, b = bf16(n, seed=8), bf16(n, scale=2.0, seed=9)
    out = torch.empty_like(a)
    K.cuda_add(a, b, out)
    assert torch.equal(out, (a.float() + b.float()).to(torch.bfloat16))  # one rounding: exact


@pytest.mark.parametrize("n", [1, 7, 129, 1000, 100003])
def test_bf16_f32_conversions(n):
    K = _ops()
    x = torch.randn(n, device=DEV) * 100
    x[0] = float("inf")
    if n > 3:
        x[1], x[2] = -float("inf"), 3.0e38
    y = torch.empty(n, device=DEV, dtype=torch.bfloat16)
    K.cuda_f32_to_bf16(x, y)
    assert torch.equal(y, x.to(torch.bfloat16))  # round to nearest even
    back = torch.empty(n, device=DEV)
    K.cuda_bf16_to_f32(y, back)
    assert torch.equal(back, y.float())


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("width", [7, 576, 4096])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_gather_rows(dtype, width, rows):
    K = _ops()
    x = bf16(40, width, seed=10)
    if dtype == "f32":
        x = x.float() * 1.5
    g = torch.Generator(device=DEV).manual_seed(width + rows)
    idx = torch.randint(0, 40, (rows,), device=DEV, generator=g, dtype=torch.int32)
    out = torch.empty(rows, width, device=DEV, dtype=x.dtype)
    K.cuda_gather_rows(x, idx, out)
    assert torch.equal(out, x[idx.long()])


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("cols,width,col", [(64, 192, 64), (576, 1152, 576), (7, 20, 5), (111, 333, 111), (8, 24, 16)])
def test_copy_columns(rows, cols, width, col):
    K = _ops()
    src = bf16(rows, cols, seed=11)
    dst = bf16(rows, width, seed=12)
    want = dst.clone()
    want[:, col : col + cols] = src
    K.cuda_copy_columns(src, dst, col)
    assert torch.equal(dst, want)
