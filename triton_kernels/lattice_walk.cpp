// The lattice walk on top of the generated Triton launchers (triton_kernels_gen.h): the host-side
// choice of BLOCK_K and the launch. See lattice_walk.h for the contract and lattice_walk.py for
// the kernel.
#include "triton_kernels/lattice_walk.h"

#include <cstddef>

#include "triton_kernels_gen.h"

namespace dflash {
namespace triton_aot {
namespace {

namespace g = gen;

using WalkLaunch = CUresult (*)(CUfunction, CUstream, unsigned, unsigned, unsigned, CUdeviceptr,
                                CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr, int32_t,
                                int32_t, int32_t);

struct WalkKernel {
  int id, block_k;
  WalkLaunch launch;
};

// Ascending BLOCK_K: the first one >= k is launched.
constexpr WalkKernel kWalkKernels[] = {
    {g::lattice_walk_k4::kId, g::lattice_walk_k4::kBlockK, &g::lattice_walk_k4::launch},
    {g::lattice_walk_k8::kId, g::lattice_walk_k8::kBlockK, &g::lattice_walk_k8::launch},
    {g::lattice_walk_k16::kId, g::lattice_walk_k16::kBlockK, &g::lattice_walk_k16::launch},
    {g::lattice_walk_k32::kId, g::lattice_walk_k32::kBlockK, &g::lattice_walk_k32::launch},
    {g::lattice_walk_k64::kId, g::lattice_walk_k64::kBlockK, &g::lattice_walk_k64::launch},
};
constexpr int32_t kMaxK = g::lattice_walk_k64::kBlockK;

constexpr bool ascending() {
  for (size_t i = 1; i < sizeof(kWalkKernels) / sizeof(kWalkKernels[0]); ++i) {
    if (kWalkKernels[i - 1].block_k >= kWalkKernels[i].block_k) return false;
  }
  return true;
}
static_assert(ascending() && kWalkKernels[0].block_k >= 1, "walk tiles must ascend");

CUdeviceptr dptr(const void* p) { return reinterpret_cast<CUdeviceptr>(p); }

}  // namespace

int32_t lattice_walk_max_k() { return kMaxK; }

CUresult lattice_walk(const Modules& m, cudaStream_t stream, const LatticeWalkArgs& a) {
  if (a.k < 1 || a.k > kMaxK || a.num_reqs < 0 || a.slots < 0) return CUDA_ERROR_INVALID_VALUE;
  if (a.num_reqs == 0 || a.slots == 0) return CUDA_SUCCESS;
  if (!a.edges || !a.ids || !a.params || !a.drafts || !a.realized) return CUDA_ERROR_INVALID_VALUE;
  for (const WalkKernel& kernel : kWalkKernels) {
    if (kernel.block_k < a.k) continue;
    return kernel.launch(m.function(kernel.id), stream, static_cast<unsigned>(a.num_reqs), 1, 1,
                         dptr(a.edges), dptr(a.ids), dptr(a.params), dptr(a.drafts),
                         dptr(a.realized), a.slots, a.k, a.greedy_walk ? 1 : 0);
  }
  return CUDA_ERROR_INVALID_VALUE;  // unreachable: k <= kMaxK
}

}  // namespace triton_aot
}  // namespace dflash
