// What the two paged decode-attention kernels share (decode_attention.cu: CUDA cores, at most 16
// rows per (sequence, KV head); decode_attention_mma.cu: tensor cores, at most 64 rows): the
// kernel parameters, the key range of one split, the mask, and the combine of the split-KV
// partials by the last CTA of a (sequence, KV head) to finish.
//
// Rows: row r of a (sequence, KV head) is query r / group of the sequence, head
// kv_head * group + r % group; the queries sit at the sequence's last positions, so query i is
// at q_pos = kv_len - num_q + i.
// Split-KV workspace (fp32): acc [num_splits, T, nh, hd] (unnormalised), then ml [num_splits, T,
// nh, 2] (row max m in log2 units of the scaled scores, row sum l).
#pragma once

#include <cfloat>
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/kernels.h"  // DecodeRopeArgs, PagedAttentionArgs

namespace dflash {
namespace cuda {
namespace decode_attention_detail {

constexpr int kMinSplitKeys = 64;  // a split covers at least this many keys
constexpr int kMaxSplits = 32;
constexpr int kCtasPerSm = 2;  // split until about two CTAs per SM

struct Params {
  const __nv_bfloat16* q;
  const __nv_bfloat16* k_pool;
  const __nv_bfloat16* v_pool;
  __nv_bfloat16* out;
  const int32_t* query_start;
  const int32_t* kv_len;
  const int32_t* block_table;
  float* workspace;   // acc [splits, T, nh, hd] then ml [splits, T, nh, 2]
  int32_t* counters;  // [num_seqs, nkv], zero between launches
  int num_tokens, num_heads, num_kv_heads, block_size, max_blocks_per_seq, window;
  bool causal;
  bool symmetric;  // window > 0, not causal: |q_pos - j| < window
  float qk_scale;  // scale * log2(e)
  // The fused prologue of decode_attention_rope (rope.qkv null: q holds the queries, nothing is
  // written). q is then unused; the CTAs build their rows' queries from rope.qkv and write the new
  // tokens' K and V (their key range's, their KV head's) into k_write / v_write (the pools).
  DecodeRopeArgs rope;
  __nv_bfloat16* k_write;
  __nv_bfloat16* v_write;
};

inline Params make_params(const PagedAttentionArgs& a) {
  Params p;
  p.q = static_cast<const __nv_bfloat16*>(a.q);
  p.k_pool = static_cast<const __nv_bfloat16*>(a.k_pool);
  p.v_pool = static_cast<const __nv_bfloat16*>(a.v_pool);
  p.out = static_cast<__nv_bfloat16*>(a.out);
  p.query_start = a.query_start;
  p.kv_len = a.kv_len;
  p.block_table = a.block_table;
  p.workspace = static_cast<float*>(a.workspace);
  p.counters = a.counters;
  p.num_tokens = a.num_tokens;
  p.num_heads = a.num_heads;
  p.num_kv_heads = a.num_kv_heads;
  p.block_size = a.block_size;
  p.max_blocks_per_seq = a.max_blocks_per_seq;
  p.window = a.window;
  // A symmetric window replaces causality (the CPU backend's rule); any other window is causal.
  p.symmetric = a.symmetric_window && a.window > 0;
  p.causal = !p.symmetric && (a.causal || a.window > 0);
  const float scale = a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(a.head_dim));
  p.qk_scale = scale * 1.4426950408889634f;
  p.rope = DecodeRopeArgs{};
  p.k_write = p.v_write = nullptr;
  return p;
}

// The keys [c0, c1) of split `split`, and how many splits have keys (`active`; splits at or past
// it return at once). The rows need keys [lo, kv_len): the last query sits at kv_len - 1, and a
// window (causal or symmetric) drops the keys before the first query's window. Each split takes
// an equal share in multiples of `align` keys, at least kMinSplitKeys, so a short context uses
// fewer splits than the launch has.
struct SplitKeys {
  int c0, c1, active;
};
__device__ __forceinline__ SplitKeys split_keys(const Params& p, int kv_len, int num_q, int split, int num_splits,
                                                int align) {
  int lo = 0;
  if (p.window > 0) lo = max(kv_len - num_q - p.window + 1, 0);
  lo = min(lo, kv_len);
  const int span = kv_len - lo;
  int chunk = (span + num_splits - 1) / num_splits;
  chunk = max((chunk + align - 1) / align * align, kMinSplitKeys);
  SplitKeys s;
  s.active = span > 0 ? (span + chunk - 1) / chunk : 1;
  s.c0 = lo + split * chunk;
  s.c1 = min(s.c0 + chunk, kv_len);
  return s;
}

// Key j (inside the split's range) for a query at q_pos: causal, sliding window, symmetric window.
__device__ __forceinline__ bool key_visible(const Params& p, int j, int q_pos) {
  bool visible = true;
  if (p.causal) visible = j <= q_pos;
  if (p.window > 0) visible = visible && j > q_pos - p.window;
  if (p.symmetric) visible = visible && j < q_pos + p.window;
  return visible;
}

// The output row (token * nh + head) of row r of (q_begin, kv_head).
__device__ __forceinline__ int64_t row_base(const Params& p, int q_begin, int kv_head, int group, int r) {
  return static_cast<int64_t>(q_begin + r / group) * p.num_heads + kv_head * group + r % group;
}

// Element d of row r once the CTA's keys are summed: the output (one active split) or this
// split's partial in the workspace (m written by the thread of d == 0).
template <int HD>
__device__ __forceinline__ void write_row_element(const Params& p, int64_t base, int d, float acc, float m, float l,
                                                  int split, int num_splits, int active) {
  if (active == 1) {
    p.out[base * HD + d] = __float2bfloat16_rn(acc / (l == 0.0f ? 1.0f : l));
    return;
  }
  float* ws_acc = p.workspace;
  float* ws_ml = p.workspace + static_cast<int64_t>(num_splits) * p.num_tokens * p.num_heads * HD;
  const int64_t part = static_cast<int64_t>(split) * p.num_tokens * p.num_heads + base;
  ws_acc[part * HD + d] = acc;
  if (d == 0) {
    ws_ml[part * 2] = m;
    ws_ml[part * 2 + 1] = l;
  }
}

// Called by every thread of every active split's CTA after its partials are written: the last
// CTA of (seq, kv_head) to arrive (an atomic counter, reset by that CTA) combines the partials
// and writes out; the others return. The combine first loads every split's (m, l) per row into
// weights, then each element sums the splits' accumulators in split order (deterministic), the
// loads issued in groups (not one latency per split). scratch: shared memory of at least
// (2 kMaxSplits + 1) * rows_cap floats that no thread reads any more. rows <= rows_cap.
template <int HD>
__device__ void combine_splits(const Params& p, int seq, int kv_head, int q_begin, int group, int rows, int rows_cap,
                               int num_splits, int active, float* scratch) {
  __shared__ int last_s;
  __threadfence();
  __syncthreads();
  int32_t* counter = p.counters + static_cast<int64_t>(seq) * p.num_kv_heads + kv_head;
  if (threadIdx.x == 0) last_s = atomicAdd(counter, 1) == active - 1;
  __syncthreads();
  if (!last_s) return;
  __threadfence();
  // scratch: [kMaxSplits][rows_cap] m, then weights; [kMaxSplits][rows_cap] l; [rows_cap] 1 / den.
  float* w_s = scratch;
  float* lsum_s = w_s + kMaxSplits * rows_cap;
  float* inv_den_s = lsum_s + kMaxSplits * rows_cap;
  const float* ws_acc = p.workspace;
  const float* ws_ml = p.workspace + static_cast<int64_t>(num_splits) * p.num_tokens * p.num_heads * HD;
  const int64_t stride = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  for (int i = threadIdx.x; i < active * rows; i += blockDim.x) {
    const int s = i / rows, r = i % rows;
    const int64_t base = row_base(p, q_begin, kv_head, group, r);
    w_s[s * rows_cap + r] = __ldcg(ws_ml + (s * stride + base) * 2);
    lsum_s[s * rows_cap + r] = __ldcg(ws_ml + (s * stride + base) * 2 + 1);
  }
  __syncthreads();
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    float m_max = -INFINITY;
    for (int s = 0; s < active; ++s) m_max = fmaxf(m_max, w_s[s * rows_cap + r]);
    const float m_ref = m_max == -INFINITY ? 0.0f : m_max;
    float den = 0.0f;
    for (int s = 0; s < active; ++s) {
      const float w = exp2f(w_s[s * rows_cap + r] - m_ref);
      w_s[s * rows_cap + r] = w;
      den += w * lsum_s[s * rows_cap + r];
    }
    inv_den_s[r] = 1.0f / (den == 0.0f ? 1.0f : den);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows * HD; i += blockDim.x) {
    const int r = i / HD, d = i % HD;
    const int64_t base = row_base(p, q_begin, kv_head, group, r);
    float num = 0.0f;
#pragma unroll 8
    for (int s = 0; s < active; ++s) num += w_s[s * rows_cap + r] * __ldcg(ws_acc + (s * stride + base) * HD + d);
    p.out[base * HD + d] = __float2bfloat16_rn(num * inv_den_s[r]);
  }
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (stream-ordered)
}

// The tensor-core kernel (decode_attention_mma.cu) for launches of up to 64 rows per (sequence,
// KV head): launched by decode_attention() with the grid (num_seqs, nkv, splits) it chose.
cudaError_t decode_attention_mma(const Params& p, int head_dim, int rows, dim3 grid, cudaStream_t stream);

}  // namespace decode_attention_detail
}  // namespace cuda
}  // namespace dflash
