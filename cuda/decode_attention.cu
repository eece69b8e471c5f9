// Paged decode attention for few query rows per (sequence, KV head): the AR decode step (one
// query per sequence, a GQA group of rows) and other launches with max_query_len * group <= 16
// run on CUDA cores here; launches of 17..64 rows (the verify step, the drafter's block) go to the
// tensor-core kernel of decode_attention_mma.cu (decode_attention() picks; one set of arguments,
// split rule and workspace for both, decode_attention_common.cuh).
// Same inputs and masks as the Triton kernels (triton_kernels/paged_attention.py): q [T, nh, hd],
// pools [num_blocks, block_size, nkv, hd], ragged query_start / kv_len / block_table, causal,
// non-causal, sliding-window or symmetric-window masks; bf16 in, fp32 softmax and accumulation,
// bf16 out.
//
// Why a hand-written kernel: at small batch the step's attention is latency-bound (a few
// kilobytes of K/V per CTA), and the Triton decode kernel serialises its latencies (block table,
// then K, then the scores, then V). Here one CTA of 4 warps owns (sequence, KV head, split):
//   - it issues the loads of a pass of 64 keys (K and V together: V does not depend on the
//     scores) and of the next pass before it computes on the current one;
//   - QK: two threads per key (half of head_dim each, a shuffle adds them), q in shared memory
//     pre-scaled by scale * log2(e), the scores of the pass go to shared memory;
//   - online softmax per row over the pass (8 threads per row), exp2 in fp32;
//   - PV: warp w owns keys [16 w, 16 w + 16) of the pass and lane l head dims [l hd/32, ...);
//     the warps' sums meet in shared memory at the end.
// Split-KV: the launch has num_splits CTAs per (sequence, KV head) (fixed, so a CUDA graph can
// hold it); each CTA takes an equal share of the sequence's actual key range in whole passes'
// multiples of 16 keys (at least 64 keys), so a short context uses fewer splits. Splits write
// (m, l, acc) partials to the workspace; the last CTA of a (sequence, KV head) to finish (an
// atomic counter, reset by that CTA) combines them and writes out, so there is no second launch.
// Deterministic: the combine sums the splits in index order.
//
// Programmatic dependent launch: detail::pdl_begin() before any memory access.
#include <algorithm>
#include <cfloat>
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/decode_attention_common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

namespace {

using namespace decode_attention_detail;

constexpr int kThreads = 128;        // 4 warps
constexpr int kPassKeys = 64;        // keys per pass: 2 threads per key in QK, 16 per warp in PV
constexpr int kCudaCoreMaxRows = 16;  // rows per (sequence, KV head) of this kernel; above: tensor cores

// The per-lane V piece of one key: hd / 32 bf16 (HD 128: 8 bytes, HD 64: 4 bytes).
template <int HD>
struct VPiece;
template <>
struct VPiece<128> {
  using T = uint2;
  static __device__ __forceinline__ void to_f32(const T& v, float (&f)[4]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
    const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
    f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
  }
};
template <>
struct VPiece<64> {
  using T = uint32_t;
  static __device__ __forceinline__ void to_f32(const T& v, float (&f)[2]) {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
    f[0] = a.x, f[1] = a.y;
  }
};

// The loads of one pass for this thread: K (its key, its half of hd) and V (its warp's 16 keys,
// its lane's dims). Keys outside [c0, c1) read as zeros.
template <int HD>
struct PassLoads {
  static constexpr int kKVecs = HD / 2 / 8;  // 16-byte K loads per thread
  uint4 k[kKVecs];
  typename VPiece<HD>::T v[16];
};

template <int HD>
__device__ __forceinline__ void load_pass(const Params& p, const int32_t* table, int kv_head, int pass0, int c1,
                                          PassLoads<HD>& out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Lane e < 16 of warp w looks up key 16 w + e; shuffles hand the slot to the lanes that need it.
  const int my_key = pass0 + 16 * warp + (lane & 15);
  int64_t my_row = -1;  // the key's row in the pool (slot * nkv + kv_head), -1 outside the range
  if (my_key < c1) {
    const int blk = __ldg(table + my_key / p.block_size);
    my_row = (static_cast<int64_t>(blk) * p.block_size + my_key % p.block_size) * p.num_kv_heads + kv_head;
  }
  // QK: thread (warp w, lane l) owns key 16 w + l / 2, half l % 2 of hd.
  const int64_t k_row = __shfl_sync(0xffffffffu, my_row, lane >> 1);
  const int half = lane & 1;
  if (k_row >= 0) {
    const uint4* src = reinterpret_cast<const uint4*>(p.k_pool + k_row * HD + half * (HD / 2));
#pragma unroll
    for (int i = 0; i < PassLoads<HD>::kKVecs; ++i) out.k[i] = __ldg(src + i);
  } else {
#pragma unroll
    for (int i = 0; i < PassLoads<HD>::kKVecs; ++i) out.k[i] = make_uint4(0, 0, 0, 0);
  }
  using VT = typename VPiece<HD>::T;
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    const int64_t v_row = __shfl_sync(0xffffffffu, my_row, e);
    if (v_row >= 0) {
      out.v[e] = __ldg(reinterpret_cast<const VT*>(p.v_pool + v_row * HD) + lane);
    } else {
      out.v[e] = VT{};
    }
  }
}

