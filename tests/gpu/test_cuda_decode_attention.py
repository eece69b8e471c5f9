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
# the causal mask, and the arguments it refuses.
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
KINDS = [("decode", "auto"), ("decode", "tensor_cores"), ("multi", "auto"), ("multi", "tensor_cores"),
         ("verify", "auto"), ("verify8", "auto")]


def run(b, causal, window, *, splits="none", force_splits=0, counters=None, symmetric=False, tensor_cores=False):
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
                                       tensor_cores=tensor_cores)
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
    tc = kernel == "tensor_cores"
    b = Batch(kv_lens, [rows_fit(nh, nkv, kind, n) for n in kv_lens], nh, nkv, hd, seed=batch * 1000 + nh + hd)
    ref = b.reference(causal, window)
    out, splits = run(b, causal, window, tensor_cores=tc)
    assert splits == 1
    assert_matches(out, ref, "one split")
    out, splits = run(b, causal, window, splits="auto", tensor_cores=tc)
    assert splits >= 1
    assert_matches(out, ref, f"auto ({splits} splits)")
    for forced in (3, 32):
        out, splits = run(b, causal, window, splits="forced", force_splits=forced, tensor_cores=tc)
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
    tc = kernel == "tensor_cores"
    out, splits = run(b, causal, window, splits="auto", tensor_cores=tc)
    assert splits > 1 or window > 0  # a 64-key window needs one split
    assert_matches(out, ref, f"long context, {splits} splits")
    out, splits = run(b, causal, window, tensor_cores=tc)  # one CTA over every key: many passes
    assert splits == 1
    assert_matches(out, ref, "long context, one split")


@pytest.mark.parametrize("window", [1, 3, 16, 2048])
@pytest.mark.parametrize("kind,kernel", [("multi", "auto"), ("multi", "tensor_cores"), ("verify", "auto")])
@pytest.mark.parametrize("nh,nkv,hd", HEADS)
def test_symmetric_window(nh, nkv, hd, kind, kernel, window):
    """A block of queries at the end of each sequence sees the keys |q_pos - j| < window, those
    above its position included."""
    import torch

    kv_lens = [1, 4, 5, 17, 64, 65, 129, 1000, 4999]
    tc = kernel == "tensor_cores"
    b = Batch(kv_lens, [rows_fit(nh, nkv, kind, n) for n in kv_lens], nh, nkv, hd, seed=window + nh + hd)
    ref = b.reference(False, window, symmetric=True)
    out, splits = run(b, False, window, symmetric=True, tensor_cores=tc)
    assert splits == 1
    assert_matches(out, ref, f"symmetric w{window}, one split")
    out, splits = run(b, False, window, splits="auto", symmetric=True, tensor_cores=tc)
    assert_matches(out, ref, f"symmetric w{window}, auto ({splits} splits)")
    for forced in (3, 32):
        out, splits = run(b, False, window, splits="forced", force_splits=forced, symmetric=True, tensor_cores=tc)
        assert splits == forced
        assert_matches(out, ref, f"symmetric w{window}, {forced} splits")
    out, _ = run(b, True, window, symmetric=True, tensor_cores=tc)  # takes precedence over causal
    assert_matches(out, ref, f"symmetric w{window} with causal set")
    if window > 1 and max(b.q_lens) > 1:
        assert not torch.allclose(ref, b.reference(True, window), atol=0.1)


@pytest.mark.parametrize("q_len,tc", [(1, False), (1, True), (16, False)])
def test_deterministic_and_graph_replay(q_len, tc):
    """Bit-identical across runs, and inside a CUDA graph replayed twice (the counters reset)."""
    import torch

    t = _testing()
    b = Batch([1000, 300], [q_len, q_len], 32, 8, 128, seed=3)
    ref = b.reference(True, 0)
    first, splits = run(b, True, 0, splits="auto", tensor_cores=tc)
    assert splits > 1
    again, _ = run(b, True, 0, splits="auto", tensor_cores=tc)
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
                                tensor_cores=tc)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.float().cpu(), first)
        assert int(counters.abs().sum()) == 0
    assert_matches(first, ref, "graph replay")


@pytest.mark.parametrize("q_len,tc", [(1, False), (1, True), (16, False)])
def test_short_sequences_and_empty_ones(q_len, tc):
    """kv_len 1 .. 70 around the 64-key pass, and a sequence without queries (left untouched)."""
    kv_lens = [1, 2, 63, 64, 65, 70, 5]
    b = Batch(kv_lens, [min(q_len, n) for n in kv_lens[:-1]] + [0], 32, 8, 128, seed=11)
    ref = b.reference(True, 0)
    out, _ = run(b, True, 0, splits="forced", force_splits=4, tensor_cores=tc)
    assert_matches(out, ref, "short sequences")


@pytest.mark.parametrize("q_len,tc", [(4, False), (4, True), (16, False)])
def test_non_finite_v_behind_the_causal_mask(q_len, tc):
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
        out, _ = run(b, True, 0, splits=splits, tensor_cores=tc)
        for s in range(len(b.kv_lens)):
            rows = slice(b.starts[s], b.starts[s + 1] - 1)  # all but the last query
            assert torch.isfinite(out[rows]).all(), f"sequence {s}: a masked NaN key leaked ({splits})"
            assert_matches(out[rows], ref[rows], f"sequence {s}, masked NaN key ({splits})")
            assert not torch.isfinite(out[b.starts[s + 1] - 1]).any(), "the query that sees the NaN key"


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
