// SwiGLU activation of the fused gate/up projection: out = silu(gate) * up, in fp32, one bf16
// rounding. 2-D grid: x over 16-byte column vectors of a row, y grid-strides over rows.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

// gate_up [R, 2I] (gate = [:, :I], up = [:, I:]), out [R, I]. V = 8 (16-byte accesses) or 1.
template <int V>
static __global__ void silu_mul_kernel(const __nv_bfloat16* gate_up, int64_t rows, int64_t inter,
                                       __nv_bfloat16* out) {
  detail::pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= inter / V) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const __nv_bfloat16* g = gate_up + r * 2 * inter + i * V;
    float a[V], b[V], o[V];
    detail::load_bf16<V>(g, a);
    detail::load_bf16<V>(g + inter, b);
#pragma unroll
    for (int e = 0; e < V; ++e) o[e] = a[e] / (1.0f + __expf(-a[e])) * b[e];
    detail::store_bf16<V>(out + r * inter + i * V, o);
  }
}

cudaError_t silu_mul(const __nv_bfloat16* gate_up, int64_t rows, int64_t inter,
                     __nv_bfloat16* out, cudaStream_t stream) {
  if (rows <= 0 || inter <= 0) return cudaSuccess;
  const bool vec = inter % detail::kVec == 0 && detail::aligned16(gate_up) && detail::aligned16(out);
  const int64_t nvec = vec ? inter / detail::kVec : inter;
  const int threads = nvec >= 256 ? 256 : static_cast<int>((nvec + 31) / 32 * 32);
  const dim3 grid(detail::grid_for(nvec, threads, 1 << 30), detail::grid_for(rows, 1, 65535));
  if (vec) {
    detail::launch(&silu_mul_kernel<8>, grid, threads, 0, stream, gate_up, rows, inter, out);
  } else {
    detail::launch(&silu_mul_kernel<1>, grid, threads, 0, stream, gate_up, rows, inter, out);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
