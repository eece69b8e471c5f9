# tests/test_nonfinite_logits.py
#
# A NaN or an infinity in one request's logits ends that request with finish_reason "error" and
# leaves every other request's output unchanged (CPU backend; the GPU twin is
# tests/gpu/test_cuda_nonfinite_logits.py): the row check itself on NaN, +inf and -inf, then
# injection through a model whose embedding row of one token is NaN (tests/nonfinite_helpers.py),
# target-only and with DFlash / DFlash2 drafters, and the verify step's rule that rows behind a
# rejected draft are not read.
from __future__ import annotations

import numpy as np
import pytest

import dflash
from dflash import _core
from tests.nonfinite_helpers import check_nan_containment, check_spec_reads_only_consulted_rows
from tests.runtime_helpers import small_drafter_pair


@pytest.mark.parametrize("vocab", [1, 7, 64, 1001])
def test_row_flags_catch_nan_and_both_infinities(vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    logits[1, vocab - 1] = np.nan
    logits[2, 0] = np.inf
    logits[3, vocab // 2] = -np.inf
    logits[4, :] = np.finfo(np.float32).max  # large is still finite
    assert _core.testing.cpu_nonfinite_rows(logits) == [0, 1, 1, 1, 0]


def _sessions(tiny_model_dirs, tmp_path, draft):
    target = tiny_model_dirs["llama_gqa"]
    drafter = None
    if draft:
        drafter = small_drafter_pair(tmp_path / "drafters", target, dflash_layers=1, dflash_block_size=4,
                                     dflash_seed=3, dflash2_block_size=4, dflash2_top_k=4)[draft]
    return target, (lambda model: dflash.Session(model, device="cpu", draft=str(drafter) if drafter else "none",
                                                 num_threads=2))


@pytest.mark.parametrize("draft", [None, "dflash", "dflash2"])
def test_nan_in_one_request_ends_it_with_error_and_spares_the_rest(tiny_model_dirs, tmp_path, draft):
    target, make = _sessions(tiny_model_dirs, tmp_path, draft)
    check_nan_containment(make, target, tmp_path)


def test_verify_reads_no_row_behind_a_rejected_draft(tiny_model_dirs, tmp_path):
    target = tiny_model_dirs["llama_gqa"]
    drafter = small_drafter_pair(tmp_path / "drafters", target, dflash_layers=1, dflash_block_size=4,
                                 dflash_seed=3, dflash2_block_size=4, dflash2_top_k=4)["dflash"]
    check_spec_reads_only_consulted_rows(
        lambda model: dflash.Session(model, device="cpu", draft=str(drafter), draft_sampling="greedy", num_threads=2),
        target, tmp_path)


def test_an_infinite_embedding_row_is_contained_like_nan(tiny_model_dirs, tmp_path):
    # +inf in the embedding row becomes NaN at the first RMSNorm (inf * rsqrt(inf) = inf * 0).
    target, make = _sessions(tiny_model_dirs, tmp_path, None)
    stats = check_nan_containment(make, target, tmp_path, value=float("inf"))
    assert stats["num_nonfinite_requests"] == 2
