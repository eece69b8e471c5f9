# tests/gpu/test_triton_attention.py
#
# The AOT Triton paged attention (triton_kernels/paged_attention.py through
# dflash._core.testing.triton_paged_attention) against a torch reference: fp32 math on the same
# bf16 inputs. Covers decode (1 query), verify / draft blocks (16 queries), full and chunked
# prefill; causal, non-causal (the drafter's block), sliding window and symmetric window
# (|q_pos - j| < window: DFlash2's non-causal sliding layers); GQA 32/8, 4/4 and 9/3 (SmolLM2);
# head_dim 64 and 128; batches of 1, 3 and 17 ragged sequences; scattered block tables; the
# split-KV path on long contexts. Unused pool slots and unused block-table entries
# point at NaN, so a read outside a sequence's keys shows up as NaN in the output.
#
# Tolerance: |out - ref| <= 2e-2 + 2e-2 |ref| element-wise, and a relative RMS error below 1e-2
# (bf16 output rounding alone is ~2e-3 relative; the RMS check catches masking mistakes on long
# contexts, whose outputs are small).
#
# Skips cleanly (module-level skipif, nothing imported that fails) without torch, a CUDA device,
# a CUDA build of dflash, or a Hopper (sm_90) GPU.
from __future__ import annotations

import math

import pytest


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import dflash
    except Exception as exc:  # the extension may not be built on this machine
        return f"dflash is not importable ({type(exc).__name__}: {exc})"
    if not dflash.built_with_cuda():
        return "dflash was built without CUDA"
    if torch.cuda.get_device_capability() != (9, 0):
        return "the AOT Triton kernels are compiled for sm_90a (Hopper)"
    return None


_SKIP_REASON = _skip_reason()
pytestmark = pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")

ATOL = 2e-2
RTOL = 2e-2
MAX_REL_RMS = 1e-2

# (num_heads, num_kv_heads, head_dim)
HEADS = [(32, 8, 128), (32, 8, 64), (4, 4, 64), (4, 4, 128), (9, 3, 64)]
BATCH_KV = {
    1: [1000],
    3: [1, 129, 1000],
    17: [1, 7, 129, 1000, 16, 17, 64, 65, 200, 333, 512, 513, 999, 2, 31, 48, 700],
}
MODES = {"causal": (True, 0), "noncausal": (False, 0), "window": (True, 64)}


def _testing():
    from dflash._core import testing

    return testing


def num_queries(kind: str, kv_len: int) -> int:
    return {"decode": 1, "verify": min(16, kv_len), "chunked": min(100, kv_len),
            "prefill": kv_len}[kind]


