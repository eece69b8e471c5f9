// Exact re-score of DFlash2 candidates picked on the FP8 head (rescore_candidates of kernels.h):
// one CTA of 8 warps per row; each warp takes candidates j, j + 8, ... and dots the row's hidden
// state with the exact LM-head row of the candidate (16-byte bf16 loads, fp32 accumulation, a
// fixed-order butterfly), then thread j ranks candidate j among the K (value descending, lowest
// id first on ties, NaN last: topk_candidates' order) and writes it to its place. Cost: K rows
// of the head per row (K 16, H 4096: 128 KB), a few microseconds for a step's rows.
#include <math.h>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxK = static_cast<int>(kTopkMaxK);

// a ranks before b (values va, vb; ids ia, ib; positions pa, pb break exact duplicates).
__device__ __forceinline__ bool ranks_before(float va, int ia, int pa, float vb, int ib, int pb) {
  const bool na = isnan(va), nb = isnan(vb);
  if (na != nb) return nb;
  if (!na && va != vb) return va > vb;
  return ia != ib ? ia < ib : pa < pb;
}

__global__ void __launch_bounds__(kThreads) rescore_candidates_kernel(const __nv_bfloat16* __restrict__ h,
                                                                      const __nv_bfloat16* __restrict__ head, int k,
                                                                      int hidden, int vocab, float multiplier,
                                                                      float softcap, int32_t* __restrict__ ids,
                                                                      float* __restrict__ unary) {
  __shared__ int32_t cand[kMaxK];
  __shared__ float value[kMaxK];
  detail::pdl_begin();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x;
  if (threadIdx.x < k) cand[threadIdx.x] = ids[row * k + threadIdx.x];
  __syncthreads();
  const __nv_bfloat16* hr = h + row * hidden;
  for (int j = warp; j < k; j += kWarps) {
    const int id = cand[j];
    float acc = NAN;  // an id outside the vocabulary ranks last (-inf)
    if (id >= 0 && id < vocab) {
      const __nv_bfloat16* wr = head + static_cast<int64_t>(id) * hidden;
      acc = 0.0f;
      for (int c = lane * detail::kVec; c < hidden; c += 32 * detail::kVec) {
        float a[8], b[8];
        detail::load_bf16<8>(hr + c, a);
        detail::load_bf16<8>(wr + c, b);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(a[e], b[e], acc);
      }
      acc = detail::warp_sum(acc);
    }
    if (lane == 0) value[j] = acc;
  }
  __syncthreads();
  const int j = threadIdx.x;
  if (j < k) {
    const float v = value[j];
    const int id = cand[j];
    int rank = 0;
    for (int i = 0; i < k; ++i) rank += ranks_before(value[i], cand[i], i, v, id, j) ? 1 : 0;
    float u;
    if (isnan(v)) {
      u = -INFINITY;
    } else {
      u = v * multiplier;
      if (softcap > 0.0f) u = softcap * tanhf(u / softcap);
    }
    ids[row * k + rank] = id;
    unary[row * k + rank] = u;
  }
}

}  // namespace

cudaError_t rescore_candidates(const __nv_bfloat16* h, const __nv_bfloat16* head, int64_t rows, int64_t k,
                               int64_t hidden, int64_t vocab, float multiplier, float softcap, int32_t* ids,
                               float* unary, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (h == nullptr || head == nullptr || ids == nullptr || unary == nullptr || rows < 0 ||
      rows > (int64_t{1} << 31) - 1 || k < 1 || k > kMaxK || hidden < 8 || hidden % 8 != 0 ||
      hidden > (int64_t{1} << 30) || vocab < 1 || vocab > (int64_t{1} << 31) - 1 || !detail::aligned16(h) ||
      !detail::aligned16(head)) {
    return cudaErrorInvalidValue;
  }
  const cudaError_t e = detail::launch(rescore_candidates_kernel, static_cast<unsigned>(rows), kThreads, 0, stream, h,
                                       head, static_cast<int>(k), static_cast<int>(hidden), static_cast<int>(vocab),
                                       multiplier, softcap, ids, unary);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
