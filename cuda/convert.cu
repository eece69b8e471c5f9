// Element conversions between bf16 and fp32 (round to nearest even): grid-stride loops over
// groups of 8 elements (one 16-byte bf16 access, two 16-byte fp32 accesses), tail one by one.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

// x [n] bf16 → out [n] fp32. V = 8 (16-byte accesses) or 1.
template <int V>
static __global__ void bf16_to_f32_kernel(const __nv_bfloat16* x, int64_t n, float* out) {
  detail::pdl_begin();
  const int64_t nvec = n / V;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = start; i < nvec; i += stride) {
    float f[V];
    detail::load_bf16<V>(x + i * V, f);
    if constexpr (V == 8) {
      float4* o = reinterpret_cast<float4*>(out + i * V);
      o[0] = make_float4(f[0], f[1], f[2], f[3]);
      o[1] = make_float4(f[4], f[5], f[6], f[7]);
    } else {
      out[i] = f[0];
    }
  }
  const int64_t t = nvec * V + start;
  if (t < n) out[t] = __bfloat162float(x[t]);
}

// x [n] fp32 → out [n] bf16. V = 8 (16-byte accesses) or 1.
template <int V>
static __global__ void f32_to_bf16_kernel(const float* x, int64_t n, __nv_bfloat16* out) {
  detail::pdl_begin();
  const int64_t nvec = n / V;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = start; i < nvec; i += stride) {
    float f[V];
    if constexpr (V == 8) {
      const float4* p = reinterpret_cast<const float4*>(x + i * V);
      const float4 a = p[0], b = p[1];
      f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
      f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
    } else {
      f[0] = x[i];
    }
    detail::store_bf16<V>(out + i * V, f);
  }
  const int64_t t = nvec * V + start;
  if (t < n) out[t] = __float2bfloat16_rn(x[t]);
}

cudaError_t bf16_to_f32(const __nv_bfloat16* x, int64_t n, float* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const bool vec = detail::aligned16(x) && detail::aligned16(out);
  const unsigned blocks = detail::grid_for(vec ? (n + 7) / 8 : n, kThreads);
  if (vec) {
    detail::launch(&bf16_to_f32_kernel<8>, blocks, kThreads, 0, stream, x, n, out);
  } else {
    detail::launch(&bf16_to_f32_kernel<1>, blocks, kThreads, 0, stream, x, n, out);
  }
  return cudaGetLastError();
}

cudaError_t f32_to_bf16(const float* x, int64_t n, __nv_bfloat16* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const bool vec = detail::aligned16(x) && detail::aligned16(out);
  const unsigned blocks = detail::grid_for(vec ? (n + 7) / 8 : n, kThreads);
  if (vec) {
    detail::launch(&f32_to_bf16_kernel<8>, blocks, kThreads, 0, stream, x, n, out);
  } else {
    detail::launch(&f32_to_bf16_kernel<1>, blocks, kThreads, 0, stream, x, n, out);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
