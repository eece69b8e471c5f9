// The pipelined decode step's token feed: a step launched before the host has read the previous
// step's sampled tokens takes them on the device, ids[i] = feed[i] >= 0 ? prev[feed[i]] : ids[i].
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

}  // namespace cuda
}  // namespace dflash