// RB: row capacity (a multiple of 4, <= kCudaCoreMaxRows); the launch's rows = max_query_len * group <= RB.
template <int HD, int RB>
__global__ void __launch_bounds__(kThreads) decode_attention_kernel(Params p) {
  constexpr int DL = HD / 32;           // head dims per lane in PV
  constexpr int QS = HD / 2 + 4;        // q_s half-row stride (the halves on different banks)
  __shared__ __align__(16) float q_s[RB][2][QS];
  __shared__ float s_s[RB][kPassKeys + 1];
  __shared__ float m_s[RB], l_s[RB], alpha_s[RB];
  __shared__ __align__(16) float red_s[4][RB][HD];
  static_assert((2 * kMaxSplits + 1) * RB <= 4 * RB * HD, "the combine's weights fit in red_s");

  detail::pdl_begin();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int seq = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z, num_splits = gridDim.z;
  const int q_begin = p.query_start[seq];
  const int num_q = p.query_start[seq + 1] - q_begin;
  if (num_q <= 0) return;
  const int group = p.num_heads / p.num_kv_heads;
  const int rows = min(num_q * group, RB);
  const int kv_len = max(p.kv_len[seq], 0);

  const SplitKeys keys = split_keys(p, kv_len, num_q, split, num_splits, 16);
  if (split >= keys.active) return;
  const int c0 = keys.c0, c1 = keys.c1, active = keys.active;

  // The first pass's K/V loads (HBM) go out before Q is staged (L2), so their latencies overlap.
  const int32_t* table = p.block_table + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  PassLoads<HD> cur, nxt;
  if (c0 < c1) load_pass<HD>(p, table, kv_head, c0, c1, cur);

  for (int i = tid; i < RB * HD; i += kThreads) {
    const int r = i / HD, d = i % HD;
    float v = 0.0f;
    if (r < rows) {
      const int tok = q_begin + r / group, head = kv_head * group + r % group;
      v = __bfloat162float(p.q[(static_cast<int64_t>(tok) * p.num_heads + head) * HD + d]) * p.qk_scale;
    }
    q_s[r][d / (HD / 2)][d % (HD / 2)] = v;
  }
  if (tid < RB) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  float acc[RB][DL];
#pragma unroll
  for (int r = 0; r < RB; ++r)
#pragma unroll
    for (int d = 0; d < DL; ++d) acc[r][d] = 0.0f;

  __syncthreads();

  const int half = lane & 1, kk = 16 * warp + (lane >> 1);  // QK: this thread's key in the pass
  const int srow = tid >> 3, ssub = tid & 7;                 // softmax: 8 threads per row
  for (int pass0 = c0; pass0 < c1; pass0 += kPassKeys) {
    if (pass0 + kPassKeys < c1) load_pass<HD>(p, table, kv_head, pass0 + kPassKeys, c1, nxt);

    // QK: partial dot over this thread's half of hd, then the pair's sum.
    float part[RB];
#pragma unroll
    for (int r = 0; r < RB; ++r) part[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < PassLoads<HD>::kKVecs; ++c) {
      const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&cur.k[c]);
      float kf[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 t = __bfloat1622float2(h2[e]);
        kf[2 * e] = t.x, kf[2 * e + 1] = t.y;
      }
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        const float4 qa = *reinterpret_cast<const float4*>(&q_s[r][half][8 * c]);
        const float4 qb = *reinterpret_cast<const float4*>(&q_s[r][half][8 * c + 4]);
        part[r] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] + qb.y * kf[5] +
                   qb.z * kf[6] + qb.w * kf[7];
      }
    }
    const int j = pass0 + kk;
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      const float s = part[r] + __shfl_xor_sync(0xffffffffu, part[r], 1);
      if ((r & 1) == half) {  // the pair writes alternate rows
        const bool visible = r < rows && j < c1 && key_visible(p, j, kv_len - num_q + r / group);
        s_s[r][kk] = visible ? s : -INFINITY;
      }
    }
    __syncthreads();

    // Online softmax over the pass: 8 threads per row (rows >= RB idle but shuffle along).
    {
      const bool row_ok = srow < RB;
      float sv[8], mx = -INFINITY;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        sv[e] = row_ok ? s_s[srow][ssub * 8 + e] : -INFINITY;
        mx = fmaxf(mx, sv[e]);
      }
