"""Paged attention over a bf16 paged KV cache, compiled ahead of time (see aot.py).

Layout (one layer):
  q        [T, num_heads, HEAD_DIM] bf16, the ragged batch: sequence s owns query rows
           [query_start[s], query_start[s+1]) and has kv_len[s] keys; its queries sit at the LAST
           positions, q_pos = kv_len - num_q + i.
  k_pool   [num_blocks, block_size, num_kv_heads, HEAD_DIM] bf16 (v_pool the same); key j of
           sequence s lives in block block_table[s, j // block_size] at offset j % block_size.
  out      [T, num_heads, HEAD_DIM] bf16.
Masks: causal (key j visible iff j <= q_pos), non-causal (all kv_len keys: the DFlash drafter's
block), sliding window (window > 0; the caller also sets causal: q_pos - window < j <= q_pos),
symmetric window (symmetric != 0, window > 0, causal 0: |q_pos - j| < window, the non-causal
sliding layers of DFlash2 drafters; keys above q_pos exist when the queries are a block).

GQA: the group = num_heads / num_kv_heads query heads of one KV head are processed together.
A tile has BLOCK_M rows; row m is (query i = m // group, head kv_head * group + m % group), so
every K/V tile is loaded once for the whole group, and a group that is not a power of two
(SmolLM2's 9/3) wastes at most group - 1 rows of a tile.

Kernels:
  paged_attention_prefill_kernel      any number of queries per sequence. Grid
      (num_tokens // q_per_tile + num_seqs, num_kv_heads), q_per_tile = BLOCK_M // group.
      Query tiles are laid out without a host-side tile list: sequence s owns the tile indices
      [query_start[s] // q_per_tile + s, ... + cdiv(num_q, q_per_tile)), and a program finds its
      sequence by binary search over query_start (the bound T // q_per_tile + num_seqs covers every
      sequence's tiles; indices in the gaps exit at once). A sequence's tiles run last query
      tile first, so the causal tiles with the most keys start first.
  paged_attention_decode_kernel       few queries per sequence (num_q * group <= BLOCK_M). Grid
      (num_seqs, num_kv_heads, num_splits). With num_splits == 1 it writes out; with more, split
      p covers the p-th BLOCK_N-aligned chunk of the sequence's key range and writes its partial
      (row max m, row sum l, unnormalised acc) in fp32 to the workspace for
  paged_attention_split_reduce_kernel grid (T, num_heads): out = sum_p 2^(m_p - M) acc_p /
      sum_p 2^(m_p - M) l_p.
  paged_attention_chunked_kernel      the batch-invariant kernel (deterministic=True): the
      prefill kernel's tiles and grid, with a row's keys cut in chunks of KEY_CHUNK keys at fixed
      positions (chunk p: keys [p KEY_CHUNK, (p + 1) KEY_CHUNK)), each chunk's softmax computed
      from scratch and the chunks folded in increasing order (_fold). With split == 0 a program
      folds its tile's chunks itself; with split != 0 the grid has a third axis over the chunks,
      program p writes chunk p's partial to the workspace (as the decode kernel does), and
  paged_attention_chunk_fold_kernel   grid (T, num_heads) folds the partials of chunks
      0, 1, ... in the same order with the same operations. A chunk that holds no key a row sees
      has m = -inf, l = 0, acc = 0, and folding it changes nothing (exactly), so a row gets the same
      bits from either launch, whatever its tile's other rows, the number of chunks of the launch
      or the split: decode, verify and prefill rows of a position agree, and the host may split a
      launch over its chunks (many programs for few rows and many keys) or not by shape alone.

Workspace (fp32) of a split launch: acc [num_splits, T, num_heads, HEAD_DIM], then
ml [num_splits, T, num_heads, 2] (m in log2 units of the scaled scores, l).

Inside a kernel the key range of a tile is cut in three: keys that some row of the tile masks
(the first window tile, the causal diagonal or the symmetric window's upper edge, the ragged
end) run through the masked loop, the rest through a loop without masks. Softmax is online in
fp32 with exp2 and the scale folded into log2(e); rows that see no key (only possible for
inconsistent metadata) write zeros.

Programmatic dependent launch: every kernel starts with gdc_wait (the kernel ahead in the stream
has completed and its writes are visible; a no-op for a plain launch), then lets the next kernel
launch (gdc_launch_dependents); the launchers of aot.py set the launch attribute.

Only `triton` and `triton.language` (and its `extra.cuda` grid-dependency helpers) are imported:
aot.py executes this file at build time.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, start, end, kv_len, q_pos, causal,
                  window, symmetric, block_size, slot_stride, qk_scale, MASKED: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax of q against keys [start, end) (start BLOCK_N-aligned).

    k_ptr/v_ptr point at the tile's KV head in block 0, table_ptr at the sequence's row of the
    block table. Without MASKED every key of [start, end) must be visible to every row and
    end - start a multiple of BLOCK_N.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for n0 in range(start, end, BLOCK_N):
        j = n0 + offs_n
        if MASKED:
            in_range = j < kv_len
            blk = tl.load(table_ptr + j // block_size, mask=in_range, other=0)
        else:
            blk = tl.load(table_ptr + j // block_size)
        slot = blk.to(tl.int64) * block_size + (j % block_size)
        kv_off = slot[:, None] * slot_stride + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptr + kv_off, mask=in_range[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + kv_off)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            visible = in_range[None, :] & ((j[None, :] <= q_pos[:, None]) | (causal == 0))
            visible = visible & ((j[None, :] > q_pos[:, None] - window) | (window <= 0))
            visible = visible & ((j[None, :] < q_pos[:, None] + window) | (symmetric == 0))
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptr + kv_off, mask=in_range[:, None], other=0.0)
            # A masked key has p = 0, but 0 * NaN is NaN: a non-finite value (a NaN row of
            # another query of the tile, behind it in causal order) must add nothing.
            v = tl.where((v - v) == 0, v, tl.zeros_like(v))
        else:
            v = tl.load(v_ptr + kv_off)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_span(acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, c0, c1, full_lo, full_hi, kv_len,
                 q_pos, causal, window, symmetric, block_size, slot_stride, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [c0, c1): masked below full_lo, unmasked in [full_lo, full_hi), masked above.

    c0, full_lo and full_hi are BLOCK_N-aligned with full_lo <= full_hi; every key in
    [full_lo, full_hi) is visible to every row.
    """
    a = tl.maximum(c0, tl.minimum(full_lo, c1))
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, c0, a, kv_len,
                                  q_pos, causal, window, symmetric, block_size, slot_stride,
                                  qk_scale, True, HEAD_DIM, BLOCK_N)
    b = tl.minimum(full_hi, c1)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, a, b, kv_len,
                                  q_pos, causal, window, symmetric, block_size, slot_stride,
                                  qk_scale, False, HEAD_DIM, BLOCK_N)
    b = tl.maximum(b, a)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, b, c1, kv_len,
                                  q_pos, causal, window, symmetric, block_size, slot_stride,
                                  qk_scale, True, HEAD_DIM, BLOCK_N)
    return acc, m_i, l_i


