# tests/gpu/test_triton_walk.py
#
# The AOT Triton lattice walk (triton_kernels/lattice_walk.py through
# dflash._core.testing.triton_lattice_walk) against walk_ref of
# tests/reference/dflash2_reference.py, which follows the CPU backend's walk_request draw for
# draw: drafts token for token, realized rows bit for bit. Covers batches of 1, 3 and 33
# requests, 1, 7 and 15 slots, K from 1 to 64 (each compiled BLOCK_K, full and partial), greedy
# (T = 0) and Gumbel-sampled (T = 0.5, 1, 2) walks with several 64-bit seeds and positions (one
# crossing 2^32) and mixed-temperature batches; rows with ties, NaN (payloads kept), -inf, +inf
# and all -inf / NaN rows; a CUDA-graph replay equal to eager on new inputs; the refusals
# (K = 0, K = 65) and the empty batch.
#
# Outputs are poisoned first (drafts -7, realized a sentinel) inside larger buffers whose tail
# is checked untouched, so a missed or stray write shows up. Candidate ids are drawn with
# repetition, so a slot may hold one token twice (equal noise: the lower index wins ties).
#
# Skips cleanly (module-level skipif, nothing imported that fails) without torch, a CUDA device,
# a CUDA build of dflash, or a Hopper (sm_90) GPU.
from __future__ import annotations

import struct

import pytest

from tests.gpu.gpu_helpers import torch


def _skip_reason() -> str | None:
    if torch is None:
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

POISON_DRAFT = -7
POISON_BITS = 0x7F7F7F7F  # a large finite fp32 no test row holds
GUARD = 64  # elements after each output that must stay poisoned
DEVICE = "cuda"


def _testing():
    from dflash._core import testing

    return testing


def pack_params(temps, seeds, positions):
    """SampleRow [R] (cpp/common/sample_row.h: T, top_k, top_p, seed lo, seed hi,
    position) as a uint8 tensor on DEVICE."""
    raw = b"".join(struct.pack("<fifII4xq", t, 0, 1.0, s & 0xFFFFFFFF, s >> 32, p)
                   for t, s, p in zip(temps, seeds, positions))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(DEVICE) if raw else \
        torch.empty(0, dtype=torch.uint8, device=DEVICE)


class Outputs:
    """Poisoned drafts [R, S] and realized [R, S, K] at the head of larger guarded buffers."""

    def __init__(self, r, s, k):
        self.shape = (r, s, k)
        self.drafts_buf = torch.empty(r * s + GUARD, dtype=torch.int32, device=DEVICE)
        self.realized_buf = torch.empty(r * s * k + GUARD, dtype=torch.float32, device=DEVICE)
        self.drafts = self.drafts_buf[:r * s].view(r, s)
        self.realized = self.realized_buf[:r * s * k].view(r, s, k)
        self.poison()

    def poison(self):
        self.drafts_buf.fill_(POISON_DRAFT)
        self.realized_buf.view(torch.int32).fill_(POISON_BITS)

    def check_guard(self):
        r, s, k = self.shape
        assert (self.drafts_buf[r * s:] == POISON_DRAFT).all(), "write past drafts"
        assert (self.realized_buf.view(torch.int32)[r * s * k:] == POISON_BITS).all(), \
            "write past realized"

    def result(self):
        return self.drafts.cpu(), self.realized.cpu()


