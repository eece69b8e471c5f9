// The pipelined decode steps' feed: a step launched before the host has read the previous step's
// outputs takes them on the device. AR: ids[i] = feed[i] >= 0 ? prev[feed[i]] : ids[i].
// Speculative (feed_spec_inputs, backend.h): a request moves on by the previous step's accepted
// drafts + 1, its anchor that step's next token; one thread per row of a request's block.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

static __global__ void feed_tokens_kernel(int32_t* ids, const int32_t* feed, const int32_t* prev, int64_t rows) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t f = feed[i];
    if (f >= 0) ids[i] = prev[f];
  }
}

cudaError_t feed_tokens(int32_t* ids, const int32_t* feed, const int32_t* prev, int64_t rows, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  feed_tokens_kernel<<<detail::grid_for(rows, 256, 64), 256, 0, stream>>>(ids, feed, prev, rows);
  return cudaGetLastError();
}

static __global__ void feed_spec_inputs_kernel(const int32_t* feed, const int32_t* num_accepted,
                                               const int32_t* next_token, const int32_t* block_table, int64_t width,
                                               int64_t b, int64_t q, int64_t block_size, int32_t* ids,
                                               int32_t* verify_ids, int32_t* positions, int32_t* slots,
                                               int32_t* kv_len, int32_t* anchors, SampleRow* params) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < b * q;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / q, j = i - r * q;
    const int32_t src = feed[r];
    if (src < 0) continue;
    const int32_t shift = num_accepted[src] + 1;
    const int32_t pos = positions[i] + shift;
    positions[i] = pos;
    slots[i] = static_cast<int32_t>(block_table[r * width + pos / block_size] * block_size + pos % block_size);
    if (j == 0) {
      const int32_t token = next_token[src];
      kv_len[r] += shift;
      params[r].position += shift;
      anchors[r] = token;
      ids[i] = token;
      verify_ids[i] = token;
    }
  }
}

cudaError_t feed_spec_inputs(const int32_t* feed, const int32_t* num_accepted, const int32_t* next_token,
                             const int32_t* block_table, int64_t width, int64_t b, int64_t q, int64_t block_size,
                             int32_t* ids, int32_t* verify_ids, int32_t* positions, int32_t* slots, int32_t* kv_len,
                             int32_t* anchors, SampleRow* params, cudaStream_t stream) {
  if (b <= 0 || q <= 0) return cudaSuccess;
  if (block_size <= 0 || width <= 0) return cudaErrorInvalidValue;
  feed_spec_inputs_kernel<<<detail::grid_for(b * q, 256, 64), 256, 0, stream>>>(
      feed, num_accepted, next_token, block_table, width, b, q, block_size, ids, verify_ids, positions, slots, kv_len,
      anchors, params);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
