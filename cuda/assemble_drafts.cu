// The speculative step's draft assembly on the device: per request the drafter's argmax tokens
// (or, for tests, given override tokens) become the drafts that acceptance reads and rows
// 1..n of the verify block [anchor, drafts].
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

static __global__ void assemble_drafts_kernel(const int32_t* proposed, const int32_t* override_drafts,
                                              const int32_t* use_override, int64_t rows, int64_t n,
                                              int32_t* drafts, int32_t* verify_ids) {
  detail::pdl_begin();
  const int64_t total = rows * n;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / n, j = i - r * n;
    const int32_t d = use_override[r] ? override_drafts[i] : proposed[i];
    drafts[i] = d;
    verify_ids[r * (n + 1) + 1 + j] = d;
  }
}

cudaError_t assemble_drafts(const int32_t* proposed, const int32_t* override_drafts, const int32_t* use_override,
                            int64_t rows, int64_t n, int32_t* drafts, int32_t* verify_ids, cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  const unsigned blocks = detail::grid_for(rows * n, 256, 1024);
  detail::launch(&assemble_drafts_kernel, blocks, 256, 0, stream, proposed, override_drafts, use_override, rows, n, drafts,
                                                     verify_ids);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
