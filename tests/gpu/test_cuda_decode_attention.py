# tests/gpu/test_cuda_decode_attention.py
#
# The CUDA decode attention (cuda/decode_attention.cu, CUDA cores, <= 16 rows per KV head, and
# cuda/decode_attention_mma.cu, tensor cores, 17..64 rows or forced with tensor_cores=True, through
# dflash._core.testing.cuda_decode_attention) against the torch reference of
# test_triton_attention.py (same ragged batches over a scattered paged cache whose unused slots
# are NaN, same masks, same tolerances): one query per sequence (AR decode), as many as fit in
# 16 rows per KV head (multi) and in 64 (verify: 16 queries of a GQA group of 4, SmolLM2's 16 x 3);
# GQA 32/8, 4/4, 9/3; head_dim 64 and 128; one split, the automatic split count and forced ones
# (the last CTA combines the partials, its counters return to zero), long contexts, symmetric
# windows (|q_pos - j| < window), replay inside a CUDA graph, determinism, non-finite V behind
# the causal mask, and the arguments it refuses. The staged-K/V version of the CUDA-core kernel
# (staged=True) is run through the same checks and must give the register version's bits.
from __future__ import annotations

import pytest

from .test_triton_attention import _SKIP_REASON, BATCH_KV, HEADS, MODES, Batch, assert_matches

pytestmark = pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")


def _testing():
    from dflash._core import testing

    return testing


