// DFlash2's grouped dynamic depthwise conv, one side (prepare or finish) of a sublayer, as one
// elementwise pass: each thread makes 8 channels (one 16-byte vector) of one row from the taps
// x[i - t] inside the row's block, with coefficients base[side, t, c] + deltas[i, tap t of the
// channel's group]; fp32 math, bf16 out, or added into a bf16 residual stream (the finish side).
// Also the bf16 in-place scale of the drafter's input embeddings.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

// x [rows, hidden], base [2, taps, hidden], deltas [rows, 2 * taps * groups], out [rows, hidden].
// V = 8 (16-byte accesses; hidden % 8 == 0, group % 8 == 0, aligned pointers) or 1.
template <int V>
static __global__ void grouped_conv_kernel(const __nv_bfloat16* x, const __nv_bfloat16* base,
                                           const __nv_bfloat16* deltas, int64_t rows, int64_t hidden, int taps,
                                           int64_t group, int side, int64_t block, bool accumulate,
                                           __nv_bfloat16* out) {
  detail::pdl_begin();
  const int64_t vecs_per_row = hidden / V;
  const int64_t groups = hidden / group;
  const int64_t total = rows * vecs_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total; v += stride) {
    const int64_t i = v / vecs_per_row;
    const int64_t c = (v - i * vecs_per_row) * V;
    const int64_t in_block = i % block;
    const __nv_bfloat16* d = deltas + i * 2 * taps * groups + static_cast<int64_t>(side) * taps * groups + c / group;
    float acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = 0.0f;
    for (int t = 0; t < taps && t <= in_block; ++t) {
      float xv[V], bv[V];
      detail::load_bf16<V>(x + (i - t) * hidden + c, xv);
      detail::load_bf16<V>(base + (static_cast<int64_t>(side) * taps + t) * hidden + c, bv);
      const float delta = __bfloat162float(d[static_cast<int64_t>(t) * groups]);
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] += (bv[e] + delta) * xv[e];
    }
    if (accumulate) {
      float o[V];
      detail::load_bf16<V>(out + i * hidden + c, o);
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] += o[e];
    }
    detail::store_bf16<V>(out + i * hidden + c, acc);
  }
}

cudaError_t grouped_conv(const __nv_bfloat16* x, const __nv_bfloat16* base, const __nv_bfloat16* deltas,
                         int64_t rows, int64_t hidden, int64_t taps, int64_t group, int64_t side, int64_t block,
                         bool accumulate, __nv_bfloat16* out, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows < 0 || hidden <= 0 || group <= 0 || hidden % group != 0 || taps < 1 || taps > kConvMaxTaps ||
      (side != 0 && side != 1) || block < 1 || rows % block != 0) {
    return cudaErrorInvalidValue;
  }
  constexpr int kThreads = 256;
  const bool vec = hidden % detail::kVec == 0 && group % detail::kVec == 0 && detail::aligned16(x) &&
                   detail::aligned16(base) && detail::aligned16(out);
  const int64_t work = rows * (vec ? hidden / detail::kVec : hidden);
  const unsigned blocks = detail::grid_for(work, kThreads);
  if (vec) {
    detail::launch(&grouped_conv_kernel<8>, blocks, kThreads, 0, stream, x, base, deltas, rows, hidden,
                   static_cast<int>(taps), group, static_cast<int>(side), block, accumulate, out);
  } else {
    detail::launch(&grouped_conv_kernel<1>, blocks, kThreads, 0, stream, x, base, deltas, rows, hidden,
                   static_cast<int>(taps), group, static_cast<int>(side), block, accumulate, out);
  }
  return cudaGetLastError();
}

// x [n] *= factor
static __global__ void scale_bf16_kernel(__nv_bfloat16* x, int64_t n, float factor) {
  detail::pdl_begin();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    x[i] = __float2bfloat16_rn(__bfloat162float(x[i]) * factor);
  }
}

cudaError_t scale_bf16(__nv_bfloat16* x, int64_t n, float factor, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  detail::launch(&scale_bf16_kernel, detail::grid_for(n, kThreads), kThreads, 0, stream, x, n, factor);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
