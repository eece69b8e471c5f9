// Paged decode attention on the tensor cores for up to 64 rows per (sequence, KV head): the
// verify step (8-16 queries x a GQA group), the DFlash drafter's block of queries, and, when
// forced (PagedAttentionArgs::force_tensor_cores), the AR step's few rows. Same arguments, masks,
// split rule and workspace as the CUDA-core kernel of decode_attention.cu
// (decode_attention_common.cuh); bf16 in, fp32 scores, softmax and accumulation, bf16 out.
//
// One CTA of 4 warps owns (sequence, KV head, split). Its rows, padded to MT tiles of 16
// (MT = 1, 2 or 4), are split over the warps by row tile; the warps that share a row tile (4 / MT
// of them) split the keys of each pass between them and keep their own online softmax, merged
// at the end. Per pass of 64 keys:
//   - K and V of the pass are copied global -> shared with cp.async (the block table gives each
//     key's pool row; 16 bytes per copy, rows padded by 16 bytes so that ldmatrix is free of bank
//     conflicts), two passes in flight: the copies of pass i + 2 are issued when pass i is done;
//   - S = Q K^T on mma.sync m16n8k16 (Q and K through ldmatrix), times scale * log2(e) in fp32,
//     masked (causal, windows, the split's end, rows past the launch's queries);
//   - online softmax in registers (a row's four lanes of a quad reduce with shuffles), exp2;
//   - O += P V with P repacked from the score fragments to bf16 A operands and V through
//     ldmatrix.trans. In a pass where some row masks some key, a V element that is not finite
//     is read as 0: a masked key's p is 0, but 0 * NaN is NaN (a NaN row of a rejected draft
//     behind the query in causal order). A pass that every row sees whole skips the mask and
//     this check (a non-finite V then reaches every row, as it should).
// The warps' partial rows meet in shared memory; one active split writes out, several write
// (m, l, acc) partials, which the last CTA combines (decode_attention_common.cuh) for up to 16
// rows, and a second kernel (decode_attention_mma_combine_kernel, spread over the rows) above.
//
// Programmatic dependent launch: the metadata, the block table and the first pass's keys of earlier
// steps are read before detail::pdl_begin(), everything else after it (the kernel's top says why).
#include <climits>

#include "cuda/common.cuh"
#include "cuda/decode_attention_common.cuh"
#include "cuda/kernels.h"
#include "cuda/tensor_core.cuh"

