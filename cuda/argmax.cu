// Row argmax of logits [R, V] in bf16 or fp32 (the drafter's greedy draft tokens without fp32
// logits): one block per row, 16-byte loads, (value, lowest index) reduction. NaNs never win.
#include <cfloat>
#include <climits>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

namespace {
constexpr int kArgmaxThreads = 512;

__device__ __forceinline__ void consider(float v, int i, float& bv, int& bi) {
  if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
}

__device__ __forceinline__ void load_vec(const __nv_bfloat16* p, float (&f)[8]) { detail::load_bf16<8>(p, f); }
__device__ __forceinline__ void load_vec(const float* p, float (&f)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
__device__ __forceinline__ float load_one(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_one(const float* p) { return *p; }
}  // namespace

template <typename T, bool kVector>
static __global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(const T* logits, int64_t vocab, int32_t* out) {
  detail::pdl_begin();
  const T* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  float bv = -FLT_MAX;
  int bi = INT_MAX;
  int64_t tail = 0;
  if (kVector) {
    const int64_t chunks = vocab / 8;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      float f[8];
      load_vec(row + c * 8, f);
#pragma unroll
      for (int e = 0; e < 8; ++e) consider(f[e], static_cast<int>(c * 8 + e), bv, bi);
    }
    tail = chunks * 8;
  }
  for (int64_t i = tail + threadIdx.x; i < vocab; i += blockDim.x) consider(load_one(row + i), static_cast<int>(i), bv, bi);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, bv, o);
    const int i = __shfl_xor_sync(0xffffffffu, bi, o);
    consider(v, i, bv, bi);
  }
  __shared__ float sv[kArgmaxThreads / 32];
  __shared__ int si[kArgmaxThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  if (warp == 0) {
    bv = lane < kArgmaxThreads / 32 ? sv[lane] : -FLT_MAX;
    bi = lane < kArgmaxThreads / 32 ? si[lane] : INT_MAX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float v = __shfl_xor_sync(0xffffffffu, bv, o);
      const int i = __shfl_xor_sync(0xffffffffu, bi, o);
      consider(v, i, bv, bi);
    }
    if (lane == 0) out[blockIdx.x] = bi == INT_MAX ? 0 : bi;
  }
}

template <typename T>
static cudaError_t launch_argmax(const T* logits, int64_t rows, int64_t vocab, int32_t* out, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vocab <= 0 || vocab > INT_MAX || rows > INT_MAX) return cudaErrorInvalidValue;
  const bool vec = detail::aligned16(logits) && (vocab * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
                   (8 * sizeof(T)) % 16 == 0;
  if (vec) {
    detail::launch(&argmax_rows_kernel<T, true>, static_cast<unsigned>(rows), kArgmaxThreads, 0, stream, logits, vocab, out);
  } else {
    detail::launch(&argmax_rows_kernel<T, false>, static_cast<unsigned>(rows), kArgmaxThreads, 0, stream, logits, vocab, out);
  }
  return cudaGetLastError();
}

cudaError_t argmax_rows(const __nv_bfloat16* logits, int64_t rows, int64_t vocab, int32_t* out, cudaStream_t stream) {
  return launch_argmax(logits, rows, vocab, out, stream);
}

cudaError_t argmax_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* out, cudaStream_t stream) {
  return launch_argmax(logits, rows, vocab, out, stream);
}

}  // namespace cuda
}  // namespace dflash