#pragma unroll
      for (int o = 4; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = row_ok ? m_s[srow] : -INFINITY;
      const float m_new = fmaxf(m_old, mx);
      const float m_ref = m_new == -INFINITY ? 0.0f : m_new;
      float sum = 0.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float pe = exp2f(sv[e] - m_ref);
        sum += pe;
        if (row_ok) s_s[srow][ssub * 8 + e] = pe;
      }
#pragma unroll
      for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (row_ok && ssub == 0) {
        const float alpha = exp2f(m_old - m_ref);
        m_s[srow] = m_new;
        l_s[srow] = l_s[srow] * alpha + sum;
        alpha_s[srow] = alpha;
      }
    }
    __syncthreads();

    // PV over this warp's 16 keys of the pass.
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      const float alpha = alpha_s[r];
#pragma unroll
      for (int d = 0; d < DL; ++d) acc[r][d] *= alpha;
    }
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      float vf[DL];
      VPiece<HD>::to_f32(cur.v[e], vf);
      // A key masked for a row has pe = 0, but 0 * NaN is NaN: a non-finite value (a NaN row
      // of another query behind it in causal order) adds nothing. Finite values pass unchanged.
#pragma unroll
      for (int d = 0; d < DL; ++d) vf[d] = fabsf(vf[d]) <= FLT_MAX ? vf[d] : 0.0f;
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        const float pe = s_s[r][16 * warp + e];
#pragma unroll
        for (int d = 0; d < DL; ++d) acc[r][d] += pe * vf[d];
      }
    }
    cur = nxt;
    __syncthreads();  // s_s and alpha_s are rewritten by the next pass
  }

  // The warps' sums.
#pragma unroll
  for (int r = 0; r < RB; ++r)
#pragma unroll
    for (int d = 0; d < DL; ++d) red_s[warp][r][lane * DL + d] = acc[r][d];
  __syncthreads();

  for (int i = tid; i < rows * HD; i += kThreads) {
    const int r = i / HD, d = i % HD;
    const float a = red_s[0][r][d] + red_s[1][r][d] + red_s[2][r][d] + red_s[3][r][d];
    write_row_element<HD>(p, row_base(p, q_begin, kv_head, group, r), d, a, m_s[r], l_s[r], split, num_splits,
                          active);
  }
  if (active > 1) combine_splits<HD>(p, seq, kv_head, q_begin, group, rows, RB, num_splits, active, &red_s[0][0][0]);
}

using KernelFn = void (*)(Params);

template <int HD>
KernelFn pick_rows(int rows) {
  if (rows <= 4) return decode_attention_kernel<HD, 4>;
  if (rows <= 8) return decode_attention_kernel<HD, 8>;
  return decode_attention_kernel<HD, 16>;
}