namespace dflash {
namespace cuda {
namespace decode_attention_detail {

namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = 4;
constexpr int kPassKeys = 64;  // keys per pass (and the split alignment)
constexpr int kStages = 2;     // passes in flight

template <int HD>
struct Layout {
  static constexpr int kStride = HD + 8;  // bf16 per shared row: +16 bytes spreads ldmatrix rows over the banks
  static constexpr int kChunks = HD / 8;  // 16-byte copies per row
  static constexpr size_t kTileBytes = size_t{kPassKeys} * kStride * sizeof(__nv_bfloat16);  // K or V of a pass
  // Shared memory: Q [16 MT][kStride], then kStages x (K, V) [kPassKeys][kStride]. After the
  // last pass the K/V region holds the warps' partial rows, then the split combine's weights.
  __host__ __device__ static constexpr size_t q_bytes(int mt) { return size_t{16} * mt * kStride * sizeof(__nv_bfloat16); }
  __host__ __device__ static constexpr size_t kv_bytes() { return kStages * 2 * kTileBytes; }
  __host__ __device__ static constexpr size_t smem_bytes(int mt) { return q_bytes(mt) + kv_bytes(); }
  // The warps' partial rows: acc [kWarps][16][HD + 4] fp32, m and l [kWarps][16].
  static constexpr int kAccStride = HD + 4;
  static constexpr size_t kPartialFloats = size_t{kWarps} * 16 * kAccStride + 2 * kWarps * 16;
};

// Both the partial rows and the split combine's weights fit in the K/V region.
static_assert(Layout<64>::kPartialFloats * sizeof(float) <= Layout<64>::kv_bytes(), "partials fit");
static_assert(Layout<128>::kPartialFloats * sizeof(float) <= Layout<128>::kv_bytes(), "partials fit");
static_assert((2 * kMaxSplits + 1) * 64 * sizeof(float) <= Layout<64>::kv_bytes(), "combine weights fit");

// Both halves of a bf16x2 word with a non-finite half set to zero (exponent bits all ones).
__device__ __forceinline__ uint32_t finite_or_zero(uint32_t x) {
  uint32_t keep = 0xffffffffu;
  if ((x & 0x7f80u) == 0x7f80u) keep &= 0xffff0000u;
  if ((x & 0x7f800000u) == 0x7f800000u) keep &= 0x0000ffffu;
  return x & keep;
}

// MT: row tiles of 16 (rows of the launch <= 16 MT); 4 / MT warps share a row tile.
template <int HD, int MT>
__global__ void __launch_bounds__(kThreads) decode_attention_mma_kernel(Params p) {
  using L = Layout<HD>;
  constexpr int kGroups = kWarps / MT;    // key groups: the warps of one row tile
  constexpr int KW = kPassKeys / kGroups;  // keys per warp per pass (16 MT)
  constexpr int NT = KW / 8;               // score tiles of 8 keys per warp
  constexpr int DT = HD / 8;               // output tiles of 8 dims
  constexpr int ROWS = 16 * MT;
  constexpr int S = L::kStride;
  static_assert(NT % 2 == 0 && DT % 2 == 0, "ldmatrix x4 loads two tiles at once");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* kv_s = reinterpret_cast<__nv_bfloat16*>(smem_raw + L::q_bytes(MT));

  // Before the wait for the kernel ahead (programmatic launch) the CTA reads the batch's metadata
  // and the block table and copies the first pass's keys of earlier steps, as the CUDA-core kernel's
  // staged and fused versions do (decode_attention.cu says why nothing ahead writes them); Q and
  // this step's keys (the last num_q, written by the K/V write right before) come after it.
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rt = warp % MT, kgroup = warp / MT;
  const int seq = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z, num_splits = gridDim.z;
  const int q_begin = p.query_start[seq];
  const int num_q = p.query_start[seq + 1] - q_begin;
  // A CTA leaving before its wait waits first: a grid of such CTAs alone must still end after the
  // kernel ahead, which a kernel behind it that waits on this one relies on.
  if (num_q <= 0) {
    detail::pdl_begin();
    return;
  }
  const int group = p.num_heads / p.num_kv_heads;
  const int rows = min(num_q * group, ROWS);
  const int kv_len = max(p.kv_len[seq], 0);
  const SplitKeys keys = split_keys(p, kv_len, num_q, split, num_splits, kPassKeys);
  if (split >= keys.active) {
    detail::pdl_begin();
    return;
  }
  const int c0 = keys.c0, c1 = keys.c1;
  const int num_passes = (c1 - c0 + kPassKeys - 1) / kPassKeys;
  const int32_t* table = p.block_table + static_cast<int64_t>(seq) * p.max_blocks_per_seq;

  // The copies of a pass's keys j in [from, to) (the first pass in two calls, either side of the wait).
  auto load_pass = [&](int pass, int from = 0, int to = INT_MAX) {
    const int pass0 = c0 + pass * kPassKeys;
    __nv_bfloat16* k_dst = kv_s + (pass % kStages) * 2 * kPassKeys * S;
    __nv_bfloat16* v_dst = k_dst + kPassKeys * S;
    for (int c = tid; c < kPassKeys * L::kChunks; c += kThreads) {
      const int key = c / L::kChunks, part = c % L::kChunks, j = pass0 + key;
      if (j < from || j >= to) continue;
      const bool ok = j < c1;  // keys past the split read as zeros (and are masked)
      int64_t off = 0;
      if (ok) {
        const int blk = __ldg(table + j / p.block_size);
        off = ((static_cast<int64_t>(blk) * p.block_size + j % p.block_size) * p.num_kv_heads + kv_head) * HD +
              part * 8;
      }
      cp_async16(smem_addr(k_dst + key * S + part * 8), p.k_pool + off, ok);
      cp_async16(smem_addr(v_dst + key * S + part * 8), p.v_pool + off, ok);
    }
  };
  const int first_new = kv_len - num_q;  // this step's keys: [first_new, kv_len)
  if (num_passes > 0) load_pass(0, 0, first_new);
  cp_async_commit();
  detail::pdl_begin();
  // Q rows (zeros past `rows`), in the next copy group with the rest of pass 0.
  for (int c = tid; c < ROWS * L::kChunks; c += kThreads) {
    const int r = c / L::kChunks, part = c % L::kChunks;
    const bool ok = r < rows;
    const __nv_bfloat16* src = ok ? p.q + row_base(p, q_begin, kv_head, group, r) * HD + part * 8 : p.q;
    cp_async16(smem_addr(q_s + r * S + part * 8), src, ok);
  }
  if (num_passes > 0 && first_new < c0 + kPassKeys) load_pass(0, first_new, INT_MAX);
  for (int pass = 0; pass < kStages - 1; ++pass) {
    if (pass > 0 && pass < num_passes) load_pass(pass);
    cp_async_commit();  // empty groups too: the wait counts stay uniform (the first pass's copies are two groups)
  }

  // This lane's two rows of its warp's tile: g and g + 8 (mma fragment rows), lanes 4g..4g+3.
  const int g = lane >> 2, quad = lane & 3;
  int row[2], q_pos[2];
  bool row_ok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = 16 * rt + g + 8 * h;
    row_ok[h] = row[h] < rows;
    q_pos[h] = kv_len - num_q + row[h] / group;
  }
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // l: this lane's share
  float acc[DT][4];
#pragma unroll
  for (int t = 0; t < DT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[t][e] = 0.0f;

  // A pass whose every key every row sees (rows past `rows` are never written): no mask, and a
  // non-finite V reaches the rows that see it, as it should.
  const int first_q = kv_len - num_q, last_q = kv_len - 1;
  auto pass_is_full = [&](int pass0) {
    const int last = pass0 + kPassKeys - 1;
    bool full = last < c1;
    if (p.causal) full = full && last <= first_q;
    if (p.window > 0) full = full && pass0 > last_q - p.window;
    if (p.symmetric) full = full && last < first_q + p.window;
    return full;
  };
  const int key0 = kgroup * KW;  // this warp's first key of each pass
  const int mi = lane >> 3;      // ldmatrix: the matrix this lane addresses a row of
  for (int pass = 0; pass < num_passes; ++pass) {
    if (pass + kStages - 1 < num_passes) load_pass(pass + kStages - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // groups land in order: this pass's copies (and Q) are here
    __syncthreads();
    const __nv_bfloat16* k_s = kv_s + (pass % kStages) * 2 * kPassKeys * S;
    const __nv_bfloat16* v_s = k_s + kPassKeys * S;

    // S = Q K^T over this warp's KW keys.
    float s[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[t][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, smem_addr(q_s + (16 * rt + (lane & 15)) * S + kk * 16 + (lane >> 4) * 8));
#pragma unroll
      for (int t = 0; t < NT; t += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, smem_addr(k_s + (key0 + 8 * t + (mi >> 1) * 8 + (lane & 7)) * S + kk * 16 + (mi & 1) * 8));
        mma_bf16(s[t], a[0], a[1], a[2], a[3], b[0], b[1]);
        mma_bf16(s[t + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
      }
    }

    // Scale, mask (only where a key of the pass is hidden from some row: the causal diagonal, a
    // window's edge, the split's end), online softmax (each row's 4 lanes of the quad share m).
    const int pass0 = c0 + pass * kPassKeys;
    const bool full = pass_is_full(pass0);
    float mx[2] = {-INFINITY, -INFINITY};
    if (full) {
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[t][e] *= p.qk_scale;
          mx[e >> 1] = fmaxf(mx[e >> 1], s[t][e]);
        }
    } else {
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1, j = pass0 + key0 + 8 * t + 2 * quad + (e & 1);
          const bool visible = row_ok[h] && j < c1 && key_visible(p, j, q_pos[h]);
          s[t][e] = visible ? s[t][e] * p.qk_scale : -INFINITY;
          mx[h] = fmaxf(mx[h], s[t][e]);
        }
    }
    float alpha[2], m_ref[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float m_new = fmaxf(m_run[h], mx[h]);
      m_ref[h] = m_new == -INFINITY ? 0.0f : m_new;
      alpha[h] = exp2f(m_run[h] - m_ref[h]);
      m_run[h] = m_new;
    }
    float sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[t][e] = exp2f(s[t][e] - m_ref[e >> 1]);
        sum[e >> 1] += s[t][e];
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + sum[h];
#pragma unroll
    for (int t = 0; t < DT; ++t) {
      acc[t][0] *= alpha[0];
      acc[t][1] *= alpha[0];
      acc[t][2] *= alpha[1];
      acc[t][3] *= alpha[1];
    }

    // O += P V: k-step u covers keys 16u .. 16u + 15 of the warp's share (score tiles 2u, 2u + 1).
#pragma unroll
    for (int u = 0; u < NT / 2; ++u) {
      const uint32_t a0 = pack_bf16x2(s[2 * u][0], s[2 * u][1]), a1 = pack_bf16x2(s[2 * u][2], s[2 * u][3]);
      const uint32_t a2 = pack_bf16x2(s[2 * u + 1][0], s[2 * u + 1][1]);
      const uint32_t a3 = pack_bf16x2(s[2 * u + 1][2], s[2 * u + 1][3]);
#pragma unroll
      for (int t = 0; t < DT; t += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, smem_addr(v_s + (key0 + 16 * u + (mi & 1) * 8 + (lane & 7)) * S + 8 * t + (mi >> 1) * 8));
        if (!full) {  // a masked key's p is 0, and 0 * NaN is NaN
#pragma unroll
          for (int i = 0; i < 4; ++i) b[i] = finite_or_zero(b[i]);
        }
        mma_bf16(acc[t], a0, a1, a2, a3, b[0], b[1]);
        mma_bf16(acc[t + 1], a0, a1, a2, a3, b[2], b[3]);
      }
    }
    __syncthreads();  // the stage is rewritten by the copies issued next pass
  }
  cp_async_wait<0>();
  __syncthreads();

