# tests/gpu/test_cuda_kernels.py
#
# Every CUDA kernel of cuda/kernels.h (through dflash._core.testing.cuda_<op>) against a short
# torch / numpy reference, over odd sizes. bf16 inputs; outputs compared in fp32 with the stated
# tolerances (bf16 outputs: a few ulps, 2^-8 relative each). Sampling and acceptance: exact
# agreement with a numpy port of the CPU backend (cpu_sampling.cpp, host_acceptance.cpp) including
# its Philox streams, plus chi-squared tests of the sampled distributions. Max errors are
# printed (run with -s). Skipped without a CUDA device or a CUDA build of dflash.
from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.gpu_helpers import kernel_ops, requires_cuda, torch

pytestmark = requires_cuda


_ops = kernel_ops


DEV = "cuda"


def bf16(*shape, scale=1.0, offset=0.0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * scale + offset).to(torch.bfloat16)


def report(name, got, want):
    err = (got.float() - want.float()).abs()
    rel = err / want.float().abs().clamp_min(1e-3)
    print(f"{name}: max abs err {err.max().item():.3g}, max rel err {rel.max().item():.3g}")
    return err


def assert_bf16_close(name, got, want, rtol=2 ** -7, atol=1e-3):
    """got (bf16) within rtol (2 bf16 ulps) relative plus atol of the fp32 reference."""
    report(name, got, want)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------------------------
# Element-wise ops, norms, embedding, copies


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