@triton.jit
def _key_ranges(kv_len, qp_first, qp_last, causal, window, symmetric, BLOCK_N: tl.constexpr):
    """Key range [lo, hi) that rows at positions [qp_first, qp_last] need (lo BLOCK_N-aligned),
    and the aligned range [full_lo, full_hi) that all of them see (full_lo <= full_hi).

    A row at q_pos sees keys up to q_pos (causal), q_pos + window - 1 (symmetric window) or
    kv_len - 1, and from q_pos - window + 1 with a window (causal or symmetric)."""
    hi = tl.where(causal != 0, tl.minimum(kv_len, qp_last + 1), kv_len)
    hi = tl.where(symmetric != 0, tl.minimum(kv_len, qp_last + window), hi)
    hi = tl.maximum(hi, 0)
    first = tl.where(window > 0, tl.maximum(qp_first - window + 1, 0), 0)
    lo = tl.minimum(first // BLOCK_N * BLOCK_N, hi)
    all_hi = tl.where(causal != 0, tl.minimum(kv_len, qp_first + 1), kv_len)
    all_hi = tl.where(symmetric != 0, tl.minimum(kv_len, qp_first + window), all_hi)
    full_hi = tl.maximum(all_hi, 0) // BLOCK_N * BLOCK_N
    all_lo = tl.where(window > 0, tl.maximum(qp_last - window + 1, 0), 0)
    full_lo = (all_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    full_lo = tl.maximum(full_lo, lo)
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, hi, full_lo, full_hi


@triton.jit
def _kv_head_pointers(k_pool_ptr, v_pool_ptr, block_table_ptr, seq, kv_head, num_kv_heads,
                      max_blocks_per_seq, HEAD_DIM: tl.constexpr):
    """K and V of KV head kv_head in block 0 of the pools, the sequence's row of the block table,
    and the stride between key slots (what _attend_tiles takes)."""
    slot_stride = num_kv_heads * HEAD_DIM
    k_ptr = k_pool_ptr + kv_head * HEAD_DIM
    v_ptr = v_pool_ptr + kv_head * HEAD_DIM
    table_ptr = block_table_ptr + seq.to(tl.int64) * max_blocks_per_seq
    return k_ptr, v_ptr, table_ptr, slot_stride


@triton.jit
def _find_tile(tile, query_start_ptr, num_seqs, q_per_tile):
    """The query tile with index `tile` of the prefill grid: its sequence, the sequence's first
    query row and query count, the tile's first query (a sequence's tiles run last query tile
    first, so the causal tiles with the most keys start first), and the index among the sequence's
    tiles and their number (an index in the gaps between sequences has local >= num_tiles)."""
    # The sequence owning this tile: the last s with query_start[s] // q_per_tile + s <= tile.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_ptr + mid) // q_per_tile + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_begin = tl.load(query_start_ptr + seq)
    num_q = tl.load(query_start_ptr + seq + 1) - q_begin
    local = tile - (q_begin // q_per_tile + seq)
    num_tiles = tl.cdiv(num_q, q_per_tile)
    q0 = (num_tiles - 1 - local) * q_per_tile
    return seq, q_begin, num_q, q0, local, num_tiles


@triton.jit
def _fold(acc_all, m_all, l_all, acc, m, l):
    """Folds one key chunk's partial (acc [R, D], m [R], l [R]: m in log2 units of the scaled
    scores) into the running (acc_all, m_all, l_all). Elementwise only, so the chunked kernel's
    tiles and the fold kernel's single rows compute a row the same way (both without FMA
    contraction). A partial with m = -inf, l = 0, acc = -0 (an empty chunk: the chunks' softmax
    starts from acc = -0) leaves any state unchanged, bit for bit: alpha is 1 or the state is the
    initial one, beta is 0, and x + (-0) = x for every x (with +0, a -0 in acc would turn +0)."""
    m_new = tl.maximum(m_all, m)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_all - m_ref)
    beta = tl.math.exp2(m - m_ref)
    l_all = l_all * alpha + l * beta
    acc_all = acc_all * alpha[:, None] + acc * beta[:, None]
    return acc_all, m_new, l_all


@triton.jit
def _tile_queries(q_ptr, q_begin, num_q, q0, kv_len, kv_head, num_heads, group, q_per_tile,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """A prefill-grid tile's rows: row m is (query q0 + m // group, head kv_head * group +
    m % group). Returns the queries [BLOCK_M, HEAD_DIM], their positions, which rows exist, the
    rows' token, head and offset in q / out, and the positions of the tile's first and last
    queries."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    qi = q0 + offs_m // group
    row_ok = (offs_m < q_per_tile * group) & (qi < num_q)
    q_pos = kv_len - num_q + qi
    tok = q_begin + qi
    head = kv_head * group + offs_m % group
    row_off = tok.to(tl.int64) * (num_heads * HEAD_DIM) + head * HEAD_DIM
    q = tl.load(q_ptr + row_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    qp_first = kv_len - num_q + q0
    qp_last = kv_len - num_q + tl.minimum(q0 + q_per_tile, num_q) - 1
    return q, q_pos, row_ok, tok, head, row_off, qp_first, qp_last


@triton.jit
def paged_attention_prefill_kernel(
        q_ptr, k_pool_ptr, v_pool_ptr, out_ptr,  # bf16
        query_start_ptr, kv_len_ptr, block_table_ptr,  # int32
        scale,  # fp32
        num_seqs, num_heads, num_kv_heads, block_size, max_blocks_per_seq, causal, window,  # i32
        symmetric,  # i32: != 0 (only with window > 0, causal 0): |q_pos - j| < window
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    gdc_wait()  # programmatic dependent launch: the kernel ahead has finished writing q and K/V
    gdc_launch_dependents()
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    group = num_heads // num_kv_heads
    q_per_tile = BLOCK_M // group
    seq, q_begin, num_q, q0, local, num_tiles = _find_tile(tile, query_start_ptr, num_seqs,
                                                           q_per_tile)
    if local >= num_tiles:
        return
    kv_len = tl.load(kv_len_ptr + seq)
    offs_d = tl.arange(0, HEAD_DIM)
    q, q_pos, row_ok, _tok, _head, row_off, qp_first, qp_last = _tile_queries(
        q_ptr, q_begin, num_q, q0, kv_len, kv_head, num_heads, group, q_per_tile, HEAD_DIM, BLOCK_M)
    lo, hi, full_lo, full_hi = _key_ranges(kv_len, qp_first, qp_last, causal, window, symmetric,
                                           BLOCK_N)

    k_ptr, v_ptr, table_ptr, slot_stride = _kv_head_pointers(k_pool_ptr, v_pool_ptr, block_table_ptr, seq,
                                                             kv_head, num_kv_heads, max_blocks_per_seq, HEAD_DIM)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    qk_scale = scale * LOG2E
    acc, m_i, l_i = _attend_span(acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, lo, hi, full_lo,
                                 full_hi, kv_len, q_pos, causal, window, symmetric, block_size,
                                 slot_stride, qk_scale, HEAD_DIM, BLOCK_N)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(out_ptr + row_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def paged_attention_decode_kernel(
        q_ptr, k_pool_ptr, v_pool_ptr, out_ptr,  # bf16
        workspace_ptr,  # fp32, used when num_splits > 1
        query_start_ptr, kv_len_ptr, block_table_ptr,  # int32
        scale,  # fp32
        num_tokens, num_heads, num_kv_heads, block_size, max_blocks_per_seq, causal, window,  # i32
        symmetric,  # i32: as in paged_attention_prefill_kernel
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    gdc_wait()
    gdc_launch_dependents()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    group = num_heads // num_kv_heads

    q_begin = tl.load(query_start_ptr + seq)
    num_q = tl.load(query_start_ptr + seq + 1) - q_begin
    if num_q <= 0:
        return
    kv_len = tl.load(kv_len_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    qi = offs_m // group
    row_ok = qi < num_q
    q_pos = kv_len - num_q + qi
    head = kv_head * group + offs_m % group
    tok = q_begin + qi
    row_off = tok.to(tl.int64) * (num_heads * HEAD_DIM) + head * HEAD_DIM
    q = tl.load(q_ptr + row_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    lo, hi, full_lo, full_hi = _key_ranges(kv_len, kv_len - num_q, kv_len - 1, causal, window,
                                           symmetric, BLOCK_N)
    chunk = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    c0 = tl.minimum(lo + split * chunk, hi)
    c1 = tl.minimum(c0 + chunk, hi)

    k_ptr, v_ptr, table_ptr, slot_stride = _kv_head_pointers(k_pool_ptr, v_pool_ptr, block_table_ptr, seq,
                                                             kv_head, num_kv_heads, max_blocks_per_seq, HEAD_DIM)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    qk_scale = scale * LOG2E
    acc, m_i, l_i = _attend_span(acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, c0, c1, full_lo,
                                 full_hi, kv_len, q_pos, causal, window, symmetric, block_size,
                                 slot_stride, qk_scale, HEAD_DIM, BLOCK_N)

    if num_splits == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(out_ptr + row_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        part = (split * num_tokens + tok).to(tl.int64) * num_heads + head  # [BLOCK_M]
        tl.store(workspace_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None])
        ml_ptr = workspace_ptr + num_splits.to(tl.int64) * num_tokens * num_heads * HEAD_DIM
        tl.store(ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def paged_attention_split_reduce_kernel(
        workspace_ptr,  # fp32, written by paged_attention_decode_kernel
        out_ptr,  # bf16 [T, num_heads, HEAD_DIM]
        num_tokens, num_heads, num_splits,  # i32
        HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr):
    gdc_wait()
    gdc_launch_dependents()
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, MAX_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < num_splits
    part = (offs_s * num_tokens + tok).to(tl.int64) * num_heads + head  # [MAX_SPLITS]
    ml_ptr = workspace_ptr + num_splits.to(tl.int64) * num_tokens * num_heads * HEAD_DIM
    m = tl.load(ml_ptr + part * 2, mask=split_ok, other=float("-inf"))
    l = tl.load(ml_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_ref)
    denom = tl.sum(w * l, 0)
    acc = tl.load(workspace_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=split_ok[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    out = num / tl.where(denom == 0.0, 1.0, denom)
    out_off = (tok.to(tl.int64) * num_heads + head) * HEAD_DIM
    tl.store(out_ptr + out_off + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def paged_attention_chunked_kernel(
        q_ptr, k_pool_ptr, v_pool_ptr, out_ptr,  # bf16
        workspace_ptr,  # fp32, used when split != 0
        query_start_ptr, kv_len_ptr, block_table_ptr,  # int32
        scale,  # fp32
        num_tokens, num_seqs, num_heads, num_kv_heads, block_size, max_blocks_per_seq,  # i32
        causal, window, symmetric,  # i32: as in paged_attention_prefill_kernel
        split,  # i32: != 0: program_id(2) is a key chunk, its partial goes to the workspace
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        KEY_CHUNK: tl.constexpr):
    gdc_wait()
    gdc_launch_dependents()
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    group = num_heads // num_kv_heads
    q_per_tile = BLOCK_M // group
    seq, q_begin, num_q, q0, local, num_tiles = _find_tile(tile, query_start_ptr, num_seqs,
                                                           q_per_tile)
    if local >= num_tiles:
        return
    kv_len = tl.load(kv_len_ptr + seq)
    offs_d = tl.arange(0, HEAD_DIM)
    q, q_pos, row_ok, tok, head, row_off, qp_first, qp_last = _tile_queries(
        q_ptr, q_begin, num_q, q0, kv_len, kv_head, num_heads, group, q_per_tile, HEAD_DIM, BLOCK_M)
    lo, hi, full_lo, full_hi = _key_ranges(kv_len, qp_first, qp_last, causal, window, symmetric,
                                           BLOCK_N)
    k_ptr, v_ptr, table_ptr, slot_stride = _kv_head_pointers(k_pool_ptr, v_pool_ptr, block_table_ptr, seq,
                                                             kv_head, num_kv_heads, max_blocks_per_seq, HEAD_DIM)
    qk_scale = scale * LOG2E

    if split != 0:
        # Chunk p of this tile's key range (empty outside it: m = -inf, l = 0, acc = -0). Chunks
        # past the sequence's keys are not folded (the fold kernel stops before them).
        p = tl.program_id(2)
        num_chunks = tl.num_programs(2)
        if p * KEY_CHUNK >= kv_len:
            return
        c0 = tl.minimum(tl.maximum(lo, p * KEY_CHUNK), hi)
        c1 = tl.maximum(tl.minimum(hi, (p + 1) * KEY_CHUNK), c0)
        acc = tl.full([BLOCK_M, HEAD_DIM], -0.0, dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = _attend_span(acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, c0, c1, full_lo,
                                     full_hi, kv_len, q_pos, causal, window, symmetric,
                                     block_size, slot_stride, qk_scale, HEAD_DIM, BLOCK_N)
        part = (p * num_tokens + tok).to(tl.int64) * num_heads + head  # [BLOCK_M]
        tl.store(workspace_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None])
        ml_ptr = workspace_ptr + num_chunks.to(tl.int64) * num_tokens * num_heads * HEAD_DIM
        tl.store(ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        acc_all = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
        for p in range(lo // KEY_CHUNK, tl.cdiv(hi, KEY_CHUNK)):
            c0 = tl.maximum(lo, p * KEY_CHUNK)
            c1 = tl.minimum(hi, (p + 1) * KEY_CHUNK)
            acc = tl.full([BLOCK_M, HEAD_DIM], -0.0, dtype=tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc, m_i, l_i = _attend_span(acc, m_i, l_i, q, k_ptr, v_ptr, table_ptr, c0, c1,
                                         full_lo, full_hi, kv_len, q_pos, causal, window,
                                         symmetric, block_size, slot_stride, qk_scale, HEAD_DIM,
                                         BLOCK_N)
            acc_all, m_all, l_all = _fold(acc_all, m_all, l_all, acc, m_i, l_i)
        l_safe = tl.where(l_all == 0.0, 1.0, l_all)
        out = acc_all / l_safe[:, None]
        tl.store(out_ptr + row_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit
def paged_attention_chunk_fold_kernel(
        workspace_ptr,  # fp32, written by paged_attention_chunked_kernel with split != 0
        out_ptr,  # bf16 [T, num_heads, HEAD_DIM]
        query_start_ptr, kv_len_ptr,  # int32
        num_tokens, num_seqs, num_heads, num_chunks,  # i32
        HEAD_DIM: tl.constexpr, KEY_CHUNK: tl.constexpr, UNROLL: tl.constexpr):
    """Folds chunks 0 .. cdiv(kv_len, KEY_CHUNK) - 1 of the token's sequence (the later ones hold
    no key of it and were not written), UNROLL chunks loaded at once and then folded one by one;
    a loaded chunk is taken out of its block by a sum with -0 everywhere else (exact)."""
    gdc_wait()
    gdc_launch_dependents()
    tok = tl.program_id(0)
    head = tl.program_id(1)
    # The token's sequence: the first s with query_start[s + 1] > tok.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid + 1) > tok:
            hi = mid
        else:
            lo = mid + 1
    kv_len = tl.load(kv_len_ptr + lo)
    n = tl.minimum(tl.cdiv(tl.maximum(kv_len, 0), KEY_CHUNK), num_chunks)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_u = tl.arange(0, UNROLL)
    ml_ptr = workspace_ptr + num_chunks.to(tl.int64) * num_tokens * num_heads * HEAD_DIM
    acc_all = tl.zeros([1, HEAD_DIM], dtype=tl.float32)
    m_all = tl.full([1], float("-inf"), dtype=tl.float32)
    l_all = tl.zeros([1], dtype=tl.float32)
    for p0 in range(0, n, UNROLL):
        p = p0 + offs_u
        ok = p < n
        part = (p * num_tokens + tok).to(tl.int64) * num_heads + head  # [UNROLL]
        m_blk = tl.load(ml_ptr + part * 2, mask=ok, other=float("-inf"))
        l_blk = tl.load(ml_ptr + part * 2 + 1, mask=ok, other=0.0)
        acc_blk = tl.load(workspace_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None],
                          other=-0.0)
        for i in tl.static_range(UNROLL):
            pick = offs_u == i
            m = tl.sum(tl.where(pick, m_blk, -0.0), 0, keep_dims=True)
            l = tl.sum(tl.where(pick, l_blk, -0.0), 0, keep_dims=True)
            acc = tl.sum(tl.where(pick[:, None], acc_blk, -0.0), 0, keep_dims=True)
            acc_all, m_all, l_all = _fold(acc_all, m_all, l_all, acc, m, l)
    l_safe = tl.where(l_all == 0.0, 1.0, l_all)
    out = acc_all / l_safe[:, None]
    out_off = (tok.to(tl.int64) * num_heads + head) * HEAD_DIM
    tl.store(out_ptr + out_off + offs_d[None, :], out.to(out_ptr.dtype.element_ty))
