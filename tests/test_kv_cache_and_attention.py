# tests/test_kv_cache_and_attention.py
#
# The paged KV cache bookkeeping (block allocator, block tables, O(1) truncation) and the CPU
# backend's paged attention against a short torch reference: causal with a query offset
# (prefill, decode, multi-token verify) and non-causal (the drafter's block), GQA, scattered
# blocks, several sequences in one ragged batch.
from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash import DFlashError
from dflash._core import testing


def test_allocator_and_block_table():
    alloc = testing.BlockAllocator(8)
    table = testing.BlockTable(4)
    table.reserve(10, alloc)  # 3 blocks
    assert alloc.num_free == 5 and table.capacity == 12 and len(table.blocks) == 3
    table.append(10)
    assert table.num_tokens == 10
    b = table.blocks
    assert table.slot(0) == b[0] * 4 and table.slot(9) == b[2] * 4 + 1
    table.truncate(6)  # rollback keeps the blocks
    assert table.num_tokens == 6 and alloc.num_free == 5
    with pytest.raises(DFlashError):
        table.truncate(7)
    with pytest.raises(DFlashError):
        table.append(7)  # past capacity
    with pytest.raises(DFlashError):
        table.reserve(100, alloc)  # more than the pool
    table.release(alloc)
    assert alloc.num_free == 8 and table.num_tokens == 0
    with pytest.raises(ValueError):
        testing.BlockAllocator(0)


def reference_attention(q, k, v, causal):
    """q [nq, nh, hd] at the last nq positions of k/v [n, nkv, hd]."""
    nq, nh, hd = q.shape
    n, nkv, _ = k.shape
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
    if causal:
        qpos = torch.arange(n - nq, n)[:, None]
        scores = scores.masked_fill(torch.arange(n)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("nh,nkv,hd", [(4, 2, 16), (6, 1, 8), (3, 3, 64)])
def test_paged_attention_matches_reference(causal, nh, nkv, hd):
    rng = np.random.default_rng(nh * 100 + hd + causal)
    block_size, num_blocks = 4, 64
    seqs = [(1, 1), (5, 17), (16, 16), (7, 30)]  # (queries, keys) per sequence
    k_pool = rng.standard_normal((num_blocks, block_size, nkv, hd), dtype=np.float32)
    v_pool = rng.standard_normal((num_blocks, block_size, nkv, hd), dtype=np.float32)
    perm = rng.permutation(num_blocks).astype(np.int32)  # scattered blocks
    max_blocks = max((n + block_size - 1) // block_size for _, n in seqs)
    table = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    used = 0
    for s, (_, n) in enumerate(seqs):
        nb = (n + block_size - 1) // block_size
        table[s, :nb] = perm[used:used + nb]
        used += nb
    q = rng.standard_normal((sum(nq for nq, _ in seqs), nh, hd), dtype=np.float32)
    query_start = np.cumsum([0] + [nq for nq, _ in seqs]).astype(np.int32)
    kv_len = np.array([n for _, n in seqs], dtype=np.int32)
    out = testing.cpu_paged_attention(q, k_pool, v_pool, query_start, kv_len, table, causal)
    for s, (nq, n) in enumerate(seqs):
        slots = [table[s, j // block_size] * block_size + j % block_size for j in range(n)]
        k = torch.from_numpy(k_pool.reshape(-1, nkv, hd)[slots])
        v = torch.from_numpy(v_pool.reshape(-1, nkv, hd)[slots])
        qs = torch.from_numpy(q[query_start[s]:query_start[s + 1]])
        ref = reference_attention(qs, k, v, causal).reshape(nq, nh * hd).numpy()
        np.testing.assert_allclose(out[query_start[s]:query_start[s + 1]], ref, atol=2e-5, rtol=1e-4)
