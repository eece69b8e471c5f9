# tests/test_triton_attention_cpu.py
#
# The paged-attention kernels of triton_kernels/paged_attention.py run on the CPU by Triton's
# interpreter (TRITON_INTERPRET=1, numpy underneath, fp32, small tiles; in a child pytest process,
# see the first test). Above all the batch-invariant chunked kernels that deterministic=True
# sessions run on the GPU: against a softmax reference for decode, verify and prefill shapes and
# every mask; split over the key chunks (the fold kernel) against the in-kernel fold, bit for bit;
# a query's row alone against its row of a verify block or prefill. Then the default path's
# prefill and decode (+ split reduce) kernels against the reference. This checks the kernels'
# logic (tiles, key ranges, chunks, folds, masks) on every CI run; the bf16 kernels themselves are
# tested on a GPU in tests/gpu/test_triton_attention.py. Two shims adapt triton 3.6.0's
# interpreter to these kernels: a copy of the file without the grid-dependency calls (inline PTX)
# is loaded, and a one-element scalar converts to an index (the interpreter keeps kernel scalars as
# one-element arrays, which `range` rejects). Skips when triton or torch is not installed.
from __future__ import annotations

import importlib.util
import math
import os
import pathlib

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
KERNELS = REPO / "triton_kernels" / "paged_attention.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
                                reason="needs triton and torch")

HD, BLOCK_M, BLOCK_N, KEY_CHUNK = 32, 16, 16, 64  # small tiles: several tiles and chunks at short contexts
FOLD_UNROLL = 2  # chunks the fold kernel loads at once (2: its loop runs several times here)
BS = 8  # KV block size


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_chunked_kernels_in_the_interpreter():
    """Runs this file's kernel tests in a child pytest with TRITON_INTERPRET=1 set before triton is
    imported (the interpreter needs it at import: triton's own jit helpers, tl.cdiv among them,
    are decorated then; other tests of this process import triton in compiled mode)."""
    if INTERPRETED:
        pytest.skip("this is the interpreted child")
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                       cwd=REPO, capture_output=True, text=True, timeout=1200, check=False)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]


interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreted child process")


@pytest.fixture(scope="module")
def pa(tmp_path_factory):
    """paged_attention.py in the interpreter (its kernels run on the CPU), from a copy without the
    grid-dependency calls (inline PTX, which the interpreter cannot run)."""
    import triton.runtime.interpreter as interp

    src = KERNELS.read_text()
    for call in ("gdc_wait()", "gdc_launch_dependents()"):
        assert src.count(call) >= 4, f"paged_attention.py: expected {call} in every kernel"
        src = src.replace(call, "pass")
    copy = tmp_path_factory.mktemp("interpreted") / "paged_attention_interpreted.py"
    copy.write_text(src)
    old_patch = interp._patch_lang_tensor

    def patch(tensor, scope):
        old_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patch
    try:
        spec = importlib.util.spec_from_file_location("paged_attention_interpreted", copy)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        interp._patch_lang_tensor = old_patch