  // The warps' partial rows -> shared memory (K/V region, free now).
  float* acc_s = reinterpret_cast<float*>(kv_s);  // [kWarps][16][kAccStride]
  float* m_s = acc_s + kWarps * 16 * L::kAccStride;
  float* l_s = m_s + kWarps * 16;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
    if (quad == 0) {
      m_s[warp * 16 + g + 8 * h] = m_run[h];
      l_s[warp * 16 + g + 8 * h] = l_run[h];
    }
  }
#pragma unroll
  for (int t = 0; t < DT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc_s[(warp * 16 + g + 8 * (e >> 1)) * L::kAccStride + 8 * t + 2 * quad + (e & 1)] = acc[t][e];
    }
  __syncthreads();

  // Each row element: the warps of its row tile merged (key groups in order), then written out
  // or as this split's partial.
  for (int i = tid; i < rows * HD; i += kThreads) {
    const int r = i / HD, d = i % HD, tile = r / 16, rl = r % 16;
    float m_max = -INFINITY;
#pragma unroll
    for (int k = 0; k < kGroups; ++k) m_max = fmaxf(m_max, m_s[(tile + MT * k) * 16 + rl]);
    const float m_ref = m_max == -INFINITY ? 0.0f : m_max;
    float a = 0.0f, l = 0.0f;
#pragma unroll
    for (int k = 0; k < kGroups; ++k) {
      const int w = tile + MT * k;
      const float scale = kGroups == 1 ? 1.0f : exp2f(m_s[w * 16 + rl] - m_ref);
      a += scale * acc_s[(w * 16 + rl) * L::kAccStride + d];
      l += scale * l_s[w * 16 + rl];
    }
    write_row_element<HD>(p, row_base(p, q_begin, kv_head, group, r), d, a, m_max, l, split, num_splits,
                          keys.active);
  }
  if (MT == 1 && keys.active > 1) {
    combine_splits<HD>(p, seq, kv_head, q_begin, group, rows, ROWS, num_splits, keys.active,
                       reinterpret_cast<float*>(kv_s));
  }
}

// The split combine of launches with more than 16 rows per (sequence, KV head), a second kernel:
// one CTA (the last to finish) reading every split's partial of 64 rows took ~40 us on the H200;
// here thread i of CTA (seq, kv_head, z) owns 4 dims of row z * kRowsPerCta + i / (HD / 4) and
// reads the splits' (m, l, acc) in split order with an online rescale (loads of 8 splits in
// flight). A sequence with one active split was written out by the attention kernel.
template <int HD>
__global__ void __launch_bounds__(kThreads) decode_attention_mma_combine_kernel(Params p, int rows_cap,
                                                                                  int num_splits) {
  constexpr int kVecsPerRow = HD / 4;
  constexpr int kRowsPerCta = kThreads / kVecsPerRow;
  detail::pdl_begin();
  const int seq = blockIdx.x, kv_head = blockIdx.y;
  const int q_begin = p.query_start[seq];
  const int num_q = p.query_start[seq + 1] - q_begin;
  const int rows = min(num_q * (p.num_heads / p.num_kv_heads), rows_cap);
  const int r = blockIdx.z * kRowsPerCta + threadIdx.x / kVecsPerRow;
  if (num_q <= 0 || r >= rows) return;
  const int active = split_keys(p, max(p.kv_len[seq], 0), num_q, 0, num_splits, kPassKeys).active;
  if (active <= 1) return;
  const int d = (threadIdx.x % kVecsPerRow) * 4;
  const int64_t base = row_base(p, q_begin, kv_head, p.num_heads / p.num_kv_heads, r);
  const int64_t stride = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  const float* ws_acc = p.workspace;
  const float* ws_ml = p.workspace + static_cast<int64_t>(num_splits) * stride * HD;
  float m_run = -INFINITY, den = 0.0f;
  float4 num = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
  for (int s = 0; s < active; ++s) {
    const float2 ml = __ldcg(reinterpret_cast<const float2*>(ws_ml + (s * stride + base) * 2));
    const float4 a = __ldcg(reinterpret_cast<const float4*>(ws_acc + (s * stride + base) * HD + d));
    if (ml.x == -INFINITY) continue;  // no key of this split is visible to the row
    const float m_new = fmaxf(m_run, ml.x);
    const float old = exp2f(m_run - m_new), w = exp2f(ml.x - m_new);
    num.x = num.x * old + w * a.x;
    num.y = num.y * old + w * a.y;
    num.z = num.z * old + w * a.z;
    num.w = num.w * old + w * a.w;
    den = den * old + w * ml.y;
    m_run = m_new;
  }
  const float inv = 1.0f / (den == 0.0f ? 1.0f : den);
  __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(p.out + base * HD + d);
  out[0] = __floats2bfloat162_rn(num.x * inv, num.y * inv);
  out[1] = __floats2bfloat162_rn(num.z * inv, num.w * inv);
}

using KernelFn = void (*)(Params);

template <int HD>
cudaError_t launch_mma(const Params& p, int rows, dim3 grid, cudaStream_t stream) {
  KernelFn kernel = decode_attention_mma_kernel<HD, 4>;
  int mt = 4;
  if (rows <= 16) {
    kernel = decode_attention_mma_kernel<HD, 1>;
    mt = 1;
  } else if (rows <= 32) {
    kernel = decode_attention_mma_kernel<HD, 2>;
    mt = 2;
  }
  const size_t smem = Layout<HD>::smem_bytes(mt);
  // Above the 48 KB default (every shape here): raise the kernel's dynamic limit.
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  cudaError_t l = detail::launch(kernel, grid, dim3(kThreads), smem, stream, p);
  if (l != cudaSuccess || mt == 1 || grid.z == 1) return l != cudaSuccess ? l : cudaGetLastError();
  constexpr int kRowsPerCta = kThreads / (HD / 4);
  const dim3 combine_grid(grid.x, grid.y, static_cast<unsigned>((16 * mt + kRowsPerCta - 1) / kRowsPerCta));
  l = detail::launch(decode_attention_mma_combine_kernel<HD>, combine_grid, dim3(kThreads), 0, stream, p, 16 * mt,
                     static_cast<int>(grid.z));
  return l != cudaSuccess ? l : cudaGetLastError();
}

}  // namespace

cudaError_t decode_attention_mma(const Params& p, int head_dim, int rows, dim3 grid, cudaStream_t stream) {
  if (rows < 1 || rows > 64) return cudaErrorInvalidValue;
  return head_dim == 128 ? launch_mma<128>(p, rows, grid, stream) : launch_mma<64>(p, rows, grid, stream);
}

}  // namespace decode_attention_detail
}  // namespace cuda
}  // namespace dflash