# --------------------------------------------------------------------------------------------
# RoPE and KV writes


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


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("vocab", [1000, 1001, 151936])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_rows(rows, vocab, dtype):
    K = _ops()
    g = torch.Generator(device=DEV).manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, device=DEV, generator=g).to(dtype)
    logits[0, vocab // 3] = 7.0  # a tie at the max: the lowest id wins
    logits[0, vocab - 1] = 7.0
    out = torch.empty(rows, device=DEV, dtype=torch.int32)
    K.cuda_argmax_rows(logits, out)
    want = logits.float().argmax(dim=1).to(torch.int32)  # torch returns the first maximal index
    assert torch.equal(out, want)
    assert int(out[0]) == vocab // 3


def test_assemble_drafts():
    K = _ops()
    rows, n = 5, 7
    proposed = torch.arange(rows * n, device=DEV, dtype=torch.int32).view(rows, n)
    override = 1000 + proposed
    use = torch.tensor([0, 1, 0, 0, 1], device=DEV, dtype=torch.int32)
    drafts = torch.full((rows, n), -1, device=DEV, dtype=torch.int32)
    verify = torch.full((rows, n + 1), -5, device=DEV, dtype=torch.int32)
    K.cuda_assemble_drafts(proposed, override, use, drafts, verify)
    want = torch.where(use[:, None].bool(), override, proposed)
    assert torch.equal(drafts, want)
    assert torch.equal(verify[:, 1:], want)
    assert (verify[:, 0] == -5).all()  # the anchors are left alone


# --------------------------------------------------------------------------------------------
# Sampling reference: a numpy port of common/philox.h and of cpu_sampling.cpp / host_acceptance.cpp

STREAM_TARGET_SAMPLE, STREAM_ACCEPT = 0, 2
_M32 = np.uint64(0xFFFFFFFF)


def philox_uniform(seed, position, index, stream):
    c0 = np.asarray(index, dtype=np.uint64).copy()
    c1 = np.full(c0.shape, stream, dtype=np.uint64)
    c2 = np.full(c0.shape, position & 0xFFFFFFFF, dtype=np.uint64)
    c3 = np.full(c0.shape, (position >> 32) & 0xFFFFFFFF, dtype=np.uint64)
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    for _ in range(10):
        p0, p1 = c0 * np.uint64(0xD2511F53), c2 * np.uint64(0xCD9E8D57)
        n0 = (p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0)
        n2 = (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1)
        c0, c1, c2, c3 = n0, p1 & _M32, n2, p0 & _M32
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return ((c0 >> np.uint64(9)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 8388608.0)


def ref_filtered(logits, temperature, top_k, top_p):
    """cpu_sampling.cpp filtered_distribution: kept ids (CPU order) and their probabilities."""
    vocab = logits.shape[0]
    use_k, use_p = 0 < top_k < vocab, np.float32(top_p) < 1
    ids = np.arange(vocab)
    if use_k or use_p:
        ids = np.lexsort((ids, -logits.astype(np.float64)))  # logit desc, id asc
        if use_k:
            ids = ids[:top_k]
    z = logits[ids].astype(np.float64) * (1.0 / np.float64(np.float32(temperature)))
    p = np.exp(z - z.max())
    if use_p:
        cum = np.cumsum(p / p.sum())
        n = int(np.argmax(cum >= np.float64(np.float32(top_p)))) + 1 if (cum >= np.float32(top_p)).any() else len(ids)
        ids, p = ids[:n], p[:n]
    return ids, p / p.sum()


def ref_draw(ids, probs, excluded, seed, position):
    """cpu_sampling.cpp draw_token. Returns (token, u_hit_one): the second flags a kept token whose
    uniform is exactly 1.0 (philox_uniform can return 1.0f; see the report), where the GPU's
    candidate bound may legitimately differ from the CPU."""
    u = philox_uniform(seed, position, ids, STREAM_TARGET_SAMPLE).astype(np.float64)
    ok = (ids != excluded) & (probs > 0)
    with np.errstate(divide="ignore"):
        score = np.where(ok, np.log(probs) - np.log(-np.log(u)), -np.inf)
    hit_one = bool((u[ok] >= 1.0).any())
    if not ok.any():
        return -1, hit_one
    return int(ids[int(np.argmax(score))]), hit_one


def ref_sample(logits, temperature, top_k, top_p, seed, position):
    if temperature <= 0:
        return int(np.argmax(logits)), False
    ids, probs = ref_filtered(logits, temperature, top_k, top_p)
    return ref_draw(ids, probs, -1, seed, position)


def ref_accept(drafts, logits, temperature, top_k, top_p, seed, first_position):
    """host_acceptance.cpp accept_drafts: (num_accepted, next_token, u_hit_one)."""
    n = len(drafts)
    if temperature <= 0:
        for j in range(n + 1):
            best = int(np.argmax(logits[j]))
            if j == n or drafts[j] != best:
                return j, best, False
    for j in range(n + 1):
        pos = first_position + j
        ids, probs = ref_filtered(logits[j], temperature, top_k, top_p)
        if j == n:
            tok, hit = ref_draw(ids, probs, -1, seed, pos)
            return n, tok, hit
        p_d = float(probs[ids == drafts[j]].sum())
        u = float(philox_uniform(seed, pos, [0], STREAM_ACCEPT)[0])
        if u < p_d:
            continue
        tok, hit = ref_draw(ids, probs, drafts[j], seed, pos)
        return j, tok, hit


def chi2_ok(samples, probs):
    """The chi-squared test of tests/test_dflash_sampling.py (about the 99.9 % quantile)."""
    expected = probs * len(samples)
    big = expected >= 5
    obs = [np.sum(samples == t) for t in np.nonzero(big)[0]]
    exp = list(expected[big])
    rest_obs, rest_exp = int(np.sum(~big[samples])), float(expected[~big].sum())
    if rest_exp > 0:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:
        assert rest_obs == 0  # tokens outside the support never appear
    obs, exp = np.array(obs, dtype=float), np.array(exp)
    chi2 = float(np.sum((obs - exp) ** 2 / exp))
    dof = len(exp) - 1
    limit = dof + 3.3 * np.sqrt(2 * max(dof, 1)) + 10
    return chi2, dof, chi2 < limit


def llm_like_logits(rows, vocab, seed, spread=3.0, boost=True):
    """fp32 logits, with a peaked head like a language model's when boost."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, vocab, device=DEV, generator=g) * spread
    if boost:
        top = torch.randint(0, vocab, (rows, 8), device=DEV, generator=g)
        x.scatter_add_(1, top, torch.rand(rows, 8, device=DEV, generator=g) * 12 + 4)
    return x


def run_sample(logits, temperature, top_k, top_p, seeds, positions):
    K = _ops()
    rows = logits.shape[0]
    as_list = lambda v, t: list(v) if isinstance(v, (list, tuple, np.ndarray)) else [t(v)] * rows  # noqa: E731
    tokens = torch.full((rows,), -7, device=DEV, dtype=torch.int32)
    K.cuda_sample(logits.contiguous(), as_list(temperature, float), as_list(top_k, int), as_list(top_p, float),
                  [int(s) for s in seeds], [int(p) for p in positions], tokens)
    return tokens.cpu().numpy()


# --------------------------------------------------------------------------------------------
# sample


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("vocab", [1000, 151936, 1001])
@pytest.mark.parametrize("ties", [False, True])
def test_sample_greedy_is_argmax(rows, vocab, ties):
    logits = llm_like_logits(rows, vocab, seed=vocab + rows)
    if ties:
        logits = logits.round().clamp(max=5.0)  # many equal maxima: the lowest id wins
    tokens = run_sample(logits, 0.0, 0, 1.0, range(rows), range(rows))
    want = torch.argmax(logits, dim=-1).cpu().numpy()  # first maximal index
    assert np.array_equal(tokens, want)


SAMPLE_CONFIGS = [  # temperature, top_k, top_p
    (1.0, 0, 1.0),
    (0.8, 0, 1.0),
    (0.7, 20, 1.0),
    (0.6, 0, 0.95),
    (0.6, 20, 0.95),
    (1.3, 50, 0.8),
    (0.8, 1, 1.0),
    (1.0, 0, 0.3),
    (1.5, 5000, 1.0),  # top-k larger than the shared-memory list: cut in one bin
    (2.0, 0, 0.999),  # top-p over a large kept set
]


def compare_with_reference(logits, configs, seeds, positions, name):
    rows = logits.shape[0]
    temps = [configs[i % len(configs)][0] for i in range(rows)]
    ks = [configs[i % len(configs)][1] for i in range(rows)]
    ps = [configs[i % len(configs)][2] for i in range(rows)]
    tokens = run_sample(logits, temps, ks, ps, seeds, positions)
    host = logits.cpu().numpy()
    mismatches, skipped = [], 0
    for r in range(rows):
        want, hit_one = ref_sample(host[r], temps[r], ks[r], ps[r], int(seeds[r]), int(positions[r]))
        if hit_one:
            skipped += 1
            continue
        if tokens[r] != want:
            mismatches.append((r, temps[r], ks[r], ps[r], int(tokens[r]), want))
    print(f"{name}: {rows} rows, {len(mismatches)} mismatches vs the CPU reference, {skipped} rows skipped (u == 1)")
    assert not mismatches, mismatches[:5]


@pytest.mark.parametrize("vocab", [1000, 151936, 50257])
def test_sample_matches_cpu_reference(vocab):
    rows = 2 * len(SAMPLE_CONFIGS) + 3
    logits = llm_like_logits(rows, vocab, seed=vocab)
    seeds = [1000 + 7919 * r for r in range(rows)]
    positions = [5 + 13 * r for r in range(rows)]
    compare_with_reference(logits, SAMPLE_CONFIGS, seeds, positions, f"sample vocab={vocab}")


@pytest.mark.parametrize("vocab", [1000, 151936])
@pytest.mark.parametrize("kind", ["all_equal", "concentrated", "two_levels"])
def test_sample_exact_cut_fallbacks(vocab, kind):
    """Ties across the cut and bins of more than 2048 tokens (the radix select + scan by id)."""
    rows = 12
    g = torch.Generator(device=DEV).manual_seed(3)
    if kind == "all_equal":
        logits = torch.full((rows, vocab), 1.25, device=DEV)
    elif kind == "concentrated":
        logits = torch.randn(rows, vocab, device=DEV, generator=g) * 0.002
    else:
        logits = (torch.rand(rows, vocab, device=DEV, generator=g) < 0.5).float() * 0.5
    configs = [(1.0, 5, 1.0), (1.0, 0, 0.3037), (0.9, 3000, 0.77), (1.0, 2500, 1.0), (1.1, 0, 0.61), (1.0, 1, 1.0)]
    seeds = [11 + r for r in range(rows)]
    positions = [100 + r for r in range(rows)]
    compare_with_reference(logits, configs, seeds, positions, f"sample fallback {kind} vocab={vocab}")


@pytest.mark.parametrize("vocab", [1000, 151936])
def test_sample_support_respected(vocab):
    """Many draws of one row: every token lies in the CPU reference's kept set."""
    rows = 512
    base = llm_like_logits(1, vocab, seed=42)
    logits = base.expand(rows, vocab).contiguous()
    host = base[0].cpu().numpy()
    for temperature, top_k, top_p in [(1.0, 10, 1.0), (1.0, 0, 0.7), (1.2, 40, 0.9)]:
        tokens = run_sample(logits, temperature, top_k, top_p, range(rows), [9] * rows)
        ids, _ = ref_filtered(host, temperature, top_k, top_p)
        outside = set(tokens.tolist()) - set(ids.tolist())
        print(f"support vocab={vocab} T={temperature} k={top_k} p={top_p}: kept {len(ids)}, distinct drawn "
              f"{len(set(tokens.tolist()))}")
        assert not outside, sorted(outside)[:10]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (10, 1.0), (0, 0.8), (10, 0.8)])
