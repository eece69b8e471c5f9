# tests/test_dflash2_ops.py
#
# The CPU backend's DFlash2 ops against their definitions: the per-row top-K (exact, sorted,
# lowest id first on ties, NaN never chosen before a number, -inf rows, a vocabulary that is
# no multiple of anything, multiplier and soft cap on the K values only) and the grouped
# dynamic conv against the reference's explicit loop (taps never cross a block boundary).
from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash import _core
from tests.reference.dflash2_reference import grouped_conv as conv_loop


def _topk(logits, k, multiplier=1.0, softcap=0.0):
    ids, unary = _core.testing.cpu_topk_candidates(np.ascontiguousarray(logits, dtype=np.float32), k,
                                                  multiplier, softcap)
    return np.asarray(ids, dtype=np.int64).reshape(len(logits), k), np.asarray(unary)


def _expected_order(row):
    keyed = [(1 if np.isnan(v) else 0, 0.0 if np.isnan(v) else -float(v), i) for i, v in enumerate(row)]
    return [i for _, _, i in sorted(keyed)]


@pytest.mark.parametrize("vocab, k", [(1, 1), (37, 5), (1000, 64), (4099, 16)])
def test_topk_random_rows(vocab, k):
    rng = np.random.default_rng(vocab)
    k = min(k, vocab)
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    ids, unary = _topk(logits, k)
    for r in range(3):
        assert ids[r].tolist() == _expected_order(logits[r])[:k]
        np.testing.assert_array_equal(unary[r], logits[r, ids[r]])


def test_topk_ties_take_the_lowest_ids_first():
    logits = np.array([[0, 2, 1, 2, 2, 1, 0]], dtype=np.float32)
    ids, _ = _topk(logits, 4)
    assert ids[0].tolist() == [1, 3, 4, 2]


def test_topk_nan_and_inf():
    row = np.array([np.nan, -np.inf, 3.0, np.nan, np.inf, -1.0, -np.inf], dtype=np.float32)
    ids, unary = _topk(row[None], 5)
    assert ids[0].tolist() == [4, 2, 5, 1, 6]  # +inf first; NaN after every number
    assert unary[0, 0] == np.inf and np.all(np.isneginf(unary[0, 3:]))
    all_nan = np.full((1, 6), np.nan, dtype=np.float32)
    ids, unary = _topk(all_nan, 3)
    assert ids[0].tolist() == [0, 1, 2] and np.all(np.isneginf(unary))  # NaN ids are valued -inf
    ids, unary = _topk(np.full((1, 5), -np.inf, dtype=np.float32), 2)
    assert ids[0].tolist() == [0, 1] and np.all(np.isneginf(unary))


def test_topk_multiplier_and_softcap_apply_to_the_values_only():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((2, 50)) * 10).astype(np.float32)
    ids_plain, _ = _topk(logits, 8)
    ids, unary = _topk(logits, 8, multiplier=0.2, softcap=3.0)
    assert ids.tolist() == ids_plain.tolist()  # both maps are monotonic: the selection is the same
    want = 3.0 * np.tanh(logits[np.arange(2)[:, None], ids] * 0.2 / 3.0)
    np.testing.assert_allclose(unary, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block, taps, group, hidden", [(4, 2, 4, 16), (5, 3, 8, 24), (8, 2, 16, 48), (1, 1, 2, 6)])
@pytest.mark.parametrize("side", [0, 1])
def test_grouped_conv_matches_the_reference_loop(block, taps, group, hidden, side):
    rng = np.random.default_rng(block * 10 + taps)
    n = 3 * block
    x = rng.standard_normal((n, hidden)).astype(np.float32)
    base = rng.standard_normal((2, taps, hidden)).astype(np.float32)
    deltas = rng.standard_normal((n, 2 * taps * hidden // group)).astype(np.float32)
    got = _core.testing.cpu_grouped_conv(x, base, deltas, side, block, group)
    d = torch.from_numpy(deltas).reshape(n, 2, taps, hidden // group)[:, side]
    want = conv_loop(torch.from_numpy(x), torch.from_numpy(base[side]), d, group, block)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    # Taps never cross a block: each block's output depends on that block's rows only.
    x2 = x.copy()
    x2[:block] += 1.0
    got2 = _core.testing.cpu_grouped_conv(x2, base, deltas, side, block, group)
    np.testing.assert_array_equal(got2[block:], got[block:])


def test_grouped_conv_refuses_bad_shapes():
    x = np.zeros((6, 8), dtype=np.float32)
    base = np.zeros((2, 2, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="grouped_conv"):
        _core.testing.cpu_grouped_conv(x, base, np.zeros((6, 7), dtype=np.float32), 0, 3, 4)
    with pytest.raises(ValueError, match="grouped_conv"):
        _core.testing.cpu_grouped_conv(x, base, np.zeros((6, 8), dtype=np.float32), 0, 4, 4)  # 6 rows, block 4
