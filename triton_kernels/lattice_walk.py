"""DFlash2's lattice walk (dflash2 spec 3.3), compiled ahead of time (see aot.py).

One program per request b, the slot loop inside the kernel (each slot depends on the index
chosen at the one before), the K scores of a row in registers:

    prev = 0
    for s in 0 .. S-1:
        row = edges[b, s, prev, 0:K]          # fp32, edges [R, S, K, K]
        cand = ids[b, s, 0:K]                 # int32, ids [R, S, K]
        T <= 0: idx = argmax(row)             # NaN as -inf, lowest index on ties, 0 if all -inf
        else:   idx = argmax over the i whose row[i] is neither NaN nor -inf of
                      double(row[i]) / T - log(-log(u_i))    # fp64, lowest index on ties
                u_i = philox_uniform(seed, position + s, cand[i], kStreamDraftSample)
                (no such i: the greedy rule)
        drafts[b, s] = cand[idx]; realized[b, s, :] = row (bit for bit); prev = idx

This is walk_request of cpp/backend/cpu/host_candidates.cpp draw for draw: the Gumbel score is
formed in fp64 as there, and Philox-4x32-10 (cpp/common/philox.h) is redone in uint32
arithmetic, so the GPU and CPU walks draft the same tokens for the same seed (up to the last
bit of fp64 log, libdevice's against the host libm's).

params [R] are SampleRow (cpp/common/sample_row.h, 32 bytes) read as 8 int32 words:
temperature (word 0, fp32 bits), top_k, top_p, seed_lo, seed_hi, padding, position (words 6..7,
int64). K <= BLOCK_K (a power of two); lanes >= K are masked: never selected, never written.

Programmatic dependent launch as in paged_attention.py: gdc_wait first (the kernel ahead has
finished writing edges, ids and params), then gdc_launch_dependents.

Only `triton` and `triton.language` (and its `extra.cuda` grid-dependency helpers) are
imported: aot.py executes this file at build time.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PARAM_WORDS = tl.constexpr(8)  # sizeof(SampleRow) / 4
DRAFT_STREAM = tl.constexpr(1)  # cpp/common/philox.h kStreamDraftSample


@triton.jit
def _philox_uniform(index, pos_lo, pos_hi, key_lo, key_hi, STREAM: tl.constexpr):
    """philox_uniform(seed, position, index, STREAM) of cpp/common/philox.h per lane: index
    [BLOCK] uint32; pos_lo / pos_hi / key_lo / key_hi uint32 scalars (the halves of position
    and seed). Philox-4x32-10 on counter (index, STREAM, pos_lo, pos_hi), key (key_lo, key_hi);
    returns ((word 0 >> 9) + 0.5) * 2^-23 in fp32."""
    m0 = tl.full(index.shape, 0xD2511F53, tl.uint32)
    m1 = tl.full(index.shape, 0xCD9E8D57, tl.uint32)
    c0 = index
    c1 = tl.full(index.shape, STREAM, tl.uint32)
    c2 = tl.zeros_like(index) + pos_lo
    c3 = tl.zeros_like(index) + pos_hi
    k0 = key_lo
    k1 = key_hi
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(m0, c0)
        lo0 = m0 * c0
        hi1 = tl.umulhi(m1, c2)
        lo1 = m1 * c2
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 += tl.full((), 0x9E3779B9, tl.uint32)
        k1 += tl.full((), 0xBB67AE85, tl.uint32)
    return ((c0 >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _first_max(key, lane, BLOCK_K: tl.constexpr):
    """The lowest lane holding the maximum of key [BLOCK_K] (no NaN in key; all -inf: 0)."""
    best = tl.max(key, axis=0)
    return tl.min(tl.where(key == best, lane, BLOCK_K), axis=0)


@triton.jit
def lattice_walk_kernel(
        edges_ptr,  # fp32 [R, S, K, K]
        ids_ptr,  # int32 [R, S, K]
        params_ptr,  # int32 words of SampleRow [R]
        drafts_ptr,  # int32 [R, S]
        realized_ptr,  # fp32 [R, S, K]
        num_slots, k,  # i32: S, K (1 <= K <= BLOCK_K)
        greedy_walk,  # i32: 1 = the greedy walk at every temperature, realized one-hot (0 / -inf)
        BLOCK_K: tl.constexpr):
    gdc_wait()
    gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK_K)
    in_row = lane < k

    p = params_ptr + b * PARAM_WORDS
    temperature = tl.load(p).to(tl.float32, bitcast=True)
    seed_lo = tl.load(p + 3).to(tl.uint32, bitcast=True)
    seed_hi = tl.load(p + 4).to(tl.uint32, bitcast=True)
    pos_lo = tl.load(p + 6).to(tl.uint32, bitcast=True)
    position = (tl.load(p + 7).to(tl.int64) << 32) | pos_lo.to(tl.int64)
    greedy = (temperature <= 0.0) | (greedy_walk != 0)  # as on the host, a NaN temperature samples
    temperature64 = temperature.to(tl.float64)

    prev = tl.zeros((), tl.int32)
    for s in range(num_slots):
        slot = b * num_slots + s  # row of ids, drafts and realized
        row = tl.load(edges_ptr + (slot * k + prev) * k + lane, mask=in_row, other=0.0)
        cand = tl.load(ids_ptr + slot * k + lane, mask=in_row, other=0)
        idx = _first_max(tl.where(in_row & (row == row), row, float("-inf")), lane, BLOCK_K)
        if greedy == 0:
            pos = position + s  # the counter takes it as uint64: its two 32-bit halves
            u = _philox_uniform(cand.to(tl.uint32, bitcast=True), pos.to(tl.uint32),
                                (pos >> 32).to(tl.uint32), seed_lo, seed_hi, DRAFT_STREAM)
            g = row.to(tl.float64) / temperature64 - tl.log(-tl.log(u.to(tl.float64)))
            valid = in_row & (row == row) & (row != float("-inf"))
            first = tl.min(tl.where(valid, lane, BLOCK_K), axis=0)
            if first < BLOCK_K:
                # The host takes the first valid lane, then a later one only if its score is
                # greater: a NaN score on the first valid lane (T NaN, or +inf / +inf) sticks,
                # NaN elsewhere never wins. Valid lanes have no -inf score.
                first_nan = tl.max(tl.where((lane == first) & (g != g), 1, 0), axis=0)
                best = _first_max(tl.where(valid & (g == g), g, float("-inf")), lane, BLOCK_K)
                idx = tl.where(first_nan > 0, first, best)
        if greedy_walk != 0:  # q one-hot on the walked candidate at any temperature
            tl.store(realized_ptr + slot * k + lane, tl.where(lane == idx, 0.0, float("-inf")), mask=in_row)
        else:
            tl.store(realized_ptr + slot * k + lane, row, mask=in_row)
        tl.store(drafts_ptr + slot, tl.sum(tl.where(lane == idx, cand, 0), axis=0))
        prev = idx
