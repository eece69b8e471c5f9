// Element-wise bf16 addition out = a + b (fp32 sum, one rounding): a grid-stride loop over
// 16-byte vectors, the last n % 8 elements done one by one.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

// a [n], b [n], out [n]. V = 8 (16-byte accesses) or 1.
template <int V>
static __global__ void add_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n,
                                  __nv_bfloat16* out) {
  detail::pdl_begin();
  const int64_t nvec = n / V;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = start; i < nvec; i += stride) {
    float x[V], y[V];
    detail::load_bf16<V>(a + i * V, x);
    detail::load_bf16<V>(b + i * V, y);
#pragma unroll
    for (int e = 0; e < V; ++e) x[e] += y[e];
    detail::store_bf16<V>(out + i * V, x);
  }
  const int64_t t = nvec * V + start;  // tail (V = 8 only)
  if (t < n) out[t] = __float2bfloat16_rn(__bfloat162float(a[t]) + __bfloat162float(b[t]));
}

cudaError_t add(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, __nv_bfloat16* out,
                cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const bool vec = detail::aligned16(a) && detail::aligned16(b) && detail::aligned16(out);
  const int64_t work = vec ? (n + detail::kVec - 1) / detail::kVec : n;
  const unsigned blocks = detail::grid_for(work, kThreads);
  if (vec) {
    detail::launch(&add_kernel<8>, blocks, kThreads, 0, stream, a, b, n, out);
  } else {
    detail::launch(&add_kernel<1>, blocks, kThreads, 0, stream, a, b, n, out);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
