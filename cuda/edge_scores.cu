// Edge scores of DFlash2's candidate lattice: one CTA per (request, slot). The CTA stages the
// K gated predecessor rows (A[pred] * gate) and the K successor rows (B[cand]) of a chunk of the
// rank dimension in shared memory as fp32 (16-byte codebook loads, all rows at once, so the
// gathers overlap instead of running pair by pair), then each thread accumulates its (p, c)
// pairs over the chunk from shared memory. Every score sums the rank in the same fixed order
// (four interleaved partial sums, chunk after chunk), so it has the same bits in any batch and
// for every predecessor row with the same id. fp32 accumulation; fp32 out.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

namespace {
constexpr int kEdgeThreads = 256;
constexpr int kEdgeMaxPairsPerThread = static_cast<int>(kTopkMaxK * kTopkMaxK) / kEdgeThreads;  // 16
// Dynamic shared memory under the 48 KiB that needs no opt-in, with room for the static ids.
constexpr int kEdgeSmemBytes = 46 * 1024;
constexpr int kEdgePad = 4;  // tile row stride = chunk + 4 floats: 16-byte rows, 8 rows in distinct banks

// Rank elements staged per chunk: as many as fit both K-row tiles in kEdgeSmemBytes, a multiple
// of 32 (so a row stride of chunk + 4 puts the rows of a quarter warp's float4 reads in distinct
// banks), at most the rank rounded up to 32.
int edge_chunk(int64_t k, int64_t rank) {
  int64_t chunk = kEdgeSmemBytes / (2 * k * static_cast<int64_t>(sizeof(float))) - kEdgePad;
  chunk = chunk / 32 * 32;
  const int64_t whole = (rank + 31) / 32 * 32;
  return static_cast<int>(chunk < whole ? chunk : whole);
}
}  // namespace