class Batch:
    """A ragged batch over a scattered paged cache; keeps each sequence's K/V for the reference."""

    def __init__(self, kv_lens, q_lens, nh, nkv, hd, block_size=16, seed=0):
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.nh, self.nkv, self.hd, self.block_size = nh, nkv, hd, block_size
        self.kv_lens, self.q_lens = list(kv_lens), list(q_lens)
        blocks = [-(-n // block_size) for n in kv_lens]
        num_blocks = sum(blocks) + 4  # block 0 and the spares stay NaN
        order = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
        self.max_blocks = max(blocks) + 2  # trailing columns point at the NaN block 0
        table = torch.zeros(len(kv_lens), self.max_blocks, dtype=torch.int32)
        nan = float("nan")
        k_pool = torch.full((num_blocks * block_size, nkv, hd), nan, dtype=torch.bfloat16)
        v_pool = torch.full_like(k_pool, nan)
        self.ks, self.vs = [], []
        used = 0
        for s, n in enumerate(kv_lens):
            table[s, :blocks[s]] = torch.tensor(order[used:used + blocks[s]], dtype=torch.int32)
            used += blocks[s]
            j = torch.arange(n)
            slots = table[s, j // block_size].long() * block_size + j % block_size
            k = torch.randn(n, nkv, hd, generator=gen).bfloat16()
            v = torch.randn(n, nkv, hd, generator=gen).bfloat16()
            k_pool[slots], v_pool[slots] = k, v
            self.ks.append(k)
            self.vs.append(v)
        self.q = torch.randn(sum(q_lens), nh, hd, generator=gen).bfloat16()
        starts = [0]
        for nq in q_lens:
            starts.append(starts[-1] + nq)
        self.starts = starts
        dev = "cuda"
        self.k_pool = k_pool.view(num_blocks, block_size, nkv, hd).to(dev)
        self.v_pool = v_pool.view(num_blocks, block_size, nkv, hd).to(dev)
        self.table = table.to(dev)
        self.q_dev = self.q.to(dev)
        self.query_start = torch.tensor(starts, dtype=torch.int32, device=dev)
        self.kv_len = torch.tensor(kv_lens, dtype=torch.int32, device=dev)

    def run(self, causal, window, *, workspace=None, force_variant=0, force_splits=0,
            max_query_len=None, symmetric=False, max_kv_len=None):
        import torch

        out = torch.full_like(self.q_dev, float("nan"))
        plan = _testing().triton_paged_attention(
            self.q_dev, self.k_pool, self.v_pool, out, self.query_start, self.kv_len, self.table,
            causal, window,
            max(self.q_lens) if max_query_len is None else max_query_len,
            max(self.kv_lens) if max_kv_len is None else max_kv_len,
            workspace=workspace, force_variant=force_variant, force_splits=force_splits,
            stream=torch.cuda.current_stream().cuda_stream, symmetric_window=symmetric)
        return out.float().cpu(), plan

    def reference(self, causal, window, symmetric=False):
        import torch

        group = self.nh // self.nkv
        out = torch.zeros(self.q.shape, dtype=torch.float32)
        for s, (n, nq) in enumerate(zip(self.kv_lens, self.q_lens)):
            if nq == 0:
                continue
            q = self.q[self.starts[s]:self.starts[s + 1]].float().cuda()
            k = self.ks[s].float().cuda().repeat_interleave(group, dim=1)
            v = self.vs[s].float().cuda().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.hd)
            q_pos = torch.arange(n - nq, n, device="cuda")[:, None]
            j = torch.arange(n, device="cuda")[None, :]
            visible = torch.ones(nq, n, dtype=torch.bool, device="cuda")
            if symmetric and window > 0:  # replaces causality
                visible &= (j > q_pos - window) & (j < q_pos + window)
            else:
                if causal or window > 0:
                    visible &= j <= q_pos
                if window > 0:
                    visible &= j > q_pos - window
            scores = scores.masked_fill(~visible, float("-inf"))
            out[self.starts[s]:self.starts[s + 1]] = torch.einsum(
                "hqk,khd->qhd", scores.softmax(-1), v).cpu()
        return out

    def workspace(self, splits):
        import torch

        nbytes = _testing().triton_paged_attention_workspace_bytes(
            self.q.shape[0], self.nh, self.hd, splits)
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def _unsplit_large_tile(rows, ctas):
    """The split rule's exception: rows on the 64-row tile and an unsplit grid of >= half the SMs."""
    import torch

    return rows > 16 and 2 * ctas >= torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.parametrize("nh,nkv,hd", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("context", [512, 4096])
def test_split_rule_at_batch_16(nh, nkv, hd, context):
    # The verify step's 16 queries per sequence (64 / 48 rows per KV head, the 64-row tile) at
    # batch 16: unsplit where the grid covers half the SMs (128 CTAs of Qwen3-8B's 8 KV heads),
    # split where it does not (48 CTAs of SmolLM2's 3); one query per sequence (the 16-row tile)
    # keeps split-KV at a long context. Both match the reference.
    kv_lens = [context - 7 * i for i in range(16)]
    max_splits = _testing().triton_paged_attention_max_splits()
    for nq in (16, 1):
        b = Batch(kv_lens, [nq] * 16, nh, nkv, hd, seed=context + nq)
        ref = b.reference(True, 0)
        out, (variant, splits, _) = b.run(True, 0, workspace=b.workspace(max_splits))
        assert variant == "decode"
        if _unsplit_large_tile(nq * (nh // nkv), 16 * nkv):
            assert splits == 1, f"{nq} queries x {nh // nkv} heads at 16 x {nkv} CTAs should not split"
        elif nq == 16 or context == 4096:
            assert splits > 1, f"{nq} queries at 16 x {nkv} CTAs, context {context}, should split"
        assert_matches(out, ref, f"batch 16, {nq} queries, context {context} ({splits} splits)")


def assert_matches(out, ref, what):
    import torch

    assert not torch.isnan(out).any(), f"{what}: NaN in the output (unwritten row or bad read)"
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")
    rel = ((out - ref).norm() / ref.norm().clamp_min(1e-6)).item()
    print(f"attention {what}: max abs err {(out - ref).abs().max().item():.3g}, relative RMS err {rel:.3g}")
    assert rel < MAX_REL_RMS, f"{what}: relative RMS error {rel:.3g}"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["decode", "verify", "chunked", "prefill"])
@pytest.mark.parametrize("batch", list(BATCH_KV))
@pytest.mark.parametrize("nh,nkv,hd", HEADS)
def test_matches_reference(nh, nkv, hd, batch, kind, mode):
    causal, window = MODES[mode]
    kv_lens = BATCH_KV[batch]
    q_lens = [num_queries(kind, n) for n in kv_lens]
    b = Batch(kv_lens, q_lens, nh, nkv, hd, seed=batch * 1000 + nh + hd)
    ref = b.reference(causal, window)

    out, (variant, splits, block_m) = b.run(causal, window)
    decode_fits = max(q_lens) * (nh // nkv) <= 64
    assert variant == ("decode" if decode_fits else "prefill")
    assert splits == 1  # no workspace given
    assert_matches(out, ref, f"auto ({variant}, block_m {block_m})")

    if decode_fits:  # the other variants on the same batch
        out, plan = b.run(causal, window, force_variant=1)
        assert plan[0] == "prefill"
        assert_matches(out, ref, "forced prefill")
        out, plan = b.run(causal, window, workspace=b.workspace(3), force_variant=2,
                          force_splits=3)
        assert plan[:2] == ("decode", 3)
        assert_matches(out, ref, "decode split 3")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["decode", "verify"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("nh,nkv,hd", [(32, 8, 128), (9, 3, 64)])
def test_long_context_split_kv(nh, nkv, hd, batch, kind, mode):
    causal, window = MODES[mode]
    kv_lens = [8192, 5000][:batch]
    q_lens = [num_queries(kind, n) for n in kv_lens]
    b = Batch(kv_lens, q_lens, nh, nkv, hd, seed=7 + batch)
    ref = b.reference(causal, window)
    max_splits = _testing().triton_paged_attention_max_splits()
    out, (variant, splits, _) = b.run(causal, window, workspace=b.workspace(max_splits))
    assert variant == "decode"
    if mode != "window":  # a 64-key window leaves too little to split
        assert splits > 1, "a long context at batch <= 2 should use split-KV"
    assert_matches(out, ref, f"split-KV ({splits} splits)")
    out, (_, splits, _) = b.run(causal, window)  # no workspace: no split
    assert splits == 1
    assert_matches(out, ref, "no split")


CHUNKED = 3  # force_variant of the batch-invariant kernel (key chunks at fixed positions)
KEY_CHUNK = 256  # its chunk (triton_kernels/manifest.py)


def chunk_workspace(num_tokens, nh, hd, kv_len):
    """Workspace for a chunked launch split over every key chunk of kv_len."""
    import torch

    chunks = max(1, -(-kv_len // KEY_CHUNK))
    return torch.empty(num_tokens * nh * (hd + 2) * 4 * chunks, dtype=torch.uint8, device="cuda")


# (variant, force_splits, workspace?): the prefill kernel; the chunked kernel folding in the kernel
# and split over its chunks (the fold kernel).
INVARIANT_LAUNCHES = {"prefill": (1, 0, False), "chunked_inline": (CHUNKED, 1, False),
                      "chunked_split": (CHUNKED, 2, True)}


@pytest.mark.parametrize("launch", list(INVARIANT_LAUNCHES))
@pytest.mark.parametrize("nh,nkv,hd", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("nq,kv_len", [(8, 330), (80, 330), (16, 600), (90, 1100)])
def test_rows_do_not_depend_on_the_other_queries(nh, nkv, hd, nq, kv_len, launch):
    """The batch-invariant launches: a query's output bits must be the same whether it is the only
    query of its sequence or one row of a verify block / prefill whose first query sits in an
    earlier key tile (that changes which loop, masked or not, handles the row's keys) or, for the
    chunked kernel, an earlier key chunk (a row folds chunks its tile has and it does not see),
    and whether or not the launch is split over its chunks (the decode launches of one query split
    when there are several chunks, row blocks of 64 do not: both are compared with the forced
    form). Positions 250..329 cross the 256- and 320-key tile edges, 584..599 and 1010..1099 the
    512- and 1024-key chunk edges."""
    import torch

    variant, force_splits, split = INVARIANT_LAUNCHES[launch]
    b = Batch([kv_len], [nq], nh, nkv, hd, seed=nq + kv_len)
    ws = chunk_workspace(nq, nh, hd, kv_len) if split else None
    full, (name, splits, _) = b.run(True, 0, force_variant=variant, force_splits=force_splits, workspace=ws)
    assert name == ("prefill" if variant == 1 else "chunked")
    assert splits == (max(1, -(-kv_len // KEY_CHUNK)) if split else 1)
    assert_matches(full, b.reference(True, 0), launch)
    testing = _testing()
    for i in range(nq):
        q = b.q_dev[i:i + 1].contiguous()
        n = kv_len - nq + i + 1  # this query alone: its sequence ends at its own position
        # Alone: the launch the deterministic session makes (the plan's choice), and the other form.
        forms = [(variant, force_splits, ws)] + ([(CHUNKED, 0, chunk_workspace(1, nh, hd, n))] if variant == CHUNKED
                                                 else [])
        for v, fs, w in forms:
            out = torch.full_like(q, float("nan"))
            testing.triton_paged_attention(
                q, b.k_pool, b.v_pool, out, torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                torch.tensor([n], dtype=torch.int32, device="cuda"), b.table, True, 0, 1, n,
                workspace=w if fs != 1 else None, force_variant=v, force_splits=fs,
                stream=torch.cuda.current_stream().cuda_stream)
            alone = out.float().cpu()
            assert torch.equal(alone[0], full[i]), (
                f"{launch}: query at position {n - 1} alone (force_splits {fs}) differs from row {i} of {nq} "
                f"(max abs {(alone[0] - full[i]).abs().max().item():.3g})")


CHUNK_MODES = {**{m: (*MODES[m], False) for m in MODES}, "symmetric": (False, 64, True)}


@pytest.mark.parametrize("mode", list(CHUNK_MODES))
@pytest.mark.parametrize("kind", ["decode", "verify", "chunked", "prefill"])
@pytest.mark.parametrize("batch", list(BATCH_KV))
@pytest.mark.parametrize("nh,nkv,hd", HEADS)
def test_batch_invariant_kernel_matches_reference(nh, nkv, hd, batch, kind, mode):
    """The chunked kernel against the reference, folding in the kernel and split over its chunks
    (the same bits), and the plan's own choice; then each sequence of the batch alone has the bits
    of its rows in the batch (other sequences, other lengths)."""
    import torch

    causal, window, symmetric = CHUNK_MODES[mode]
    kv_lens = BATCH_KV[batch]
    q_lens = [num_queries(kind, n) for n in kv_lens]
    b = Batch(kv_lens, q_lens, nh, nkv, hd, seed=batch * 1000 + nh + hd + 1)
    ref = b.reference(causal, window, symmetric=symmetric)
    chunks = max(1, -(-max(kv_lens) // KEY_CHUNK))
    inline, plan = b.run(causal, window, symmetric=symmetric, force_variant=CHUNKED, force_splits=1)
    assert plan[:2] == ("chunked", 1)
    assert_matches(inline, ref, f"chunked {mode}, folded in the kernel")
    ws = chunk_workspace(sum(q_lens), nh, hd, max(kv_lens))
    split, plan = b.run(causal, window, symmetric=symmetric, workspace=ws, force_variant=CHUNKED, force_splits=2)
    assert plan[:2] == ("chunked", chunks)
    assert torch.equal(split, inline), f"chunked {mode}: split over {chunks} chunks differs from the in-kernel fold"
    chosen, plan = b.run(causal, window, symmetric=symmetric, workspace=ws, force_variant=CHUNKED)
    assert plan[0] == "chunked" and torch.equal(chosen, inline), f"chunked {mode}: the plan's choice ({plan[1]})"
    # A CUDA graph's bound on kv_len: more chunks than any sequence has keys for.
    bound = max(kv_lens) + 3 * KEY_CHUNK
    split, plan = b.run(causal, window, symmetric=symmetric, workspace=chunk_workspace(sum(q_lens), nh, hd, bound),
                        force_variant=CHUNKED, force_splits=2, max_kv_len=bound)
    assert plan[:2] == ("chunked", -(-bound // KEY_CHUNK))
    assert torch.equal(split, inline), f"chunked {mode}: split over a bound's {plan[1]} chunks differs"
    testing = _testing()
    for s, (n, nq) in enumerate(zip(kv_lens, q_lens)):
        if nq == 0 or len(kv_lens) == 1:
            continue
        rows = slice(b.starts[s], b.starts[s + 1])
        q = b.q_dev[rows].contiguous()
        out = torch.full_like(q, float("nan"))
        testing.triton_paged_attention(
            q, b.k_pool, b.v_pool, out, torch.tensor([0, nq], dtype=torch.int32, device="cuda"),
            torch.tensor([n], dtype=torch.int32, device="cuda"), b.table[s:s + 1].contiguous(), causal, window,
            nq, n, force_variant=CHUNKED, force_splits=1, symmetric_window=symmetric,
            stream=torch.cuda.current_stream().cuda_stream)
        assert torch.equal(out.float().cpu(), inline[rows]), f"chunked {mode}: sequence {s} alone differs"


@pytest.mark.parametrize("block_size", [8, 32, 64])
def test_other_block_sizes(block_size):
    kv_lens = [1, 40, 300, 129]
    for kind in ("decode", "verify", "prefill"):
        q_lens = [num_queries(kind, n) for n in kv_lens]
        b = Batch(kv_lens, q_lens, 32, 8, 128, block_size=block_size, seed=block_size)
        for mode, (causal, window) in MODES.items():
            out, _ = b.run(causal, window)
            assert_matches(out, b.reference(causal, window), f"{kind} {mode} bs={block_size}")


def test_sequences_without_queries():
    # Sequences that only hold context (0 queries) sit between ones that query.
    kv_lens = [50, 300, 7, 1000, 64]
    for q_lens in ([1, 0, 1, 0, 1], [16, 0, 7, 0, 0], [50, 0, 0, 200, 64]):
        b = Batch(kv_lens, q_lens, 32, 8, 64, seed=sum(q_lens))
        for causal, window in MODES.values():
            for force_variant in (0, 1):
                out, _ = b.run(causal, window, force_variant=force_variant)
                assert_matches(out, b.reference(causal, window), f"q_lens {q_lens}")


# Symmetric windows as the DFlash2 drafter uses them: a block of 8 or 16 queries at the end of
# each sequence (so keys above a query's position exist), windows below, at and above the block
# size; one sequence without queries.
SYM_KV = [16, 1, 8, 17, 40, 64, 65, 129, 1000, 2100, 300, 4999]
SYM_Q = {8: [8, 1, 8, 8, 8, 8, 8, 8, 8, 8, 0, 8], 16: [16, 1, 8, 16, 16, 16, 16, 16, 16, 16, 0, 16]}


@pytest.mark.parametrize("window", [1, 4, 13, 16, 2048])
@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("nh,nkv,hd", [(32, 8, 128), (32, 8, 64), (9, 3, 64)])
def test_symmetric_window_drafter_block(nh, nkv, hd, block, window):
    import torch

    b = Batch(SYM_KV, SYM_Q[block], nh, nkv, hd, seed=window * 7 + block + hd)
    ref = b.reference(False, window, symmetric=True)
    out, (variant, splits, _) = b.run(False, window, symmetric=True)
    assert (variant, splits) == ("decode", 1)
    assert_matches(out, ref, f"symmetric w{window} auto ({variant})")
    out, plan = b.run(False, window, symmetric=True, force_variant=1)
    assert plan[0] == "prefill"
    assert_matches(out, ref, f"symmetric w{window} forced prefill")
    out, plan = b.run(False, window, symmetric=True, workspace=b.workspace(3), force_variant=2,
                      force_splits=3)
    assert plan[:2] == ("decode", 3)
    assert_matches(out, ref, f"symmetric w{window} decode split 3")
    max_splits = _testing().triton_paged_attention_max_splits()
    out, (_, splits, _) = b.run(False, window, symmetric=True, workspace=b.workspace(max_splits))
    if _unsplit_large_tile(max(SYM_Q[block]) * (nh // nkv), len(SYM_KV) * nkv):
        assert splits == 1, "64-row tiles over half the SMs or more are not split"
    elif window >= 2048:
        assert splits > 1, "a 2048-key window over 5k-key contexts should use split-KV"
    assert_matches(out, ref, f"symmetric w{window} split-KV ({splits} splits)")
    # causal=True with symmetric_window: the symmetric window takes precedence (the CPU rule).
    out, _ = b.run(True, window, symmetric=True)
    assert_matches(out, ref, f"symmetric w{window} with causal set")

    causal_ref = b.reference(True, window)
    if window == 1:  # each query sees only itself either way
        assert torch.equal(ref, causal_ref)
    else:  # the block's queries also see the keys above them
        assert not torch.allclose(ref, causal_ref, atol=0.1)
        out, _ = b.run(False, window)  # the same launch without symmetric_window: causal window
        assert_matches(out, causal_ref, f"causal w{window}")
        assert not torch.allclose(out, ref, atol=0.1)


@pytest.mark.parametrize("kind", ["chunked", "prefill"])
@pytest.mark.parametrize("nh,nkv,hd", [(32, 8, 128), (9, 3, 64)])
def test_symmetric_window_many_queries(nh, nkv, hd, kind):
    """Queries spread over the sequence: the window's upper edge lies far inside the keys."""
    kv_lens = [1, 129, 1000, 300]
    q_lens = [num_queries(kind, n) for n in kv_lens]
    b = Batch(kv_lens, q_lens, nh, nkv, hd, seed=len(kind) + hd)
    for window in (5, 64, 300):
        ref = b.reference(False, window, symmetric=True)
        out, (variant, _, _) = b.run(False, window, symmetric=True)
        assert variant == "prefill"
        assert_matches(out, ref, f"{kind} symmetric w{window}")
    # symmetric_window without a window: plain non-causal attention
    out, _ = b.run(False, 0, symmetric=True)
    assert_matches(out, b.reference(False, 0), f"{kind} symmetric_window, window 0")


def test_rejects_unsupported_arguments():
    import torch

    testing = _testing()
    b = Batch([40, 20], [16, 1], 32, 8, 128)
    out = torch.empty_like(b.q_dev)
    args = (b.q_dev, b.k_pool, b.v_pool, out, b.query_start, b.kv_len, b.table, True, 0, 16, 40)
    with pytest.raises(ValueError, match="decode variant"):
        testing.triton_paged_attention(*args[:9], 17, 40, force_variant=2)  # 17 * 4 rows > 64
    with pytest.raises(ValueError, match="workspace"):
        testing.triton_paged_attention(*args, force_variant=2, force_splits=2)
    with pytest.raises(ValueError, match="split-KV"):
        testing.triton_paged_attention(*args, workspace=b.workspace(2), force_variant=1,
                                       force_splits=2)
    with pytest.raises(ValueError, match="window"):
        testing.triton_paged_attention(*args[:8], -1, 16, 40)
    with pytest.raises(ValueError, match="bfloat16"):
        testing.triton_paged_attention(b.q_dev.float(), *args[1:])
    q96 = torch.zeros(b.q_dev.shape[0], 32, 96, dtype=torch.bfloat16, device="cuda")
    pool96 = torch.zeros(*b.k_pool.shape[:3], 96, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="head_dim"):
        testing.triton_paged_attention(q96, pool96, pool96, torch.empty_like(q96), *args[4:])
    pool5 = torch.zeros(*b.k_pool.shape[:2], 5, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        testing.triton_paged_attention(b.q_dev, pool5, pool5, *args[3:])


def test_empty_batch_is_a_no_op():
    import torch

    testing = _testing()
    q = torch.empty(0, 8, 64, dtype=torch.bfloat16, device="cuda")
    pool = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    i32 = dict(dtype=torch.int32, device="cuda")
    plan = testing.triton_paged_attention(
        q, pool, pool, torch.empty_like(q), torch.zeros(1, **i32), torch.zeros(0, **i32),
        torch.zeros(0, 1, **i32), True, 0, 0, 0)
    assert plan[0] == "none"
