// L2 prefetch of a weight that a later kernel of the step reads: bulk prefetches
// (cp.async.bulk.prefetch.L2, sm_90) spread over the grid, issued while the kernel ahead in the
// stream still runs. Used to fill HBM time that latency-bound kernels leave idle (the decode
// attention, norms, RoPE) with the bytes of the next linear layer, which then reads them from L2.
//
// Programmatic dependent launch: the kernel lets its successor launch first, issues the
// prefetches (weights depend on no kernel), then waits for the kernel ahead. So it ends only once
// that kernel has completed, and a successor that waits for it waits for both: the stream order
// holds, and the prefetch adds no link of its own to the chain of waits.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

namespace {

constexpr int64_t kPrefetchChunk = 16384;  // bytes per bulk prefetch
constexpr int kPrefetchThreads = 32;

// base: 16-byte aligned; bytes: a multiple of 16.
__global__ void l2_prefetch_kernel(const char* base, int64_t bytes) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int64_t chunks = (bytes + kPrefetchChunk - 1) / kPrefetchChunk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks; c += stride) {
    const int64_t offset = c * kPrefetchChunk;
    const uint32_t size = static_cast<uint32_t>(min(kPrefetchChunk, bytes - offset));
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + offset), "r"(size) : "memory");
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

}  // namespace

cudaError_t l2_prefetch(const void* ptr, int64_t bytes, int max_blocks, cudaStream_t stream) {
  if (ptr == nullptr || bytes <= 0 || !detail::aligned16(ptr) || max_blocks < 1) return cudaErrorInvalidValue;
  bytes &= ~int64_t{15};
  if (bytes == 0) return cudaSuccess;
  const int64_t chunks = (bytes + kPrefetchChunk - 1) / kPrefetchChunk;
  const unsigned blocks = detail::grid_for(chunks, kPrefetchThreads, max_blocks);
  detail::launch(&l2_prefetch_kernel, blocks, kPrefetchThreads, 0, stream, static_cast<const char*>(ptr), bytes);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
