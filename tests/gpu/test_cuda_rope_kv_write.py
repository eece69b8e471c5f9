# tests/gpu/test_cuda_rope_kv_write.py
#
# The fused Q/K norm + RoPE kernels and the paged KV writes of cuda/kernels.h against torch:
# qkv_norm_rope (with and without its KV write), kv_write, kv_norm_rope_write for one and several
# layers, over odd head sizes and scattered slots. Skipped without a CUDA device or a CUDA build.
from __future__ import annotations

import pytest

from tests.gpu.gpu_helpers import DEV, assert_bf16_close, bf16, kernel_ops, requires_cuda, torch

pytestmark = requires_cuda

_ops = kernel_ops


def inv_freq_of(head_dim, base=1_000_000.0):
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, device=DEV, dtype=torch.float32) / head_dim))


def ref_norm_rope(x, w, eps, positions, inv_freq):
    """x [T, H, hd] -> optional per-head RMSNorm, then rotate-half RoPE (fp32)."""
    x = x.float()
    if w is not None:
        x = w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    ang = positions.float()[:, None] * inv_freq[None, :]  # fp32, as the kernel
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def positions_of(tokens, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    pos = torch.randint(0, 200_000, (tokens,), device=DEV, generator=g, dtype=torch.int32)
    pos[0] = 0
    return pos


@pytest.mark.parametrize("tokens", [1, 7, 129])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80])
@pytest.mark.parametrize("heads", [(4, 2), (0, 2), (3, 1)])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qkv_norm_rope(tokens, head_dim, heads, qk_norm):
    K = _ops()
    nh, nkv = heads
    qkv = bf16(tokens, (nh + 2 * nkv) * head_dim, scale=2.0, seed=13)
    q_norm = bf16(head_dim, scale=0.3, offset=1.0, seed=14) if qk_norm else None
    k_norm = bf16(head_dim, scale=0.3, offset=1.0, seed=15) if qk_norm else None
    pos = positions_of(tokens, head_dim)
    inv = inv_freq_of(head_dim)
    q = torch.empty(tokens, nh, head_dim, device=DEV, dtype=torch.bfloat16) if nh else None
    k = torch.empty(tokens, nkv, head_dim, device=DEV, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    K.cuda_qkv_norm_rope(qkv, q_norm, k_norm, 1e-6, pos, inv, nh, nkv, head_dim, q, k, v)
    heads3 = qkv.view(tokens, nh + 2 * nkv, head_dim)
    name = f"qkv_norm_rope T={tokens} hd={head_dim} nh={nh} nkv={nkv} norm={qk_norm}"
    if nh:
        assert_bf16_close(name + " q", q, ref_norm_rope(heads3[:, :nh], q_norm, 1e-6, pos, inv), atol=1e-2)
    assert_bf16_close(name + " k", k, ref_norm_rope(heads3[:, nh : nh + nkv], k_norm, 1e-6, pos, inv), atol=1e-2)
    assert torch.equal(v, heads3[:, nh + nkv :])


@pytest.mark.parametrize("tokens", [1, 7, 129])
@pytest.mark.parametrize("head_dim,heads", [(64, (9, 3)), (128, (32, 8))])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qkv_norm_rope_write(tokens, head_dim, heads, qk_norm):
    """The fused op == qkv_norm_rope then kv_write, bit for bit; negative slots write nothing."""
    K = _ops()
    nh, nkv = heads
    num_slots = 300
    qkv = bf16(tokens, (nh + 2 * nkv) * head_dim, scale=2.0, seed=31)
    q_norm = bf16(head_dim, scale=0.3, offset=1.0, seed=32) if qk_norm else None
    k_norm = bf16(head_dim, scale=0.3, offset=1.0, seed=33) if qk_norm else None
    pos = positions_of(tokens, 7 * head_dim)
    inv = inv_freq_of(head_dim)
    slots = scattered_slots(tokens, num_slots, seed=tokens + 3)
    q = torch.empty(tokens, nh, head_dim, device=DEV, dtype=torch.bfloat16)
    k_pool = torch.zeros(num_slots, nkv * head_dim, device=DEV, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    K.cuda_qkv_norm_rope_write(qkv, q_norm, k_norm, 1e-6, pos, inv, slots, nh, nkv, head_dim, q, k_pool, v_pool)
    q2 = torch.empty_like(q)
    k = torch.empty(tokens, nkv, head_dim, device=DEV, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    K.cuda_qkv_norm_rope(qkv, q_norm, k_norm, 1e-6, pos, inv, nh, nkv, head_dim, q2, k, v)
    k_want, v_want = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    K.cuda_kv_write(k, v, slots, k_want, v_want)
    assert torch.equal(q, q2)
    assert torch.equal(k_pool, k_want) and torch.equal(v_pool, v_want)


def scattered_slots(tokens, num_slots, seed, skip_one=True):
    g = torch.Generator(device=DEV).manual_seed(seed)
    slots = torch.randperm(num_slots, device=DEV, generator=g)[:tokens].to(torch.int32)
    if skip_one and tokens > 2:
        slots[1] = -1  # padding: not written
    return slots


@pytest.mark.parametrize("tokens", [1, 7, 129])
@pytest.mark.parametrize("row", [2 * 64, 8 * 128, 111])
def test_kv_write(tokens, row):
    K = _ops()
    num_slots = 300
    k, v = bf16(tokens, row, seed=16), bf16(tokens, row, seed=17)
    slots = scattered_slots(tokens, num_slots, seed=tokens)
    k_pool = torch.zeros(num_slots, row, device=DEV, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    K.cuda_kv_write(k, v, slots, k_pool, v_pool)
    want_k, want_v = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    keep = slots >= 0
    want_k[slots[keep].long()] = k[keep]
    want_v[slots[keep].long()] = v[keep]
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)


@pytest.mark.parametrize("tokens", [1, 7, 129])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("nkv", [1, 8])
@pytest.mark.parametrize("k_norm_on", [True, False])
def test_kv_norm_rope_write(tokens, head_dim, nkv, k_norm_on):
    K = _ops()
    num_slots = 256
    kv = bf16(tokens, 2 * nkv * head_dim, scale=2.0, seed=18)
    k_norm = bf16(head_dim, scale=0.3, offset=1.0, seed=19) if k_norm_on else None
    pos = positions_of(tokens, 3 * head_dim)
    inv = inv_freq_of(head_dim, base=10_000.0)
    slots = scattered_slots(tokens, num_slots, seed=tokens + 1)
    k_pool = torch.zeros(num_slots, nkv * head_dim, device=DEV, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    K.cuda_kv_norm_rope_write(kv, k_norm, 1e-6, pos, inv, slots, nkv, head_dim, k_pool, v_pool)
    heads = kv.view(tokens, 2 * nkv, head_dim)
    keep = slots >= 0
    want_k = ref_norm_rope(heads[:, :nkv], k_norm, 1e-6, pos, inv).reshape(tokens, -1)
    name = f"kv_norm_rope_write T={tokens} hd={head_dim} nkv={nkv} norm={k_norm_on}"
    assert_bf16_close(name, k_pool[slots[keep].long()], want_k[keep], atol=1e-2)
    assert torch.equal(v_pool[slots[keep].long()], heads[:, nkv:].reshape(tokens, -1)[keep])
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEV)
    untouched[slots[keep].long()] = False
    assert not k_pool[untouched].any() and not v_pool[untouched].any()


@pytest.mark.parametrize("tokens", [1, 7, 129])
@pytest.mark.parametrize("layers", [1, 5])
@pytest.mark.parametrize("head_dim,nkv", [(64, 3), (128, 8)])
@pytest.mark.parametrize("k_norm_on", [True, False])
def test_kv_norm_rope_write_layers(tokens, layers, head_dim, nkv, k_norm_on):
    """The drafter's all-layer context write == the one-layer op applied layer by layer."""
    K = _ops()
    num_slots = 256
    kv = bf16(tokens, layers * 2 * nkv * head_dim, scale=2.0, seed=28)
    k_norm = bf16(layers, head_dim, scale=0.3, offset=1.0, seed=29) if k_norm_on else None
    pos = positions_of(tokens, 5 * head_dim)
    inv = inv_freq_of(head_dim, base=10_000.0)
    slots = scattered_slots(tokens, num_slots, seed=tokens + 7)
    k_pool = torch.zeros(layers, num_slots, nkv * head_dim, device=DEV, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    K.cuda_kv_norm_rope_write_layers(kv, k_norm, 1e-6, pos, inv, slots, layers, nkv, head_dim, k_pool, v_pool)
    per_layer = kv.view(tokens, layers, 2 * nkv * head_dim)
    for layer in range(layers):
        want_k = torch.zeros(num_slots, nkv * head_dim, device=DEV, dtype=torch.bfloat16)
        want_v = torch.zeros_like(want_k)
        K.cuda_kv_norm_rope_write(per_layer[:, layer].contiguous(), None if k_norm is None else k_norm[layer].contiguous(),
                                  1e-6, pos, inv, slots, nkv, head_dim, want_k, want_v)
        assert torch.equal(k_pool[layer], want_k), f"layer {layer}: K differs from the one-layer op"
        assert torch.equal(v_pool[layer], want_v), f"layer {layer}: V differs from the one-layer op"
