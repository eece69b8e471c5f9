// Non-finite logit rows: flags[r] = 1 when row r of logits [R, V] (fp32) holds a NaN or an
// infinity, else 0. The flags are zeroed (a memset), then each block scans kSpan elements of one
// row with 16-byte loads, kUnroll in flight per thread, and a block that finds one stores 1 (every
// such store writes the same value, so no atomics). A row of 151,936 logits is 19 blocks: one
// block per row read it at ~20 GB/s (30 us a launch on the H200). The engine ends a request whose
// sampled row is flagged with finish_reason "error" (runtime/engine.cpp) instead of sampling from
// it, so a NaN in one request's logits never reaches another request.
#include <algorithm>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

namespace {
constexpr int kNonfiniteThreads = 256;
constexpr int kUnroll = 8;                                   // 16-byte loads in flight per thread
constexpr int64_t kSpan = 4 * kUnroll * kNonfiniteThreads;  // elements of a block: 8192
constexpr int64_t kMaxGridY = 65535;

// An exponent of all ones: an infinity or a NaN.
__device__ __forceinline__ bool nonfinite_bits(uint32_t bits) { return (bits & 0x7f800000u) == 0x7f800000u; }
}  // namespace

// grid (ceil(vocab / kSpan), min(rows, kMaxGridY)); flags zeroed before.
template <bool kVector>
static __global__ void __launch_bounds__(kNonfiniteThreads)
    nonfinite_rows_kernel(const float* logits, int64_t rows, int64_t vocab, int32_t* flags) {
  detail::pdl_begin();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kSpan;
  const int64_t end = std::min(vocab, begin + kSpan);
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float* row = logits + r * vocab;
    bool bad = false;
    int64_t tail = begin;
    if (kVector) {  // begin and kSpan are multiples of 4, so are the vectors' bounds
      const uint4* v = reinterpret_cast<const uint4*>(row);
      const int64_t c0 = begin / 4, c1 = end / 4;
      uint4 q[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = c0 + u * kNonfiniteThreads + threadIdx.x;
        q[u] = c < c1 ? v[c] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        bad |= nonfinite_bits(q[u].x) | nonfinite_bits(q[u].y) | nonfinite_bits(q[u].z) | nonfinite_bits(q[u].w);
      }
      tail = c1 * 4;
    }
    for (int64_t i = tail + threadIdx.x; i < end; i += blockDim.x) bad |= nonfinite_bits(__float_as_uint(row[i]));
    const int any = __syncthreads_or(bad ? 1 : 0);
    if (any && threadIdx.x == 0) flags[r] = 1;
  }
}

cudaError_t nonfinite_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* flags, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vocab <= 0 || rows > INT32_MAX || vocab > (int64_t{1} << 40)) return cudaErrorInvalidValue;
  const cudaError_t e = cudaMemsetAsync(flags, 0, static_cast<size_t>(rows) * sizeof(int32_t), stream);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>((vocab + kSpan - 1) / kSpan), static_cast<unsigned>(std::min(rows, kMaxGridY)));
  if (detail::aligned16(logits) && vocab % 4 == 0) {
    return detail::launch(&nonfinite_rows_kernel<true>, grid, kNonfiniteThreads, 0, stream, logits, rows, vocab, flags);
  }
  return detail::launch(&nonfinite_rows_kernel<false>, grid, kNonfiniteThreads, 0, stream, logits, rows, vocab, flags);
}

}  // namespace cuda
}  // namespace dflash