def lattice(r, s, k, seed, special=False):
    """edges [R, S, K, K] fp32 and ids [R, S, K] int32 on the CPU. special: ties, -inf, NaN
    (also with payloads), +inf; request 1 all -inf, request 2 NaN heads and -inf tails."""
    gen = torch.Generator().manual_seed(seed)
    edges = torch.randn(r, s, k, k, generator=gen) * 3
    ids = torch.randint(0, 250_000, (r, s, k), generator=gen, dtype=torch.int32)
    if special:
        u = torch.rand(r, s, k, k, generator=gen)
        edges[u < 0.25] = 1.5
        edges[(u >= 0.25) & (u < 0.35)] = float("-inf")
        edges[(u >= 0.35) & (u < 0.42)] = float("nan")
        edges[(u >= 0.42) & (u < 0.45)] = float("inf")
        bits = edges.view(torch.int32)
        bits[(u >= 0.45) & (u < 0.48)] = 0x7FA00001  # a signalling NaN payload
        bits[(u >= 0.48) & (u < 0.50)] = -4194303  # 0xFFC00001, a negative NaN payload
        if r > 1:
            edges[1] = float("-inf")
        if r > 2:
            edges[2, :, :, :k // 2 + 1] = float("nan")
            edges[2, :, :, k // 2 + 1:] = float("-inf")
    return edges, ids


def expected(edges, ids, temps, seeds, positions):
    """walk_ref per request: drafts [R, S] int32 and realized [R, S, K] fp32."""
    from tests.reference.dflash2_reference import walk_ref

    r, s, k = ids.shape
    drafts = torch.empty(r, s, dtype=torch.int32)
    realized = torch.empty(r, s, k, dtype=torch.float32)
    for b in range(r):
        # walk_ref keys slot s by anchor_position + 1 + s; params hold the first draft's position.
        w = walk_ref(edges[b], ids[b], temperature=temps[b], seed=seeds[b],
                     anchor_position=positions[b] - 1)
        drafts[b] = w.draft_ids.to(torch.int32)
        realized[b] = w.realized_rows
    return drafts, realized


def run_walk(edges, ids, temps, seeds, positions, use_lists=False):
    t = _testing()
    r, s, k = ids.shape
    out = Outputs(r, s, k)
    if use_lists:
        t.triton_lattice_walk(edges.to(DEVICE), ids.to(DEVICE), None, out.drafts, out.realized,
                              temperature=list(temps), seed=list(seeds), position=list(positions))
    else:
        t.triton_lattice_walk(edges.to(DEVICE), ids.to(DEVICE),
                              pack_params(temps, seeds, positions), out.drafts, out.realized)
    out.check_guard()
    return out.result()


def assert_walk_equal(got, want, what):
    (drafts, realized), (ref_drafts, ref_realized) = got, want
    bad = (drafts != ref_drafts).nonzero().tolist()
    assert not bad, (f"{what}: drafts differ at (request, slot) {bad[:5]}: "
                     f"{drafts[tuple(bad[0])].item()} != {ref_drafts[tuple(bad[0])].item()}")
    assert torch.equal(realized.view(torch.int32), ref_realized.view(torch.int32)), \
        f"{what}: realized rows differ"


def request_params(r, temperature, salt):
    """Per-request 64-bit seeds and positions (request 1's slots cross 2^32, where the counter's
    high word changes); at T > 0 request 2 is greedy inside the sampled batch."""
    seeds = [(0x9E3779B97F4A7C15 * (b + 1) + salt) % 2**64 for b in range(r)]
    positions = [17 + 1000 * b + salt for b in range(r)]
    if r > 1:
        positions[1] = 2**32 - 3
    temps = [temperature] * r
    if r > 2 and temperature > 0:
        temps[2] = 0.0
    return temps, seeds, positions


@pytest.mark.parametrize("k", [1, 4, 5, 16, 17, 32, 64])
@pytest.mark.parametrize("r, s", [(1, 1), (1, 15), (3, 7), (3, 15), (33, 1), (33, 7), (33, 15)])
def test_matches_reference(r, s, k):
    edges, ids = lattice(r, s, k, seed=1000 * r + 10 * s + k)
    for temperature in (0.0, 0.5, 1.0, 2.0):
        for salt in (0, 12345) if temperature > 0 else (0,):
            temps, seeds, positions = request_params(r, temperature, salt)
            assert_walk_equal(run_walk(edges, ids, temps, seeds, positions),
                              expected(edges, ids, temps, seeds, positions),
                              f"R={r} S={s} K={k} T={temperature} salt={salt}")


@pytest.mark.parametrize("k", [1, 5, 16, 64])
def test_greedy_walk_at_every_temperature(k):
    """greedy_walk (draft_sampling="greedy" with a DFlash2 drafter): the T = 0 walk's drafts at
    every temperature, realized rows one-hot: 0 at the walked candidate, -inf elsewhere."""
    t = _testing()
    r, s = 5, 7
    edges, _ = lattice(r, s, k, seed=77 + k)
    gen = torch.Generator().manual_seed(k)
    ids = torch.argsort(torch.rand(r, s, 5000, generator=gen), dim=-1)[..., :k].to(torch.int32)  # distinct ids
    temps0, seeds, positions = request_params(r, 0.0, 0)
    ref_drafts, _ = expected(edges, ids, temps0, seeds, positions)
    for temperature in (0.0, 0.7, 1.0):
        out = Outputs(r, s, k)
        t.triton_lattice_walk(edges.to(DEVICE), ids.to(DEVICE), None, out.drafts, out.realized,
                              temperature=[temperature] * r, seed=list(seeds), position=list(positions),
                              greedy_walk=True)
        out.check_guard()
        drafts, realized = out.result()
        assert torch.equal(drafts, ref_drafts), f"T={temperature}"
        hot = (ids == drafts[..., None]) & (torch.cumsum((ids == drafts[..., None]).int(), -1) == 1)
        want = torch.where(hot, torch.tensor(0.0), torch.tensor(float("-inf")))
        assert torch.equal(realized, want), f"T={temperature}: realized is not one-hot"


@pytest.mark.parametrize("k", [1, 4, 5, 16, 17, 32, 64])
@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 2.0])
def test_special_values(k, temperature):
    """Ties (lowest index), NaN (never chosen, copied bit for bit), -inf, +inf (the first one
    wins), all -inf / NaN rows (candidate 0)."""
    edges, ids = lattice(5, 15, k, seed=k, special=True)
    temps, seeds, positions = request_params(5, temperature, 7)
    got = run_walk(edges, ids, temps, seeds, positions)
    assert_walk_equal(got, expected(edges, ids, temps, seeds, positions),
                      f"special K={k} T={temperature}")
    assert got[0][1].tolist() == ids[1, :, 0].tolist()  # all -inf: candidate 0 of row 0
    assert got[0][2].tolist() == ids[2, :, 0].tolist()  # NaN and -inf only: the same


