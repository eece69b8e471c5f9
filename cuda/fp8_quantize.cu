// Per-row e4m3 quantization of a bf16 weight [V, H] for DFlash2's FP8 candidate head
// (fp8_quantize_rows of kernels.h), run once at load: one CTA per row takes max |w| (an exact,
// order-free fp32 max), scale = max / 448 (1 when not positive), and converts w / scale (IEEE
// division) with the hardware round-to-nearest-even, saturating cvt. The same fp32 operations as
// the host reference fp8_quantize_row, so the bytes and scales are equal bit for bit.
#include <cuda_fp8.h>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) fp8_quantize_rows_kernel(const __nv_bfloat16* __restrict__ w, int64_t hidden,
                                                                     uint8_t* __restrict__ q, float* __restrict__ scale) {
  detail::pdl_begin();
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* wr = w + row * hidden;
  float amax = 0.0f;
  for (int64_t c = threadIdx.x; c < hidden; c += kThreads) amax = fmaxf(amax, fabsf(__bfloat162float(wr[c])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int i = 0; i < kThreads / 32; ++i) amax = fmaxf(amax, red[i]);
  float s = __fdiv_rn(amax, 448.0f);
  if (!(s > 0.0f)) s = 1.0f;
  uint8_t* qr = q + row * hidden;
  for (int64_t c = threadIdx.x; c < hidden; c += kThreads) {
    qr[c] = static_cast<uint8_t>(
        __nv_cvt_float_to_fp8(__fdiv_rn(__bfloat162float(wr[c]), s), __NV_SATFINITE, __NV_E4M3));
  }
  if (threadIdx.x == 0) scale[row] = s;
}

}  // namespace

cudaError_t fp8_quantize_rows(const __nv_bfloat16* w, int64_t vocab, int64_t hidden, uint8_t* q, float* scale,
                              cudaStream_t stream) {
  if (vocab == 0) return cudaSuccess;
  if (w == nullptr || q == nullptr || scale == nullptr || vocab < 0 || vocab > (int64_t{1} << 31) - 1 ||
      hidden < 1) {
    return cudaErrorInvalidValue;
  }
  const cudaError_t e = detail::launch(fp8_quantize_rows_kernel, static_cast<unsigned>(vocab), kThreads, 0, stream,
                                       w, hidden, q, scale);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
