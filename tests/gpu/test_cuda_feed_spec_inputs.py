# tests/gpu/test_cuda_feed_spec_inputs.py
#
# The pipelined speculative step's feed (cuda/feed_tokens.cu, feed_spec_inputs) against a Python
# reference of Backend::feed_spec_inputs: fed requests move on by the previous step's accepted
# count + 1 (positions, kv_len, the SampleRow position; slots looked up in the block table at the
# new positions across block boundaries), their anchor the previous step's next token; unfed ones
# (feed -1) and every other field stay as staged. Skipped without a CUDA device or a CUDA build.
from __future__ import annotations

import pytest

from tests.gpu.gpu_helpers import DEV, kernel_ops, requires_cuda, torch

pytestmark = requires_cuda

SAMPLE_ROW_BYTES = 32  # common/sample_row.h: position is the int64 at byte 24


def reference(feed, accepted, next_token, table, block_size, q, staged):
    out = {k: v.clone() for k, v in staged.items()}
    for r, f in enumerate(feed.tolist()):
        if f < 0:
            continue
        shift = int(accepted[f]) + 1
        for j in range(q):
            pos = int(staged["positions"][r * q + j]) + shift
            out["positions"][r * q + j] = pos
            out["slots"][r * q + j] = int(table[r, pos // block_size]) * block_size + pos % block_size
        out["kv_len"][r] += shift
        position = out["params"][r * SAMPLE_ROW_BYTES + 24: r * SAMPLE_ROW_BYTES + 32].view(torch.int64)
        position += shift
        out["anchors"][r] = out["ids"][r * q] = out["verify_ids"][r * q] = int(next_token[f])
    return out


@pytest.mark.parametrize("b,q,block_size", [(1, 8, 16), (5, 4, 4), (24, 16, 16)])
def test_matches_reference(b, q, block_size):
    K = kernel_ops()
    g = torch.Generator().manual_seed(b * 100 + q)
    prev = b + 3  # rows of the step before
    accepted = torch.randint(0, q, (prev,), generator=g, dtype=torch.int32)
    next_token = torch.randint(0, 50000, (prev,), generator=g, dtype=torch.int32)
    feed = torch.randperm(prev, generator=g)[:b].to(torch.int32)
    feed[1::3] = -1  # some requests not fed (new, or padding)
    width = (200 + 2 * q) // block_size + 1
    table = torch.randperm(4096, generator=g)[:b * width].reshape(b, width).to(torch.int32)
    q0 = torch.randint(0, 200, (b,), generator=g, dtype=torch.int32)
    positions = (q0[:, None] + torch.arange(q, dtype=torch.int32)[None, :]).reshape(-1)
    slots = torch.stack([table[r, (positions[r * q:(r + 1) * q] // block_size).long()] * block_size
                         + positions[r * q:(r + 1) * q] % block_size for r in range(b)]).reshape(-1).to(torch.int32)
    params = torch.randint(0, 255, (b * SAMPLE_ROW_BYTES,), generator=g, dtype=torch.uint8)
    for r in range(b):
        params[r * SAMPLE_ROW_BYTES + 24: r * SAMPLE_ROW_BYTES + 32].view(torch.int64)[0] = int(q0[r]) + 1
    staged = {"ids": torch.randint(0, 50000, (b * q,), generator=g, dtype=torch.int32),
              "verify_ids": torch.randint(0, 50000, (b * q,), generator=g, dtype=torch.int32),
              "positions": positions, "slots": slots, "kv_len": q0 + q,
              "anchors": torch.randint(0, 50000, (b,), generator=g, dtype=torch.int32), "params": params}
    want = reference(feed, accepted, next_token, table, block_size, q, staged)
    dev = {k: v.to(DEV) for k, v in staged.items()}
    K.cuda_feed_spec_inputs(feed.to(DEV), accepted.to(DEV), next_token.to(DEV), table.to(DEV), block_size,
                            dev["ids"], dev["verify_ids"], dev["positions"], dev["slots"], dev["kv_len"],
                            dev["anchors"], dev["params"])
    for name, t in dev.items():
        assert torch.equal(t.cpu(), want[name]), name
    assert feed[0] >= 0 and (b == 1 or (feed < 0).any())


def test_bad_arguments():
    K = kernel_ops()
    i32 = {"dtype": torch.int32, "device": DEV}
    with pytest.raises(ValueError, match="feed_spec_inputs"):
        K.cuda_feed_spec_inputs(torch.zeros(2, **i32), torch.zeros(2, **i32), torch.zeros(2, **i32),
                                torch.zeros(2, 4, **i32), 16, torch.zeros(8, **i32), torch.zeros(8, **i32),
                                torch.zeros(8, **i32), torch.zeros(8, **i32), torch.zeros(2, **i32),
                                torch.zeros(2, **i32), torch.zeros(63, dtype=torch.uint8, device=DEV))