def test_sample_distribution_chi2(top_k, top_p):
    rows, vocab, temperature = 20000, 50, 0.8
    base = llm_like_logits(1, vocab, seed=5, spread=1.5, boost=False)
    logits = base.expand(rows, vocab).contiguous()
    tokens = run_sample(logits, temperature, top_k, top_p, [3 * r + 1 for r in range(rows)], [r % 97 for r in range(rows)])
    ids, probs = ref_filtered(base[0].cpu().numpy(), temperature, top_k, top_p)
    p = np.zeros(vocab)
    p[ids] = probs
    chi2, dof, ok = chi2_ok(tokens, p)
    print(f"sample chi2 T={temperature} top_k={top_k} top_p={top_p}: chi2={chi2:.1f} dof={dof}")
    assert ok, (chi2, dof)


def test_sample_is_deterministic():
    logits = llm_like_logits(17, 151936, seed=8)
    args = (logits, 0.9, 30, 0.9, range(17), range(17))
    assert np.array_equal(run_sample(*args), run_sample(*args))


# --------------------------------------------------------------------------------------------
# accept_drafts


def run_accept(drafts, logits, temperature, top_k, top_p, seeds, positions):
    K = _ops()
    rows = drafts.shape[0]
    as_list = lambda v, t: list(v) if isinstance(v, (list, tuple, np.ndarray)) else [t(v)] * rows  # noqa: E731
    num = torch.full((rows,), -7, device=DEV, dtype=torch.int32)
    nxt = torch.full((rows,), -7, device=DEV, dtype=torch.int32)
    K.cuda_accept_drafts(drafts.contiguous(), logits.contiguous(), as_list(temperature, float), as_list(top_k, int),
                         as_list(top_p, float), [int(s) for s in seeds], [int(p) for p in positions], num, nxt)
    return num.cpu().numpy(), nxt.cpu().numpy()


