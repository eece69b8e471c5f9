# tests/gpu/test_cuda_argmax_assemble.py
#
# argmax_rows (bf16 and f32 logits, odd vocabularies) and assemble_drafts (proposed or override
# drafts into the verify rows) against torch. Skipped without a CUDA device or a CUDA build.
from __future__ import annotations

import pytest

from tests.gpu.gpu_helpers import DEV, kernel_ops, requires_cuda, torch

pytestmark = requires_cuda

_ops = kernel_ops


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