def rows_fit(nh, nkv, kind, kv_len):
    """Queries per sequence: 1 (decode), as many as fit in 16 rows of a KV head (multi), or as many
    as fit in 64 rows, at most 16 (verify) or 8 (verify8: 17..32 rows, the two-tile shape)."""
    if kind == "decode":
        return 1
    if kind == "multi":
        return max(1, min(16 // (nh // nkv), kv_len))
    return max(1, min(64 // (nh // nkv), 16 if kind == "verify" else 8, kv_len))


# (kind, kernel): the CUDA-core kernel's row counts on both kernels; verify rows take tensor cores.
KINDS = [("decode", "auto"), ("decode", "tensor_cores"), ("decode", "staged"), ("multi", "auto"),
         ("multi", "tensor_cores"), ("multi", "staged"), ("verify", "auto"), ("verify8", "auto")]


def kernel_kw(kernel):
    """run()'s keyword arguments for a kernel name: auto, tensor_cores or staged."""
    return dict(tensor_cores=kernel == "tensor_cores", staged=kernel == "staged")


def run(b, causal, window, *, splits="none", force_splits=0, counters=None, symmetric=False, tensor_cores=False,
        staged=False):
    """Runs the kernel on batch b; splits: "none" (no workspace), or "auto"/"forced" with one."""
    import torch

    t = _testing()
    out = torch.full_like(b.q_dev, float("nan"))
    ws = None
    if splits != "none":
        n = max(force_splits, t.cuda_decode_attention_max_splits())
        ws = torch.empty(t.cuda_decode_attention_workspace_bytes(b.q.shape[0], b.nh, b.hd, n), dtype=torch.uint8,
                         device="cuda")
        if counters is None:
            counters = torch.zeros(len(b.kv_lens) * b.nkv, dtype=torch.int32, device="cuda")
    launched = t.cuda_decode_attention(b.q_dev, b.k_pool, b.v_pool, out, b.query_start, b.kv_len, b.table, causal,
                                       window, max(b.q_lens), max(b.kv_lens), workspace=ws, counters=counters,
                                       force_splits=force_splits, symmetric_window=symmetric,
                                       tensor_cores=tensor_cores, staged=staged)
    if counters is not None:
        assert int(counters.abs().sum()) == 0, "the split counters must return to zero"
    return out.float().cpu(), launched


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind,kernel", KINDS)
@pytest.mark.parametrize("batch", list(BATCH_KV))
@pytest.mark.parametrize("nh,nkv,hd", HEADS)
def test_matches_reference(nh, nkv, hd, batch, kind, kernel, mode):
    causal, window = MODES[mode]
    kv_lens = BATCH_KV[batch]
    kw = kernel_kw(kernel)
    b = Batch(kv_lens, [rows_fit(nh, nkv, kind, n) for n in kv_lens], nh, nkv, hd, seed=batch * 1000 + nh + hd)
    ref = b.reference(causal, window)
    out, splits = run(b, causal, window, **kw)
    assert splits == 1
    assert_matches(out, ref, "one split")
    out, splits = run(b, causal, window, splits="auto", **kw)
    assert splits >= 1
    assert_matches(out, ref, f"auto ({splits} splits)")
    for forced in (3, 32):
        out, splits = run(b, causal, window, splits="forced", force_splits=forced, **kw)
        assert splits == forced
        assert_matches(out, ref, f"{forced} splits")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind,kernel", KINDS)
@pytest.mark.parametrize("nh,nkv,hd", [(32, 8, 128), (9, 3, 64)])
def test_long_context(nh, nkv, hd, kind, kernel, mode):
    causal, window = MODES[mode]
    kv_lens = [8192, 5000, 3]
    b = Batch(kv_lens, [rows_fit(nh, nkv, kind, n) for n in kv_lens], nh, nkv, hd, seed=7)
    ref = b.reference(causal, window)
    kw = kernel_kw(kernel)
    out, splits = run(b, causal, window, splits="auto", **kw)
    assert splits > 1 or window > 0  # a 64-key window needs one split
    assert_matches(out, ref, f"long context, {splits} splits")
    out, splits = run(b, causal, window, **kw)  # one CTA over every key: many passes
    assert splits == 1
    assert_matches(out, ref, "long context, one split")


@pytest.mark.parametrize("window", [1, 3, 16, 2048])
@pytest.mark.parametrize("kind,kernel", [("multi", "auto"), ("multi", "tensor_cores"), ("multi", "staged"),
                                         ("verify", "auto")])
@pytest.mark.parametrize("nh,nkv,hd", HEADS)
def test_symmetric_window(nh, nkv, hd, kind, kernel, window):
    """A block of queries at the end of each sequence sees the keys |q_pos - j| < window, those
    above its position included."""
    import torch

    kv_lens = [1, 4, 5, 17, 64, 65, 129, 1000, 4999]
    kw = kernel_kw(kernel)
    b = Batch(kv_lens, [rows_fit(nh, nkv, kind, n) for n in kv_lens], nh, nkv, hd, seed=window + nh + hd)
    ref = b.reference(False, window, symmetric=True)
    out, splits = run(b, False, window, symmetric=True, **kw)
    assert splits == 1
    assert_matches(out, ref, f"symmetric w{window}, one split")
    out, splits = run(b, False, window, splits="auto", symmetric=True, **kw)
    assert_matches(out, ref, f"symmetric w{window}, auto ({splits} splits)")
    for forced in (3, 32):
        out, splits = run(b, False, window, splits="forced", force_splits=forced, symmetric=True, **kw)
        assert splits == forced
        assert_matches(out, ref, f"symmetric w{window}, {forced} splits")
    out, _ = run(b, True, window, symmetric=True, **kw)  # takes precedence over causal
    assert_matches(out, ref, f"symmetric w{window} with causal set")
    if window > 1 and max(b.q_lens) > 1:
        assert not torch.allclose(ref, b.reference(True, window), atol=0.1)


@pytest.mark.parametrize("q_len,kernel", [(1, "auto"), (1, "tensor_cores"), (1, "staged"), (4, "staged"),
                                          (16, "auto")])
def test_deterministic_and_graph_replay(q_len, kernel):
    """Bit-identical across runs, and inside a CUDA graph replayed twice (the counters reset)."""
    import torch

    t = _testing()
    b = Batch([1000, 300], [q_len, q_len], 32, 8, 128, seed=3)
    ref = b.reference(True, 0)
    first, splits = run(b, True, 0, splits="auto", **kernel_kw(kernel))
    assert splits > 1
    again, _ = run(b, True, 0, splits="auto", **kernel_kw(kernel))
    assert torch.equal(first, again)
    ws = torch.empty(t.cuda_decode_attention_workspace_bytes(b.q.shape[0], 32, 128, splits), dtype=torch.uint8,
                     device="cuda")
    counters = torch.zeros(2 * 8, dtype=torch.int32, device="cuda")
    out = torch.full_like(b.q_dev, float("nan"))
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        t.cuda_decode_attention(b.q_dev, b.k_pool, b.v_pool, out, b.query_start, b.kv_len, b.table, True, 0,
                                q_len, 1000, workspace=ws, counters=counters, stream=stream.cuda_stream,
                                **kernel_kw(kernel))
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.float().cpu(), first)
        assert int(counters.abs().sum()) == 0
    assert_matches(first, ref, "graph replay")


@pytest.mark.parametrize("q_len,kernel", [(1, "auto"), (1, "tensor_cores"), (1, "staged"), (4, "staged"),
                                          (16, "auto")])
def test_short_sequences_and_empty_ones(q_len, kernel):
    """kv_len 1 .. 70 around the 64-key pass, and a sequence without queries (left untouched)."""
    kv_lens = [1, 2, 63, 64, 65, 70, 5]
    b = Batch(kv_lens, [min(q_len, n) for n in kv_lens[:-1]] + [0], 32, 8, 128, seed=11)
    ref = b.reference(True, 0)
    out, _ = run(b, True, 0, splits="forced", force_splits=4, **kernel_kw(kernel))
    assert_matches(out, ref, "short sequences")


@pytest.mark.parametrize("q_len,kernel", [(4, "auto"), (4, "tensor_cores"), (4, "staged"), (16, "auto")])
def test_non_finite_v_behind_the_causal_mask(q_len, kernel):
    """The last query's K and V rows are NaN (a rejected draft's NaN row): the earlier queries,
    which mask that key, keep finite outputs equal to the reference; the last row is not finite."""
    import torch

    b = Batch([300, 90], [q_len, q_len], 32, 8, 128, seed=5)
    for s, n in enumerate(b.kv_lens):
        j = n - 1
        slot = int(b.table[s, j // b.block_size]) * b.block_size + j % b.block_size
        b.k_pool.view(-1, b.nkv, b.hd)[slot] = float("nan")
        b.v_pool.view(-1, b.nkv, b.hd)[slot] = float("nan")
        b.ks[s][j] = 0.0  # the reference's masked rows do not see it
        b.vs[s][j] = 0.0
    ref = b.reference(True, 0)
    for splits in ("none", "auto"):
        out, _ = run(b, True, 0, splits=splits, **kernel_kw(kernel))
        for s in range(len(b.kv_lens)):
            rows = slice(b.starts[s], b.starts[s + 1] - 1)  # all but the last query
            assert torch.isfinite(out[rows]).all(), f"sequence {s}: a masked NaN key leaked ({splits})"
            assert_matches(out[rows], ref[rows], f"sequence {s}, masked NaN key ({splits})")
            assert not torch.isfinite(out[b.starts[s + 1] - 1]).any(), "the query that sees the NaN key"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["decode", "multi"])
@pytest.mark.parametrize("nh,nkv,hd", HEADS)
def test_staged_kv_has_the_register_versions_bits(nh, nkv, hd, kind, mode):
    """Staging K/V in shared memory changes the data movement only: every output bit equals the
    register version's, one split, automatic, forced and many passes per CTA."""
    import torch

    causal, window = MODES[mode]
    kv_lens = [1, 63, 64, 65, 300, 4999]
    b = Batch(kv_lens, [rows_fit(nh, nkv, kind, n) for n in kv_lens], nh, nkv, hd, seed=nh * 7 + hd)
    for splits, forced in (("none", 0), ("auto", 0), ("forced", 3), ("forced", 32)):
        want, n = run(b, causal, window, splits=splits, force_splits=forced)
        got, m = run(b, causal, window, splits=splits, force_splits=forced, staged=True)
        assert n == m
        assert torch.equal(got, want), f"{splits} {forced}: staged K/V changed the output"


def test_rejects_unsupported_arguments():
    import torch

    t = _testing()
    b = Batch([100], [17], 32, 8, 128)  # 17 queries x group 4 = 68 rows > 64
    out = torch.empty_like(b.q_dev)
    with pytest.raises(ValueError, match="max_query_len"):
        t.cuda_decode_attention(b.q_dev, b.k_pool, b.v_pool, out, b.query_start, b.kv_len, b.table, True, 0, 17, 100)
    b96 = Batch([100], [1], 4, 4, 96)
    with pytest.raises(ValueError, match="head_dim"):
        t.cuda_decode_attention(b96.q_dev, b96.k_pool, b96.v_pool, torch.empty_like(b96.q_dev), b96.query_start,
                                b96.kv_len, b96.table, True, 0, 1, 100)
    with pytest.raises(ValueError, match="force_splits"):
        t.cuda_decode_attention(b.q_dev, b.k_pool, b.v_pool, out, b.query_start, b.kv_len, b.table, True, 0, 1, 100,
                                force_splits=33)


# Target-only on a GQA group of 4 and of 3; with a DFlash drafter on group 1, where the drafter's
# 8-token blocks and the 9-row verify fit in 16 rows per KV head and so run on the CUDA-core kernel.
@pytest.mark.parametrize("arch,nh,nkv,hd,spec", [("qwen3", 8, 2, 128, False), ("llama", 9, 3, 64, False),
                                                 ("llama", 4, 4, 64, True)])
def test_staged_session_is_bit_identical(arch, nh, nkv, hd, spec, tmp_path):
    """DFLASH_ATTENTION=staged: the same tokens and logits as the default routing, target-only and
    with a DFlash drafter, and the profiler sees the staged kernel run."""
    from tests.fixtures.tiny_models import write_tiny_model

    from .session_runs import assert_switch_keeps_bits, tiny_drafter

    target = write_tiny_model(tmp_path / "m", arch=arch, hidden_size=nh * hd, num_layers=2, num_heads=nh,
                              num_kv_heads=nkv, head_dim=hd, intermediate_size=512, dtype="bfloat16", seed=17)
    draft = tiny_drafter(tmp_path / "d", target) if spec else None
    # decode_attention_kernel<head_dim, rows, ROPE, STAGED>
    assert_switch_keeps_bits(target, draft, {"DFLASH_ATTENTION": "auto"}, {"DFLASH_ATTENTION": "staged"},
                             "false, true>")