class Batch:
    """A ragged batch over a shuffled paged cache (fp32), with its reference."""

    def __init__(self, kv_lens, q_lens, nh, nkv, seed):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.nh, self.nkv = nh, nkv
        self.kv_lens, self.q_lens = list(kv_lens), list(q_lens)
        blocks = [-(-n // BS) for n in kv_lens]
        nblocks = sum(blocks) + 2
        order = (1 + torch.randperm(nblocks - 1, generator=g)).tolist()
        self.max_blocks = max(blocks) + 1
        self.table = torch.zeros(len(kv_lens), self.max_blocks, dtype=torch.int32)
        self.k_pool = torch.randn(nblocks, BS, nkv, HD, generator=g)
        self.v_pool = torch.randn(nblocks, BS, nkv, HD, generator=g)
        used = 0
        for s, b in enumerate(blocks):
            self.table[s, :b] = torch.tensor(order[used:used + b], dtype=torch.int32)
            used += b
        self.q = torch.randn(sum(q_lens), nh, HD, generator=g)
        self.starts = np.concatenate([[0], np.cumsum(q_lens)]).tolist()

    def keys(self, s):
        n = self.kv_lens[s]
        j = np.arange(n)
        blk = self.table[s, j // BS].long()
        return self.k_pool[blk, j % BS], self.v_pool[blk, j % BS]

    def reference(self, causal, window, symmetric):
        import torch

        out = torch.zeros_like(self.q)
        group = self.nh // self.nkv
        for s, (n, nq) in enumerate(zip(self.kv_lens, self.q_lens)):
            if nq == 0:
                continue
            k, v = self.keys(s)
            q = self.q[self.starts[s]:self.starts[s + 1]].double()
            k = k.double().repeat_interleave(group, 1)
            v = v.double().repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD)
            pos = torch.arange(n - nq, n)[:, None]
            j = torch.arange(n)[None, :]
            if symmetric:
                vis = (j > pos - window) & (j < pos + window)
            else:
                vis = (j <= pos) if causal or window > 0 else torch.ones(nq, n, dtype=torch.bool)
                if window > 0:
                    vis &= j > pos - window
            p = scores.masked_fill(~vis, float("-inf")).softmax(-1)
            out[self.starts[s]:self.starts[s + 1]] = torch.einsum("hqk,khd->qhd", p, v).float()
        return out

    def run(self, pa, causal, window, symmetric, split, rows=None):
        """The chunked kernel over the batch (rows: one sequence's query slice [first, last) with
        kv_len cut at the last one's position, as a launch of its own)."""
        import torch

        q, qs, kl, table = self.q, self.starts, self.kv_lens, self.table
        if rows is not None:
            s, first, last = rows
            q = self.q[self.starts[s] + first:self.starts[s] + last]
            qs, kl, table = [0, last - first], [self.kv_lens[s] - self.q_lens[s] + last], self.table[s:s + 1]
        t, num_seqs = q.shape[0], len(kl)
        group = self.nh // self.nkv
        q_per_tile = BLOCK_M // group
        # split: two chunks more than the keys need, as a CUDA graph's bound on kv_len gives
        chunks = max(1, -(-max(kl) // KEY_CHUNK)) + (2 if split else 0)
        grid = (t // q_per_tile + num_seqs, self.nkv, chunks if split else 1)
        out = torch.full_like(q, float("nan"))
        ws = torch.zeros(chunks * t * self.nh * (HD + 2))
        args = (q, self.k_pool, self.v_pool, out, ws, torch.tensor(qs, dtype=torch.int32),
                torch.tensor(kl, dtype=torch.int32), table.contiguous(), 1.0 / math.sqrt(HD), t, num_seqs, self.nh,
                self.nkv, BS, self.max_blocks, int(causal or window > 0) if not symmetric else 0, window,
                int(symmetric), int(split))
        pa.paged_attention_chunked_kernel[grid](*args, HEAD_DIM=HD, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                                KEY_CHUNK=KEY_CHUNK)
        if split:
            pa.paged_attention_chunk_fold_kernel[(t, self.nh)](ws, out, args[5], args[6], t, num_seqs, self.nh, chunks,
                                                               HEAD_DIM=HD, KEY_CHUNK=KEY_CHUNK, UNROLL=FOLD_UNROLL)
        return out


    def _metadata(self):
        """query_start, kv_len, block table and scale of the whole batch."""
        import torch

        return (torch.tensor(self.starts, dtype=torch.int32), torch.tensor(self.kv_lens, dtype=torch.int32),
                self.table.contiguous(), 1.0 / math.sqrt(HD))

    def run_prefill(self, pa, causal, window, symmetric):
        """The prefill kernel (default prefills) over the batch."""
        import torch

        qs, kl, table, scale = self._metadata()
        t, num_seqs, group = self.q.shape[0], len(self.kv_lens), self.nh // self.nkv
        out = torch.full_like(self.q, float("nan"))
        pa.paged_attention_prefill_kernel[(t // (BLOCK_M // group) + num_seqs, self.nkv)](
            self.q, self.k_pool, self.v_pool, out, qs, kl, table, scale, num_seqs, self.nh, self.nkv, BS,
            self.max_blocks, int(causal or window > 0) if not symmetric else 0, window, int(symmetric),
            HEAD_DIM=HD, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        return out

    def run_decode(self, pa, causal, window, symmetric, splits):
        """The decode kernel (few queries per sequence), split over `splits` key ranges and reduced."""
        import torch

        qs, kl, table, scale = self._metadata()
        t, num_seqs = self.q.shape[0], len(self.kv_lens)
        out = torch.full_like(self.q, float("nan"))
        ws = torch.zeros(splits * t * self.nh * (HD + 2))
        pa.paged_attention_decode_kernel[(num_seqs, self.nkv, splits)](
            self.q, self.k_pool, self.v_pool, out, ws, qs, kl, table, scale, t, self.nh, self.nkv, BS, self.max_blocks,
            int(causal or window > 0) if not symmetric else 0, window, int(symmetric),
            HEAD_DIM=HD, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        if splits > 1:
            pa.paged_attention_split_reduce_kernel[(t, self.nh)](ws, out, t, self.nh, splits, HEAD_DIM=HD,
                                                                 MAX_SPLITS=4)
        return out


MODES = {"causal": (True, 0, False), "noncausal": (False, 0, False), "window": (True, 24, False),
         "symmetric": (False, 24, True)}


@interpreted_only
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("nh,nkv", [(4, 2), (3, 1)])
def test_chunked_kernel_matches_reference_and_split_equals_fold(pa, nh, nkv, mode):
    import torch

    causal, window, symmetric = MODES[mode]
    # decode (1 query), verify (5) and prefill rows (48 queries, 6 tiles across the 64-key chunk
    # edge) over 1..3 key chunks of 64
    b = Batch([1, 70, 100, 150, 64], [1, 5, 48, 1, 9], nh, nkv, seed=nh + len(mode))
    ref = b.reference(causal, window, symmetric)
    inline = b.run(pa, causal, window, symmetric, split=False)
    assert not torch.isnan(inline).any()
    torch.testing.assert_close(inline, ref, atol=1e-4, rtol=1e-4)
    split = b.run(pa, causal, window, symmetric, split=True)
    assert torch.equal(split, inline), f"{mode}: split over the chunks differs from the in-kernel fold"


@interpreted_only
@pytest.mark.parametrize("split_alone", [False, True])
@pytest.mark.parametrize("mode", ["causal", "window"])
def test_a_row_alone_equals_its_row_in_a_block(pa, mode, split_alone):
    """Rows of a 40-query block (tiles of 8 queries starting in other key tiles and chunks) against
    queries alone at their own positions: kv_len 150 puts positions 110..149 across the 128-key
    chunk edge; the queries taken are each tile's first and last and those around the edge."""
    import torch

    causal, window, symmetric = MODES[mode]
    b = Batch([150], [40], 4, 2, seed=3)
    block = b.run(pa, causal, window, symmetric, split=False)
    for i in (0, 1, 7, 8, 15, 16, 17, 18, 19, 31, 39):
        alone = b.run(pa, causal, window, symmetric, split=split_alone, rows=(0, i, i + 1))
        assert torch.equal(alone[0], block[i]), f"{mode}: query {i} alone differs from its row of the block"


@interpreted_only
@pytest.mark.parametrize("mode", list(MODES))
def test_prefill_and_decode_kernels_match_reference(pa, mode):
    """The default path's kernels in the same harness: the prefill kernel over decode, verify and
    prefill rows, the decode kernel (a sequence's queries in one tile) unsplit and split in 3 with
    the reduce kernel."""
    import torch

    causal, window, symmetric = MODES[mode]
    b = Batch([1, 70, 100, 150, 64], [1, 5, 48, 1, 7], 4, 2, seed=len(mode))
    ref = b.reference(causal, window, symmetric)
    torch.testing.assert_close(b.run_prefill(pa, causal, window, symmetric), ref, atol=1e-4, rtol=1e-4)
    d = Batch([1, 70, 100, 150, 64], [1, 5, 8, 1, 7], 4, 2, seed=len(mode) + 1)  # <= 8 queries: 16 rows
    ref = d.reference(causal, window, symmetric)
    for splits in (1, 3):
        torch.testing.assert_close(d.run_decode(pa, causal, window, symmetric, splits), ref, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, splits=splits: f"decode, {splits} splits: {m}")
