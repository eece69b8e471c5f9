// A test utility for kernels that read before their programmatic-launch wait: copies rows of src
// into dst late. The kernel lets the next kernel in the stream launch at once, waits for the
// kernel ahead, sleeps delay_ns, then copies. A kernel launched right behind it with programmatic
// launch runs the part before its wait while this one sleeps, so what it reads there is dst's old
// bytes, and what it reads after its wait is the new ones. The GPU tests put the step's late writes
// (the queries, this step's keys, the raw QKV) through it, so a kernel that reads any of them too
// early gets the old values and a wrong result (tests/gpu/test_cuda_prewait_reads.py).
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

namespace {

__global__ void late_copy_rows_kernel(char* dst, const char* src, const int32_t* rows, int64_t num_rows,
                                      int64_t total_rows, int64_t row_bytes, uint32_t delay_ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < delay_ns);
  const int64_t pieces = row_bytes / 16, total = num_rows * pieces;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = rows[i / pieces], off = row * row_bytes + (i % pieces) * 16;
    if (row < 0 || row >= total_rows) continue;  // not a row of dst: nothing written
    *reinterpret_cast<uint4*>(dst + off) = *reinterpret_cast<const uint4*>(src + off);
  }
}

}  // namespace

cudaError_t late_copy_rows(void* dst, const void* src, int64_t total_rows, const int32_t* rows, int64_t num_rows,
                           int64_t row_bytes, uint32_t delay_ns, cudaStream_t stream) {
  if (dst == nullptr || src == nullptr || num_rows < 0 || (num_rows > 0 && rows == nullptr) || total_rows < 0 ||
      row_bytes <= 0 || row_bytes % 16 != 0 || !detail::aligned16(dst) || !detail::aligned16(src)) {
    return cudaErrorInvalidValue;
  }
  // A few CTAs: the kernel behind it must find free SMs while these sleep.
  const unsigned blocks = detail::grid_for(num_rows * (row_bytes / 16), 256, 4);
  const cudaError_t e = detail::launch(&late_copy_rows_kernel, blocks, 256, 0, stream, static_cast<char*>(dst),
                                       static_cast<const char*>(src), rows, num_rows, total_rows, row_bytes, delay_ns);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