def test_sampling_follows_temperature_seed_and_position():
    """On flat rows the noise decides: a sampled walk differs from the greedy one and changes
    with the seed and the position, and is reproducible."""
    edges, ids = lattice(8, 15, 16, seed=3)
    edges *= 0.1
    def walk(t, seed, pos):
        return run_walk(edges, ids, [t] * 8, [seed] * 8, [pos] * 8)[0]

    a = walk(1.0, 1, 100)
    for other in (walk(0.0, 1, 100), walk(1.0, 2, 100), walk(1.0, 1, 101)):
        assert not torch.equal(a, other)
    assert torch.equal(a, walk(1.0, 1, 100))


def test_params_lists_equal_params_tensor():
    edges, ids = lattice(3, 7, 17, seed=5)
    temps, seeds, positions = request_params(3, 1.0, 0)
    assert_walk_equal(run_walk(edges, ids, temps, seeds, positions, use_lists=True),
                      run_walk(edges, ids, temps, seeds, positions), "lists vs tensor")


def test_graph_replay_equals_eager():
    """Captured once; replayed on new edges / ids / params written in place, each replay equals
    the eager walk and the reference on the inputs it saw."""
    t = _testing()
    r, s, k = 9, 7, 32
    edges, ids = lattice(r, s, k, seed=21)
    temps, seeds, positions = request_params(r, 1.0, 0)
    run_walk(edges, ids, temps, seeds, positions)  # loads the modules outside the capture
    d_edges, d_ids = edges.to(DEVICE), ids.to(DEVICE)
    d_params = pack_params(temps, seeds, positions)
    out = Outputs(r, s, k)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        t.triton_lattice_walk(d_edges, d_ids, d_params, out.drafts, out.realized,
                              stream=stream.cuda_stream)
    for step, temperature in enumerate((1.0, 0.0, 0.5)):
        edges, ids = lattice(r, s, k, seed=100 + step, special=step == 2)
        temps, seeds, positions = request_params(r, temperature, 31 * step)
        d_edges.copy_(edges)
        d_ids.copy_(ids)
        d_params.copy_(pack_params(temps, seeds, positions))
        out.poison()
        graph.replay()
        torch.cuda.synchronize()
        out.check_guard()
        replayed = out.result()
        assert_walk_equal(replayed, run_walk(edges, ids, temps, seeds, positions),
                          f"replay {step} vs eager")
        assert_walk_equal(replayed, expected(edges, ids, temps, seeds, positions),
                          f"replay {step} vs reference")


@pytest.mark.parametrize("k", [0, 65])
def test_refuses_unsupported_k(k):
    t = _testing()
    assert t.triton_lattice_walk_max_k() == 64
    for r in (2, 0):
        out = Outputs(r, 3, k)
        with pytest.raises(ValueError, match="k = "):
            t.triton_lattice_walk(torch.zeros(r, 3, k, k, device=DEVICE),
                                  torch.zeros(r, 3, k, dtype=torch.int32, device=DEVICE),
                                  pack_params([0.0] * r, [0] * r, [0] * r), out.drafts,
                                  out.realized)
        out.check_guard()
        assert (out.drafts == POISON_DRAFT).all()


def test_empty_batch_and_no_slots_launch_nothing():
    t = _testing()
    for r, s in ((0, 7), (3, 0)):
        out = Outputs(r, s, 8)
        t.triton_lattice_walk(torch.zeros(r, s, 8, 8, device=DEVICE),
                              torch.zeros(r, s, 8, dtype=torch.int32, device=DEVICE),
                              pack_params([1.0] * r, [0] * r, [0] * r), out.drafts, out.realized)
        out.check_guard()
