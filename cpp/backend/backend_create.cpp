// backend_create: the one place that knows which backends this build has.
#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#ifdef DFLASH_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace dflash {

bool backend_built_with_cuda() {
#ifdef DFLASH_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool backend_cuda_usable() {
#ifdef DFLASH_WITH_CUDA
  return CudaBackend::usable();
#else
  return false;
#endif
}

std::unique_ptr<Backend> backend_create(const std::string& device, int num_threads, size_t scratch_bytes,
                                        const KernelOptions& kernels) {
  if (device == "cpu") return std::make_unique<CpuBackend>(num_threads, kernels);
  if (device == "cuda") {
#ifdef DFLASH_WITH_CUDA
    return std::make_unique<CudaBackend>(0, scratch_bytes, kernels);
#else
    throw InvalidArgument("device='cuda' was asked for, but this build of dflash has no CUDA backend "
                          "(it was built without nvcc or with DFLASH_CUDA=OFF)");
#endif
  }
  throw InvalidArgument("device must be 'auto', 'cpu' or 'cuda', got '" + device + "'");
}

}  // namespace dflash
