# tests/gpu/test_cuda_nonfinite_logits.py
#
# NaN containment on the CUDA backend (the CPU twin is tests/test_nonfinite_logits.py): the
# nonfinite_rows kernel against numpy on NaN, +inf and -inf (odd vocabularies take the scalar
# tail), then injection through a model with a NaN embedding row (tests/nonfinite_helpers.py)
# with CUDA graphs and pipelined target-only decoding, eager steps, and DFlash / DFlash2 drafters:
# the request that meets NaN logits ends with finish_reason "error", the others generate what
# they generate on the clean model. Skipped without a usable Hopper GPU.
from __future__ import annotations

import json

import pytest

import dflash
from tests.gpu.gpu_helpers import DEV, gpu_dflash2, kernel_ops, requires_cuda, torch
from tests.nonfinite_helpers import check_nan_containment, check_spec_reads_only_consulted_rows

pytestmark = requires_cuda

KV = dict(kv_cache_tokens=4096, max_num_seqs=8)


@pytest.mark.parametrize("vocab", [1, 7, 1000, 1001, 151936])
def test_nonfinite_rows_kernel(vocab):
    K = kernel_ops()
    g = torch.Generator(device=DEV).manual_seed(vocab)
    logits = torch.randn(6, vocab, device=DEV, generator=g)
    logits[1, vocab - 1] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, vocab // 2] = float("-inf")
    logits[4, :] = torch.finfo(torch.float32).max
    flags = torch.full((6,), -1, device=DEV, dtype=torch.int32)
    K.cuda_nonfinite_rows(logits, flags)
    want = (~torch.isfinite(logits)).any(dim=1).to(torch.int32)
    assert torch.equal(flags, want) and flags.tolist() == [0, 1, 1, 1, 0, 0]


def _drafter(tmp_path, target, kind):
    if kind == "dflash":
        from dflash.drafter_format import write_dflash_drafter

        cfg = json.loads((target / "config.json").read_text())
        return write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=1, target_layer_ids=[0, 1],
                                    block_size=4)
    return gpu_dflash2(tmp_path, target, block_size=4, selector_top_k=8)


@pytest.mark.parametrize("draft,graphs", [(None, True), (None, False), ("dflash", True), ("dflash2", True)])
def test_nan_in_one_request_ends_it_with_error_and_spares_the_rest(tiny_model_dirs, tmp_path, draft, graphs):
    target = tiny_model_dirs["qwen3_hd128"]
    drafter = str(_drafter(tmp_path, target, draft)) if draft else "none"
    pipelined = dict(async_decode=True) if draft is None and graphs else {}
    stats = check_nan_containment(
        lambda model: dflash.Session(model, device="cuda", draft=drafter, cuda_graphs=graphs, **pipelined, **KV),
        target, tmp_path)
    assert (stats["graph_steps"] > 0) == graphs
    if draft is None and graphs:
        assert stats["pipelined_steps"] > 0  # the pipelined AR path ran (rows of an ended request dropped)


def test_verify_reads_no_row_behind_a_rejected_draft(tiny_model_dirs, tmp_path):
    target = tiny_model_dirs["qwen3_hd128"]
    drafter = str(_drafter(tmp_path, target, "dflash"))
    check_spec_reads_only_consulted_rows(
        lambda model: dflash.Session(model, device="cuda", draft=drafter, draft_sampling="greedy", **KV),
        target, tmp_path)
