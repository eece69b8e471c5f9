// Non-finite logit rows: flags[r] = 1 when row r of logits [R, V] (fp32) holds a NaN or an
// infinity, else 0. One block per row, 16-byte loads, an OR over the block. The engine ends a
// request whose sampled row is flagged with finish_reason "error" (runtime/engine.cpp) instead of
// sampling from it, so a NaN in one request's logits never reaches another request.
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

namespace {
constexpr int kNonfiniteThreads = 256;

// An exponent of all ones: an infinity or a NaN.
__device__ __forceinline__ bool nonfinite_bits(uint32_t bits) { return (bits & 0x7f800000u) == 0x7f800000u; }
}  // namespace

template <bool kVector>
static __global__ void __launch_bounds__(kNonfiniteThreads)
    nonfinite_rows_kernel(const float* logits, int64_t vocab, int32_t* flags) {
  detail::pdl_begin();
  const float* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  bool bad = false;
  int64_t tail = 0;
  if (kVector) {
    const int64_t chunks = vocab / 4;
    const uint4* v = reinterpret_cast<const uint4*>(row);
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      const uint4 q = v[c];
      bad |= nonfinite_bits(q.x) | nonfinite_bits(q.y) | nonfinite_bits(q.z) | nonfinite_bits(q.w);
    }
    tail = chunks * 4;
  }
  for (int64_t i = tail + threadIdx.x; i < vocab; i += blockDim.x) bad |= nonfinite_bits(__float_as_uint(row[i]));
  const int any = __syncthreads_or(bad ? 1 : 0);
  if (threadIdx.x == 0) flags[blockIdx.x] = any ? 1 : 0;
}

cudaError_t nonfinite_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* flags, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vocab <= 0 || rows > INT32_MAX) return cudaErrorInvalidValue;
  const unsigned grid = static_cast<unsigned>(rows);
  if (detail::aligned16(logits) && vocab % 4 == 0) {
    return detail::launch(&nonfinite_rows_kernel<true>, grid, kNonfiniteThreads, 0, stream, logits, vocab, flags);
  }
  return detail::launch(&nonfinite_rows_kernel<false>, grid, kNonfiniteThreads, 0, stream, logits, vocab, flags);
}

}  // namespace cuda
}  // namespace dflash