def drafts_following_argmax(logits, seed):
    """Drafts equal to each row's argmax up to a random first mismatch (or none)."""
    rows, n1, vocab = logits.shape
    n = n1 - 1
    drafts = torch.argmax(logits[:, :n], dim=-1).to(torch.int32)
    rng = np.random.default_rng(seed)
    for r in range(rows):
        cut = int(rng.integers(0, n + 1))
        if cut < n:
            drafts[r, cut] = (drafts[r, cut] + 1 + int(rng.integers(0, vocab - 1))) % vocab
    return drafts


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("n", [0, 1, 7, 15, 40])
@pytest.mark.parametrize("vocab", [1000, 151936])
def test_accept_greedy(rows, n, vocab):
    logits = llm_like_logits(rows * (n + 1), vocab, seed=rows * 31 + n).view(rows, n + 1, vocab)
    drafts = drafts_following_argmax(logits, seed=n)
    num, nxt = run_accept(drafts, logits, 0.0, 0, 1.0, range(rows), range(rows))
    best = torch.argmax(logits, dim=-1).cpu().numpy()
    d = drafts.cpu().numpy()
    for r in range(rows):
        a = 0
        while a < n and d[r, a] == best[r, a]:
            a += 1
        assert (num[r], nxt[r]) == (a, best[r, a]), r


