# tests/gpu/test_cuda_decode_attention_rope.py
#
# The CUDA decode attention with the QKV split, per-head RMSNorm, RoPE and K/V write fused into
# its prologue (cuda::decode_attention_rope, through dflash._core.testing.cuda_decode_attention_rope)
# against the two launches it replaces (cuda_qkv_norm_rope_write, then cuda_decode_attention):
# the attention output and both pools (every slot, NaN-filled unused ones included) must have the
# same bits. The batches are test_triton_attention.py's ragged ones over a scattered paged cache;
# each sequence's last num_q keys are the new tokens, whose K/V the kernel writes before it reads
# them. Covers GQA 32/8, 4/4 and 9/3, head_dim 64 and 128, with and without Qwen3's q/k norms; one
# query per sequence (AR) and as many as fit in 16 rows; causal, non-causal, sliding and
# symmetric windows; one split, the automatic count and forced ones, including new keys that
# straddle two splits (each is written by the CTA that reads it); a token whose slot is negative
# (not written, as in the unfused kernel); and the launches it refuses (more than 16 rows per KV
# head, pointers that the RoPE lane layout cannot read). Every kernel case runs on the register
# version and on the staged-K/V version (the same bits). Then whole sessions: with
# DFLASH_ROPE_ATTENTION=1 (and with DFLASH_ATTENTION=staged beside it) the AR and DFlash decodes are
# token- and logit-identical to the default, and the profiler shows the fused kernel ran (and the
# unfused one without the switch).
from __future__ import annotations

import pytest

from .session_runs import assert_switch_keeps_bits, tiny_drafter
from .test_triton_attention import _SKIP_REASON, BATCH_KV, HEADS, MODES, Batch

pytestmark = pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")


def _testing():
    from dflash._core import testing

    return testing