// ids [R, S, K], unary [R, S, K], gate [R, S, rank], anchors [R], codebooks [vocab, rank],
// edges [R, S, K, K]. V = 8 (rank % 8 == 0, aligned codebooks) or 1. Shared memory: two tiles
// [K, chunk + 4] fp32, read as float4 (four interleaved partial sums per score).
template <int V>
static __global__ void __launch_bounds__(kEdgeThreads)
    edge_scores_kernel(const int32_t* ids, const float* unary, const float* gate, const int32_t* anchors,
                       const __nv_bfloat16* pred_codebook, const __nv_bfloat16* succ_codebook, int slots, int k,
                       int rank, int64_t vocab, int chunk, float* edges) {
  extern __shared__ __align__(16) float tiles[];
  __shared__ int32_t pred_s[kTopkMaxK], cand_s[kTopkMaxK];
  const int stride = chunk + kEdgePad;
  float* a_tile = tiles;              // [K, stride]: A[pred[p], j] * gate[j]
  float* b_tile = tiles + k * stride;  // [K, stride]: B[cand[c], j]
  detail::pdl_begin();
  const int64_t rs = blockIdx.x;  // request * slots + slot
  const int64_t req = rs / slots, s = rs % slots;
  for (int p = threadIdx.x; p < k; p += kEdgeThreads) {
    const int32_t pred = s == 0 ? anchors[req] : ids[(rs - 1) * k + p];
    const int32_t cand = ids[rs * k + p];
    pred_s[p] = pred >= 0 && pred < vocab ? pred : -1;  // -1: a zero codebook row
    cand_s[p] = cand >= 0 && cand < vocab ? cand : -1;
  }
  const float* g = gate + rs * rank;
  const int pairs = k * k;
  float4 acc[kEdgeMaxPairsPerThread];
#pragma unroll
  for (int i = 0; i < kEdgeMaxPairsPerThread; ++i) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

  for (int j0 = 0; j0 < rank; j0 += chunk) {
    const int width = rank - j0 < chunk ? rank - j0 : chunk;
    const int padded = (width + 3) / 4 * 4;  // whole float4s, zero-filled past width
    __syncthreads();  // ids staged (first chunk); the previous chunk's tiles fully read (later ones)
    const int vecs = (padded + V - 1) / V;
    for (int item = threadIdx.x; item < 2 * k * vecs; item += kEdgeThreads) {
      const int side = item / (k * vecs), rest = item % (k * vecs);
      const int row = rest / vecs, col = rest % vecs * V;
      const int32_t id = side == 0 ? pred_s[row] : cand_s[row];
      float v[V];
      if (id >= 0 && col < width) {  // V = 8: width is a multiple of 8 (rank % 8 == 0, chunk % 32 == 0)
        detail::load_bf16<V>((side == 0 ? pred_codebook : succ_codebook) + int64_t{id} * rank + j0 + col, v);
      } else {
#pragma unroll
        for (int t = 0; t < V; ++t) v[t] = 0.0f;
      }
      float* dst = (side == 0 ? a_tile : b_tile) + row * stride + col;
#pragma unroll
      for (int t = 0; t < V; ++t) {
        if (col + t < padded) dst[t] = side == 0 && col + t < width ? v[t] * g[j0 + col + t] : v[t];
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kEdgeMaxPairsPerThread; ++i) {
      const int pair = threadIdx.x + i * kEdgeThreads;
      if (pair < pairs) {
        const float4* a = reinterpret_cast<const float4*>(a_tile + (pair / k) * stride);
        const float4* b = reinterpret_cast<const float4*>(b_tile + (pair % k) * stride);
        for (int j = 0; j < padded / 4; ++j) {
          const float4 x = a[j], y = b[j];
          acc[i].x += x.x * y.x;
          acc[i].y += x.y * y.y;
          acc[i].z += x.z * y.z;
          acc[i].w += x.w * y.w;
        }
      }
    }
  }
  const float* u = unary + rs * k;
  float* e = edges + rs * pairs;
#pragma unroll
  for (int i = 0; i < kEdgeMaxPairsPerThread; ++i) {
    const int pair = threadIdx.x + i * kEdgeThreads;
    if (pair < pairs) e[pair] = u[pair % k] + ((acc[i].x + acc[i].y) + (acc[i].z + acc[i].w));
  }
}

cudaError_t edge_scores(const int32_t* ids, const float* unary, const float* gate, const int32_t* anchors,
                        const __nv_bfloat16* pred_codebook, const __nv_bfloat16* succ_codebook, int64_t num_reqs,
                        int64_t slots, int64_t k, int64_t rank, int64_t vocab, float* edges, cudaStream_t stream) {
  if (num_reqs == 0 || slots == 0) return cudaSuccess;
  if (num_reqs < 0 || slots < 0 || k < 1 || k > kTopkMaxK || rank < 1 || rank > kEdgeMaxRank || vocab < 1 ||
      num_reqs * slots > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  const unsigned grid = static_cast<unsigned>(num_reqs * slots);
  const int chunk = edge_chunk(k, rank);
  const size_t smem = 2 * static_cast<size_t>(k) * (chunk + kEdgePad) * sizeof(float);
  const bool vec = rank % detail::kVec == 0 && detail::aligned16(pred_codebook) && detail::aligned16(succ_codebook);
  if (vec) {
    detail::launch(&edge_scores_kernel<8>, grid, kEdgeThreads, smem, stream, ids, unary, gate, anchors,
                   pred_codebook, succ_codebook, static_cast<int>(slots), static_cast<int>(k),
                   static_cast<int>(rank), vocab, chunk, edges);
  } else {
    detail::launch(&edge_scores_kernel<1>, grid, kEdgeThreads, smem, stream, ids, unary, gate, anchors,
                   pred_codebook, succ_codebook, static_cast<int>(slots), static_cast<int>(k),
                   static_cast<int>(rank), vocab, chunk, edges);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