@pytest.mark.parametrize("vocab", [1000, 151936])
@pytest.mark.parametrize("rows,n", [(20, 6), (10, 6), (8, 15), (3, 31), (2, 40)])
def test_accept_sampling_matches_cpu_reference(vocab, rows, n):
    """Few requests run the cluster kernel (8 blocks per request), many the one-block kernel."""
    logits = llm_like_logits(rows * (n + 1), vocab, seed=vocab + 1, spread=2.0).view(rows, n + 1, vocab)
    drafts = drafts_following_argmax(logits, seed=vocab)  # likely accepted, then a rejection
    temps = [SAMPLE_CONFIGS[i % len(SAMPLE_CONFIGS)][0] for i in range(rows)]
    ks = [SAMPLE_CONFIGS[i % len(SAMPLE_CONFIGS)][1] for i in range(rows)]
    ps = [SAMPLE_CONFIGS[i % len(SAMPLE_CONFIGS)][2] for i in range(rows)]
    seeds = [77 + 1009 * r for r in range(rows)]
    positions = [40 + 3 * r for r in range(rows)]
    num, nxt = run_accept(drafts, logits, temps, ks, ps, seeds, positions)
    host, d = logits.cpu().numpy(), drafts.cpu().numpy()
    mismatches, skipped = [], 0
    for r in range(rows):
        a, tok, hit = ref_accept(d[r], host[r], temps[r], ks[r], ps[r], seeds[r], positions[r])
        if hit:
            skipped += 1
        elif (num[r], nxt[r]) != (a, tok):
            mismatches.append((r, temps[r], ks[r], ps[r], (int(num[r]), int(nxt[r])), (a, tok)))
    print(f"accept vocab={vocab} n={n}: {rows} requests, accepted {num.tolist()}, {len(mismatches)} mismatches, "
          f"{skipped} skipped (u == 1)")
    assert not mismatches, mismatches[:5]


@pytest.mark.parametrize("top_p", [1.0, 0.8])
@pytest.mark.parametrize("proposal", ["random_draft", "likeliest_token"])
def test_accept_sampling_distribution(top_p, proposal):
    """The token emitted at the draft's position (the draft if accepted, else the correction)
    follows the target distribution; a draft d is accepted with frequency p(d)."""
    rows, vocab, temperature = 20000, 50, 0.8
    base = llm_like_logits(2, vocab, seed=9, spread=1.5, boost=False)
    logits = base.unsqueeze(0).expand(rows, 2, vocab).contiguous()
    ids, probs = ref_filtered(base[0].cpu().numpy(), temperature, 0, top_p)
    p = np.zeros(vocab)
    p[ids] = probs
    if proposal == "likeliest_token":
        draft = np.full(rows, int(np.argmax(p)))
    else:
        draft = np.random.default_rng(1).integers(0, vocab, rows)
    drafts = torch.tensor(draft, device=DEV, dtype=torch.int32).view(rows, 1)
    num, nxt = run_accept(drafts, logits, temperature, 0, top_p, [5 * r + 2 for r in range(rows)], [r % 89 for r in range(rows)])
    emitted = np.where(num >= 1, draft, nxt)
    chi2, dof, ok = chi2_ok(emitted, p)
    accepted = float(np.mean(num >= 1))
    expected = float(np.mean(p[draft]))
    print(f"accept {proposal} top_p={top_p}: chi2={chi2:.1f} dof={dof} acceptance={accepted:.4f} "
          f"mean p(d)={expected:.4f}")
    assert ok, (chi2, dof)
    assert abs(accepted - expected) < 4 * np.sqrt(max(expected * (1 - expected), 1e-4) / rows) + 0.005
    assert np.all(nxt[num == 0] != draft[num == 0])  # a rejected draft is never the correction