int num_sms() {
  static const int sms = [] {
    int device = 0, n = 132;
    if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    return n;
  }();
  return sms;
}

int clamp_splits(int64_t s) { return static_cast<int>(s < 1 ? 1 : s > kMaxSplits ? kMaxSplits : s); }

}  // namespace

int decode_attention_max_splits() { return kMaxSplits; }

size_t decode_attention_workspace_bytes(int64_t num_tokens, int64_t num_heads, int64_t head_dim, int splits) {
  return static_cast<size_t>(splits) * num_tokens * num_heads * (head_dim + 2) * sizeof(float);
}

const char* decode_attention_check(const PagedAttentionArgs& a) {
  if (a.head_dim != 64 && a.head_dim != 128) return "head_dim must be 64 or 128";
  if (a.num_kv_heads <= 0 || a.num_heads <= 0 || a.num_heads % a.num_kv_heads != 0) {
    return "num_heads must be a positive multiple of num_kv_heads";
  }
  if (a.max_query_len < 0 || int64_t{a.max_query_len} * (a.num_heads / a.num_kv_heads) > kDecodeAttentionMaxRows) {
    return "max_query_len * (num_heads / num_kv_heads) exceeds kDecodeAttentionMaxRows";
  }
  if (a.block_size <= 0 || a.max_blocks_per_seq < 0 || a.num_seqs < 0 || a.num_tokens < 0 || a.window < 0) {
    return "negative sizes, or block_size <= 0";
  }
  if (!detail::aligned16(a.q) || !detail::aligned16(a.k_pool) || !detail::aligned16(a.v_pool)) {
    return "q and the pools must be 16-byte aligned";
  }
  return nullptr;
}

int decode_attention_splits(const PagedAttentionArgs& a) {
  if (a.force_splits > 0) return a.force_splits;
  if (a.workspace == nullptr || a.counters == nullptr ||
      int64_t{a.num_seqs} * a.num_kv_heads > a.counter_slots) {
    return 1;
  }
  int64_t span = a.max_kv_len;
  if (a.window > 0) span = std::min<int64_t>(span, int64_t{a.window} + a.max_query_len);
  const int64_t ctas = std::max<int64_t>(int64_t{a.num_seqs} * a.num_kv_heads, 1);
  const int64_t target = int64_t{kCtasPerSm} * num_sms();
  int64_t splits = std::min<int64_t>((target + ctas - 1) / ctas, span / kMinSplitKeys);
  while (splits > 1 && decode_attention_workspace_bytes(a.num_tokens, a.num_heads, a.head_dim,
                                                        static_cast<int>(splits)) > a.workspace_bytes) {
    --splits;
  }
  return clamp_splits(splits);
}

cudaError_t decode_attention(const PagedAttentionArgs& a, cudaStream_t stream) {
  if (decode_attention_check(a) != nullptr) return cudaErrorInvalidValue;
  if (a.num_seqs == 0 || a.num_tokens == 0) return cudaSuccess;
  const int splits = decode_attention_splits(a);
  if (splits > kMaxSplits) return cudaErrorInvalidValue;
  if (splits > 1 && (a.counters == nullptr || int64_t{a.num_seqs} * a.num_kv_heads > a.counter_slots ||
                     a.workspace == nullptr ||
                     decode_attention_workspace_bytes(a.num_tokens, a.num_heads, a.head_dim, splits) >
                         a.workspace_bytes)) {
    return cudaErrorInvalidValue;
  }
  const Params p = make_params(a);
  const int rows = a.max_query_len * (a.num_heads / a.num_kv_heads);
  const dim3 grid(static_cast<unsigned>(a.num_seqs), static_cast<unsigned>(a.num_kv_heads),
                  static_cast<unsigned>(splits));
  if (rows > kCudaCoreMaxRows || a.force_tensor_cores) return decode_attention_mma(p, a.head_dim, rows, grid, stream);
  KernelFn kernel = a.head_dim == 128 ? pick_rows<128>(rows) : pick_rows<64>(rows);
  const cudaError_t e = detail::launch(kernel, grid, dim3(kThreads), 0, stream, p);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
