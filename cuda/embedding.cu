// Token embedding lookup: out[t] = table[ids[t]]. 2-D grid: x over 16-byte vectors of a row,
// y grid-strides over tokens. An id outside [0, vocab) yields a zero row and raises *bad_id.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

// table [vocab, H], ids [T], out [T, H]; U = uint4 (8 bf16) or __nv_bfloat16.
template <typename U>
static __global__ void embedding_kernel(const U* table, const int32_t* ids, int64_t num_tokens,
                                        int64_t row_units, int64_t vocab, U* out, int32_t* bad_id) {
  detail::pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= row_units) return;
  for (int64_t t = blockIdx.y; t < num_tokens; t += gridDim.y) {
    const int32_t id = ids[t];
    if (id >= 0 && id < vocab) {
      out[t * row_units + i] = table[static_cast<int64_t>(id) * row_units + i];
    } else {
      out[t * row_units + i] = U{};
      if (i == 0 && bad_id != nullptr) *bad_id = 1;  // every writer stores the same value
    }
  }
}

cudaError_t embedding(const __nv_bfloat16* table, const int32_t* ids, int64_t num_tokens,
                      int64_t hidden, int64_t vocab, __nv_bfloat16* out, int32_t* bad_id,
                      cudaStream_t stream) {
  if (num_tokens <= 0 || hidden <= 0) return cudaSuccess;
  const bool vec = hidden % detail::kVec == 0 && detail::aligned16(table) && detail::aligned16(out);
  const int64_t units = vec ? hidden / detail::kVec : hidden;
  const int threads = units >= 256 ? 256 : static_cast<int>((units + 31) / 32 * 32);
  const dim3 grid(detail::grid_for(units, threads, 1 << 30), detail::grid_for(num_tokens, 1, 65535));
  if (vec) {
    detail::launch(&embedding_kernel<uint4>, grid, threads, 0, stream, reinterpret_cast<const uint4*>(table), ids,
                                                   num_tokens, units, vocab,
                                                   reinterpret_cast<uint4*>(out), bad_id);
  } else {
    detail::launch(&embedding_kernel<__nv_bfloat16>, grid, threads, 0, stream, table, ids, num_tokens, units, vocab, out, bad_id);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