class RopeInputs:
    """The raw QKV projection of a batch's new tokens (its last num_q keys per sequence), their
    positions and slots, the RoPE frequencies and the optional per-head norm weights."""

    def __init__(self, b: Batch, qk_norm: bool, seed: int):
        import torch

        gen = torch.Generator().manual_seed(seed)
        heads = b.nh + 2 * b.nkv
        t = sum(b.q_lens)
        self.qkv = torch.randn(t, heads, b.hd, generator=gen).bfloat16().cuda()
        table = b.table.cpu()
        positions, slots = [], []
        for s, (n, nq) in enumerate(zip(b.kv_lens, b.q_lens)):
            for i in range(nq):
                pos = n - nq + i
                positions.append(pos)
                slots.append(int(table[s, pos // b.block_size]) * b.block_size + pos % b.block_size)
        self.positions = torch.tensor(positions, dtype=torch.int32, device="cuda")
        self.slots = torch.tensor(slots, dtype=torch.int32, device="cuda")
        half = torch.arange(0, b.hd, 2, dtype=torch.float64) / b.hd
        self.inv_freq = (1.0 / (10000.0**half)).float().cuda()
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = (1.0 + 0.1 * torch.randn(b.hd, generator=gen)).bfloat16().cuda()
            self.k_norm = (1.0 + 0.1 * torch.randn(b.hd, generator=gen)).bfloat16().cuda()


def _bits(x):
    import torch

    return x.contiguous().view(torch.int16)


def _workspace(b, splits):
    import torch

    t = _testing()
    if splits == "none":
        return None, None
    n = t.cuda_decode_attention_max_splits()
    ws = torch.empty(t.cuda_decode_attention_workspace_bytes(sum(b.q_lens), b.nh, b.hd, n), dtype=torch.uint8,
                     device="cuda")
    return ws, torch.zeros(len(b.kv_lens) * b.nkv, dtype=torch.int32, device="cuda")


def attend(b: Batch, r: RopeInputs, fused: bool, causal, window, *, splits="none", force_splits=0, symmetric=False,
           staged=False):
    """On copies of the pools: decode_attention_rope (fused; staged: its staged-K/V version), or
    qkv_norm_rope_write then decode_attention (the register version). Returns (out, k_pool, v_pool,
    splits launched)."""
    import torch

    t = _testing()
    k_pool, v_pool = b.k_pool.clone(), b.v_pool.clone()
    out = torch.full((sum(b.q_lens), b.nh, b.hd), float("nan"), dtype=torch.bfloat16, device="cuda")
    ws, counters = _workspace(b, splits)
    batch = (b.query_start, b.kv_len, b.table, causal, window, max(b.q_lens), max(b.kv_lens))
    options = {"workspace": ws, "counters": counters, "force_splits": force_splits, "symmetric_window": symmetric}
    if fused:
        launched = t.cuda_decode_attention_rope(r.qkv, r.q_norm, r.k_norm, 1e-6, r.positions, r.inv_freq, r.slots,
                                                k_pool, v_pool, out, *batch, **options, staged=staged)
    else:
        q = torch.empty_like(out)
        t.cuda_qkv_norm_rope_write(r.qkv, r.q_norm, r.k_norm, 1e-6, r.positions, r.inv_freq, r.slots, b.nh, b.nkv,
                                   b.hd, q, k_pool, v_pool)
        launched = t.cuda_decode_attention(q, k_pool, v_pool, out, *batch, **options)
    if counters is not None:
        assert int(counters.abs().sum()) == 0, "the split counters must return to zero"
    return out, k_pool, v_pool, launched


def check(b: Batch, r: RopeInputs, causal, window, what, staged=False, **kw):
    """The fused launch (staged: with K/V staged in shared memory) has the bits of the two unfused
    ones on the register kernel (output and pools); returns its result."""
    import torch

    what = f"{what}{', staged' if staged else ''}"
    out_w, k_w, v_w, splits_w = attend(b, r, False, causal, window, **kw)
    got = attend(b, r, True, causal, window, staged=staged, **kw)
    out_g, k_g, v_g, splits_g = got
    assert splits_g == splits_w, what
    assert torch.isfinite(out_g.float()).all(), f"{what}: non-finite output"
    assert torch.equal(_bits(out_g), _bits(out_w)), f"{what}: output bits differ"
    assert torch.equal(_bits(k_g), _bits(k_w)), f"{what}: K pool bits differ"
    assert torch.equal(_bits(v_g), _bits(v_w)), f"{what}: V pool bits differ"
    # not vacuous: the new tokens' keys were written (they differ from the batch's random ones)
    written = r.slots[r.slots >= 0].long()
    k_flat = k_g.view(-1, b.nkv, b.hd)
    assert not torch.equal(_bits(k_flat[written]), _bits(b.k_pool.view(-1, b.nkv, b.hd)[written])), what
    return got


def queries(kind, nh, nkv, kv_len):
    return 1 if kind == "decode" else max(1, min(16 // (nh // nkv), kv_len))


def batch_of(kind, kv_lens, nh, nkv, hd, seed):
    return Batch(kv_lens, [queries(kind, nh, nkv, n) for n in kv_lens], nh, nkv, hd, seed=seed)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["decode", "multi"])
@pytest.mark.parametrize("batch", list(BATCH_KV))
@pytest.mark.parametrize("nh,nkv,hd", HEADS)
def test_matches_unfused(nh, nkv, hd, batch, kind, mode, qk_norm, staged):
    causal, window = MODES[mode]
    b = batch_of(kind, BATCH_KV[batch], nh, nkv, hd, seed=batch * 100 + nh + hd)
    r = RopeInputs(b, qk_norm, seed=batch + hd)
    check(b, r, causal, window, "one split", staged=staged)
    check(b, r, causal, window, "auto splits", splits="auto", staged=staged)
    for forced in (3, 32):
        check(b, r, causal, window, f"{forced} splits", splits="forced", force_splits=forced, staged=staged)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("nh,nkv,hd", [(32, 8, 128), (4, 4, 64), (9, 3, 64)])
def test_new_keys_straddle_splits(nh, nkv, hd, staged):
    """kv_len 66 in two splits of 64 keys: the new keys 62.. (or 50.. at group 1) lie in both."""
    b = batch_of("multi", [66, 66, 130], nh, nkv, hd, seed=5)
    assert max(b.q_lens) > 2
    r = RopeInputs(b, True, seed=6)
    for forced in (2, 3):
        check(b, r, True, 0, f"{forced} splits", splits="forced", force_splits=forced, staged=staged)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("window", [1, 16, 2048])
@pytest.mark.parametrize("nh,nkv,hd", [(32, 8, 128), (9, 3, 64)])
def test_symmetric_window(nh, nkv, hd, window, staged):
    b = batch_of("multi", [1, 5, 17, 65, 129, 1000], nh, nkv, hd, seed=window)
    r = RopeInputs(b, hd == 128, seed=window + 1)
    for splits, forced in (("none", 0), ("auto", 0), ("forced", 3)):
        check(b, r, False, window, f"symmetric w{window}, {splits}", splits=splits, force_splits=forced,
              symmetric=True, staged=staged)


@pytest.mark.parametrize("staged", [False, True])
def test_negative_slot_is_not_written(staged):
    """A token with slot -1 writes nothing (its key keeps the pool's old value, in both forms)."""
    import torch

    b = Batch([300, 40], [1, 1], 32, 8, 128, seed=9)
    r = RopeInputs(b, True, seed=10)
    r.slots[0] = -1
    _, k_pool, _, _ = check(b, r, True, 0, "slot -1", splits="auto", staged=staged)
    old = int(b.table[0, 299 // 16]) * 16 + 299 % 16
    assert torch.equal(_bits(k_pool.view(-1, 8, 128)[old]), _bits(b.k_pool.view(-1, 8, 128)[old]))


def test_refusals():
    import torch

    t = _testing()

    def launch(b, r, qkv, out, max_query_len):
        t.cuda_decode_attention_rope(qkv, r.q_norm, r.k_norm, 1e-6, r.positions, r.inv_freq, r.slots, b.k_pool,
                                     b.v_pool, out, b.query_start, b.kv_len, b.table, True, 0, max_query_len,
                                     max(b.kv_lens))

    # 16 queries of a GQA group of 4: 64 rows per KV head, the tensor-core kernel's launch
    b = Batch([100], [16], 32, 8, 128, seed=1)
    r = RopeInputs(b, True, seed=2)
    out = torch.empty(16, 32, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="CUDA-core kernel only"):
        launch(b, r, r.qkv, out, 16)
    # qkv that starts 2 bytes into its buffer: the 4-byte pair loads of head_dim 128 cannot read it
    b = Batch([100], [1], 32, 8, 128, seed=3)
    r = RopeInputs(b, False, seed=4)
    shifted = torch.empty(r.qkv.numel() + 1, dtype=torch.bfloat16, device="cuda")[1:].view(r.qkv.shape)
    shifted.copy_(r.qkv)
    out = torch.empty(1, 32, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="head_dim / 32-byte"):
        launch(b, r, shifted, out, 1)
    with pytest.raises(ValueError, match="qkv"):
        launch(b, r, r.qkv.reshape(-1)[:-8].contiguous(), out, 1)


# (arch, heads, KV heads, head_dim): Qwen3 with q/k norms at head_dim 128 and a GQA group of 4 (the
# drafter's block and the verify rows exceed 16 per KV head: unfused there, and a speculative
# session's decode steps are all speculative, so the fused kernel never runs in it); Llama without norms
# at head_dim 64 and group 1 (the drafters' 8-token blocks and the 9-row verify run fused too).
# Target-only, with a DFlash drafter and with a DFlash2 drafter.
SESSION_MODELS = [("qwen3", 8, 2, 128), ("llama", 4, 4, 64)]


@pytest.mark.parametrize("spec", [None, "dflash", "dflash2"])
@pytest.mark.parametrize("arch,nh,nkv,hd", SESSION_MODELS)
def test_session_is_bit_identical(arch, nh, nkv, hd, spec, tmp_path):
    from tests.fixtures.tiny_models import write_tiny_model
    from tests.gpu.gpu_helpers import gpu_dflash2

    target = write_tiny_model(tmp_path / "m", arch=arch, hidden_size=nh * hd, num_layers=2, num_heads=nh,
                              num_kv_heads=nkv, head_dim=hd, intermediate_size=512, dtype="bfloat16", seed=13)
    draft = None
    if spec == "dflash":
        draft = tiny_drafter(tmp_path / "d", target)
    elif spec == "dflash2":
        draft = gpu_dflash2(tmp_path, target, block_size=8)
    # decode_attention_kernel<head_dim, rows, ROPE, STAGED>
    assert_switch_keeps_bits(target, draft, {"DFLASH_ROPE_ATTENTION": "0"}, {"DFLASH_ROPE_ATTENTION": "1"},
                             "true, false>", runs=spec is None or nkv == nh)


@pytest.mark.parametrize("spec", [None, "dflash"])
@pytest.mark.parametrize("arch,nh,nkv,hd", SESSION_MODELS)
def test_staged_fused_session_is_bit_identical(arch, nh, nkv, hd, spec, tmp_path):
    """Both switches (DFLASH_ATTENTION=staged and DFLASH_ROPE_ATTENTION=1): the staged kernel with
    the fused prologue runs, with the default session's tokens and logits."""
    from tests.fixtures.tiny_models import write_tiny_model

    target = write_tiny_model(tmp_path / "m", arch=arch, hidden_size=nh * hd, num_layers=2, num_heads=nh,
                              num_kv_heads=nkv, head_dim=hd, intermediate_size=512, dtype="bfloat16", seed=17)
    draft = tiny_drafter(tmp_path / "d", target) if spec else None
    assert_switch_keeps_bits(target, draft, {}, {"DFLASH_ROPE_ATTENTION": "1", "DFLASH_ATTENTION": "staged"},
                             "true, true>", runs=spec is None or nkv == nh)
