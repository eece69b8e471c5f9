// Edge scores of DFlash2's candidate lattice: one CTA per (request, slot), one warp per
// (predecessor row p, candidate c) pair at a time; the warp's lanes split the rank dimension
// (8 bf16 per 16-byte load of each codebook row) and reduce in a fixed order, so every score is
// the same bits in any batch. fp32 accumulation of A[pred] * gate * B[cand]; fp32 out.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

namespace {
constexpr int kEdgeThreads = 256;
constexpr int kEdgeWarps = kEdgeThreads / 32;
}  // namespace

// ids [R, S, K], unary [R, S, K], gate [R, S, rank], anchors [R], codebooks [vocab, rank],
// edges [R, S, K, K]. V = 8 (rank % 8 == 0, aligned codebooks) or 1.
template <int V>
static __global__ void __launch_bounds__(kEdgeThreads)
    edge_scores_kernel(const int32_t* ids, const float* unary, const float* gate, const int32_t* anchors,
                       const __nv_bfloat16* pred_codebook, const __nv_bfloat16* succ_codebook, int slots, int k,
                       int rank, int64_t vocab, float* edges) {
  __shared__ float gate_s[kEdgeMaxRank];
  __shared__ int32_t pred_s[kTopkMaxK], cand_s[kTopkMaxK];
  detail::pdl_begin();
  const int64_t rs = blockIdx.x;  // request * slots + slot
  const int64_t req = rs / slots, s = rs % slots;
  for (int j = threadIdx.x; j < rank; j += kEdgeThreads) gate_s[j] = gate[rs * rank + j];
  for (int p = threadIdx.x; p < k; p += kEdgeThreads) {
    pred_s[p] = s == 0 ? anchors[req] : ids[(rs - 1) * k + p];
    cand_s[p] = ids[rs * k + p];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* u = unary + rs * k;
  float* e = edges + rs * k * k;
  for (int pair = warp; pair < k * k; pair += kEdgeWarps) {
    const int p = pair / k, c = pair % k;
    const int64_t a_id = pred_s[p], b_id = cand_s[c];
    float acc = 0.0f;
    if (a_id >= 0 && a_id < vocab && b_id >= 0 && b_id < vocab) {
      const __nv_bfloat16* a = pred_codebook + a_id * rank;
      const __nv_bfloat16* b = succ_codebook + b_id * rank;
      for (int j = lane * V; j < rank; j += 32 * V) {
        float av[V], bv[V];
        detail::load_bf16<V>(a + j, av);
        detail::load_bf16<V>(b + j, bv);
#pragma unroll
        for (int t = 0; t < V; ++t) acc += av[t] * gate_s[j + t] * bv[t];
      }
    }
    acc = detail::warp_sum(acc);
    if (lane == 0) e[pair] = u[c] + acc;
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
  const bool vec = rank % detail::kVec == 0 && detail::aligned16(pred_codebook) && detail::aligned16(succ_codebook);
  if (vec) {
    detail::launch(&edge_scores_kernel<8>, grid, kEdgeThreads, 0, stream, ids, unary, gate, anchors, pred_codebook,
                   succ_codebook, static_cast<int>(slots), static_cast<int>(k), static_cast<int>(rank), vocab, edges);
  } else {
    detail::launch(&edge_scores_kernel<1>, grid, kEdgeThreads, 0, stream, ids, unary, gate, anchors, pred_codebook,
                   succ_codebook, static_cast<int>(slots), static_cast<int>(k), static_cast<int>(rank), vocab, edges);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
