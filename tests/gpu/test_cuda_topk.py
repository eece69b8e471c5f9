# tests/gpu/test_cuda_topk.py
#
# The exact radix top-K (cuda/topk_candidates.cu through dflash._core.testing.cuda_topk_candidates)
# against the CPU backend's topk_row (testing.cpu_topk_candidates): ids exactly, unary to 1e-6
# relative, values also against torch.topk. Rows 1..300, vocab 1000..262144 (odd sizes, rows that
# start off a 16-byte boundary), K 1..64; heavy ties, +-0, +-inf, NaN (rows with fewer than K
# numbers), multiplier and softcap; determinism, the counters left at zero, CUDA-graph replay and
# the refused arguments. Outputs are poisoned before every run. Timings against torch.topk are
# printed (run with -s).
from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.gpu_helpers import kernel_ops, requires_cuda, torch

pytestmark = requires_cuda

DEV = "cuda"


def randn(rows, vocab, scale=4.0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(rows, vocab, device=DEV, generator=g) * scale


def workspace(rows, vocab, k):
    return torch.empty(kernel_ops().cuda_topk_workspace_bytes(rows, vocab, k), dtype=torch.uint8, device=DEV)


def run_topk(logits, k, multiplier=1.0, softcap=0.0):
    """The kernel's (ids, unary) on poisoned outputs; checks every element was written and the
    counters returned to zero."""
    rows, vocab = logits.shape
    ids = torch.full((rows, k), -7, dtype=torch.int32, device=DEV)
    unary = torch.full((rows, k), float("nan"), device=DEV)
    counters = torch.zeros(rows, dtype=torch.int32, device=DEV)
    kernel_ops().cuda_topk_candidates(logits, k, multiplier, softcap, ids, unary, workspace(rows, vocab, k), counters)
    assert int(counters.abs().sum()) == 0, "the counters must return to zero"
    assert not (ids == -7).any() and not unary.isnan().any(), "every output element is written"
    return ids, unary


def reference(logits, k, multiplier=1.0, softcap=0.0):
    ids, unary = kernel_ops().cpu_topk_candidates(logits.cpu().numpy(), k, multiplier, softcap)
    return np.asarray(ids, dtype=np.int32).reshape(-1, k), np.asarray(unary, dtype=np.float32)


def check(logits, k, multiplier=1.0, softcap=0.0, label=""):
    ids, unary = run_topk(logits, k, multiplier, softcap)
    want_ids, want_unary = reference(logits, k, multiplier, softcap)
    got_ids, got_unary = ids.cpu().numpy(), unary.cpu().numpy()
    bad = np.argwhere(got_ids != want_ids)
    if bad.size:
        r = bad[0][0]
        pytest.fail(f"{label}: {len(bad)} ids differ, first in row {r}: got {got_ids[r].tolist()}, "
                    f"want {want_ids[r].tolist()}")
    np.testing.assert_allclose(got_unary, want_unary, rtol=1e-6, atol=0, err_msg=label)
    if not logits.isnan().any():  # values as torch.topk's (ties may pick other ids there)
        assert torch.equal(logits.gather(1, ids.long()), torch.topk(logits, k, dim=1).values), label
    return ids, unary


# --------------------------------------------------------------------------------------------
# Against the CPU reference

CASES = [(rows, vocab, k) for rows, vocab in [(1, 1000), (7, 4097), (8, 151936), (2, 262144), (13, 151937)]
         for k in (1, 4, 16, 32, 64)]
CASES += [(33, 248320, 32), (300, 151936, 16), (300, 151936, 64), (5, 4099, 64), (3, 8195, 7), (1, 262143, 64),
          (64, 1000, 5), (4, 65, 64)]


@pytest.mark.parametrize("rows,vocab,k", CASES)
def test_random(rows, vocab, k):
    check(randn(rows, vocab, seed=rows * 7 + vocab + k), k, label=f"rows {rows} vocab {vocab} k {k}")


@pytest.mark.parametrize("vocab", [4097, 151936, 262144])
@pytest.mark.parametrize("k", [1, 16, 64])
def test_ties(vocab, k):
    """Few distinct values, all-equal rows, +-0 only, all -inf, a tie across the K-th place."""
    x = torch.round(randn(8, vocab, scale=2.0, seed=vocab + k)) / 2  # ~17 values
    x[1] = 3.0
    x[2] = 0.0
    x[2, 1::3] = -0.0
    x[3] = -float("inf")
    x[4] = torch.round(randn(1, vocab, scale=0.7, seed=5)[0])  # ~5 values
    x[5, :] = 1.0
    x[5, vocab // 2:] = 2.0  # more 2.0s than K, in the upper half
    x[6] = torch.round(randn(1, vocab, scale=30.0, seed=6)[0]).clamp(max=40)  # many ties at the max
    check(x, k, label=f"ties vocab {vocab} k {k}")


@pytest.mark.parametrize("vocab", [1000, 4097, 151936])
@pytest.mark.parametrize("k", [4, 16, 64])
def test_inf_and_nan(vocab, k):
    x = randn(10, vocab, seed=vocab * 3 + k)
    g = torch.Generator(device=DEV).manual_seed(k)
    pick = lambda p: torch.rand(vocab, device=DEV, generator=g) < p  # noqa: E731
    x[0, pick(0.01)] = float("inf")
    x[0, pick(0.01)] = -float("inf")
    x[1] = -float("inf")
    x[2, pick(0.1)] = float("nan")
    x[3] = float("nan")
    x[3, torch.arange(3, vocab, max(vocab // 5, 1), device=DEV)] = 1.5  # about 5 numbers, fewer than K
    x[4] = float("nan")
    x[5] = float("nan")
    x[5, :3] = -float("inf")
    x[5, -2:] = 2.0
    x[6, pick(0.05)] = float("inf")  # more +inf than K
    x[7] = -float("inf")
    x[7, [0, vocab // 2, vocab - 1]] = torch.tensor([-1e30, 7.0, -0.0], device=DEV)
    x[8, pick(0.5)] = float("nan")
    x[8, pick(0.5)] = -float("inf")
    x[9, vocab - 1] = float("nan")
    x[9, 0] = float("inf")
    check(x, k, label=f"inf/nan vocab {vocab} k {k}")


@pytest.mark.parametrize("multiplier,softcap", [(0.5, 0.0), (1.7, 30.0), (-1.0, 0.0), (1.0, 5.0), (0.03, 15.0)])
def test_multiplier_softcap(multiplier, softcap):
    x = randn(9, 151936, scale=12.0, seed=11)
    x[1, ::97] = float("inf")
    x[2, ::3] = float("nan")
    x[3] = -float("inf")
    x[4] = float("nan")
    x[4, 5:9] = torch.tensor([1.0, -0.0, 0.0, -float("inf")], device=DEV)
    check(x, 16, multiplier, softcap, label=f"multiplier {multiplier} softcap {softcap}")
    check(x[:, :4099].contiguous(), 64, multiplier, softcap, label=f"multiplier {multiplier} softcap {softcap}")


@pytest.mark.parametrize("offset", [1, 2, 3])
@pytest.mark.parametrize("vocab", [1000, 4097, 8195, 151936])
def test_misaligned_rows(offset, vocab):
    """Rows starting off a 16-byte boundary: a contiguous view into a larger buffer."""
    rows = 5
    flat = torch.empty(rows * vocab + 4, device=DEV)
    flat[offset:offset + rows * vocab] = torch.round(randn(rows, vocab, seed=offset + vocab).flatten() * 4)
    x = flat[offset:offset + rows * vocab].view(rows, vocab)
    assert x.data_ptr() % 16 != 0
    for k in (1, 16, 64):
        check(x, k, label=f"offset {offset} vocab {vocab} k {k}")


# --------------------------------------------------------------------------------------------
# Determinism, graphs, refusals


def test_deterministic():
    x = torch.round(randn(33, 151936, scale=3.0, seed=1))
    x[::4, ::5] = float("nan")
    first = run_topk(x, 64, 1.3, 20.0)
    for _ in range(3):
        again = run_topk(x, 64, 1.3, 20.0)
        assert torch.equal(first[0], again[0])
        assert torch.equal(first[1].view(torch.int32), again[1].view(torch.int32))


@pytest.mark.parametrize("rows,vocab,k", [(8, 151936, 16), (1, 1000, 4), (40, 262144, 64)])
def test_graph_replay(rows, vocab, k):
    """Captured once, replayed on new logits: equal to the eager run, counters back at zero."""
    t = kernel_ops()
    x = randn(rows, vocab, seed=rows + k)
    ids = torch.full((rows, k), -7, dtype=torch.int32, device=DEV)
    unary = torch.full((rows, k), float("nan"), device=DEV)
    ws = workspace(rows, vocab, k)
    counters = torch.zeros(rows, dtype=torch.int32, device=DEV)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        t.cuda_topk_candidates(x, k, 0.7, 10.0, ids, unary, ws, counters, stream=stream.cuda_stream)
    for seed in range(3):
        x.copy_(torch.round(randn(rows, vocab, seed=seed)) if seed == 2 else randn(rows, vocab, seed=seed))
        ids.fill_(-7)
        unary.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert int(counters.abs().sum()) == 0
        want = run_topk(x, k, 0.7, 10.0)
        assert torch.equal(ids, want[0])
        assert torch.equal(unary.view(torch.int32), want[1].view(torch.int32))


def test_refusals():
    t = kernel_ops()
    counters = torch.zeros(3, dtype=torch.int32, device=DEV)

    def call(logits, k, ws_k=None, ws_bytes=None, counters=counters):
        rows, vocab = logits.shape
        ids = torch.zeros((rows, k), dtype=torch.int32, device=DEV)
        unary = torch.zeros((rows, k), device=DEV)
        if ws_bytes is None:
            ws_bytes = t.cuda_topk_workspace_bytes(rows, vocab, ws_k or k)
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=DEV)
        t.cuda_topk_candidates(logits, k, 1.0, 0.0, ids, unary, ws, counters)

    x = randn(3, 100)
    for k, ws_k in ((0, 1), (65, 64), (16, None)):
        logits = randn(3, 10) if k == 16 else x  # k > vocab
        with pytest.raises(RuntimeError, match="invalid argument"):
            call(logits, k, ws_k=ws_k, ws_bytes=1 << 16)
    with pytest.raises(RuntimeError, match="invalid argument"):
        call(x, 16, counters=None)
    with pytest.raises(RuntimeError, match="invalid argument"):  # vocab > kTopkMaxVocab
        call(randn(1, 262145), 16, ws_bytes=1 << 20)
    need = t.cuda_topk_workspace_bytes(3, 151936, 16)
    assert need > 0
    with pytest.raises(RuntimeError, match="invalid argument"):
        call(randn(3, 151936), 16, ws_bytes=need - 8)
    assert int(counters.abs().sum()) == 0
    call(torch.empty(0, 100, device=DEV), 16)  # no rows: nothing to do
    check(randn(3, 64), 64, label="k == vocab")


# --------------------------------------------------------------------------------------------
# Timing (printed)


@pytest.mark.parametrize("rows", [8, 256])
def test_speed_vs_torch_topk(rows):
    t = kernel_ops()
    vocab, k = 151936, 16
    x = randn(rows, vocab, seed=2)
    ids = torch.empty((rows, k), dtype=torch.int32, device=DEV)
    unary = torch.empty((rows, k), device=DEV)
    ws = workspace(rows, vocab, k)
    counters = torch.zeros(rows, dtype=torch.int32, device=DEV)

    def ours():
        stream = torch.cuda.current_stream().cuda_stream
        t.cuda_topk_candidates(x, k, 1.0, 0.0, ids, unary, ws, counters, stream=stream)

    def theirs():
        torch.topk(x, k, dim=1)

    def time_us(fn, reps=50):
        for _ in range(5):
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000 / reps

    mine, ref = time_us(ours), time_us(theirs)
    floor = rows * vocab * 4 / 4e12 * 1e6
    print(f"\ntopk rows {rows} vocab {vocab} k {k}: {mine:.1f} us (torch.topk {ref:.1f} us, "
          f"{ref / mine:.1f}x; 4 TB/s floor {floor:.1f} us)")
    assert int(counters.abs().sum()) == 0
