// Device helpers shared by the kernels of cuda/: bf16 vectors of 16 bytes (8 elements) converted
// to and from fp32, alignment tests for the launchers' vector paths, warp and block reductions,
// and the grid size of grid-stride loops.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace dflash {
namespace cuda_driver {
bool pdl_enabled();  // cpp/cuda_driver/driver_api.h (kept out of the kernels' includes)
}  // namespace cuda_driver

namespace cuda {
namespace detail {

constexpr int kVec = 8;  // bf16 elements per 16-byte access

// Programmatic dependent launch (sm_90). A kernel launched by launch() may start while the
// kernel before it in the stream still runs: its launch and its prologue (pdl prefetches) hide
// behind that kernel's tail. Every kernel launched this way calls pdl_begin() before it reads
// anything an earlier kernel wrote or writes anything: it waits until the earlier grids have
// completed and their writes are visible, then lets the next kernel launch. (For a plain launch
// the wait returns at once.) KernelOptions::programmatic_launch = false (DFLASH_PDL=0) launches
// plainly, for A/B timing: the switch is cuda_driver::pdl_enabled().
__device__ __forceinline__ void pdl_begin() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = cuda_driver::pdl_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Blocks for a grid-stride loop over `items` with `per_block` items per block: enough to fill an
// H200 several times over, never more than the work.
inline unsigned grid_for(int64_t items, int64_t per_block, int64_t max_blocks = 8192) {
  int64_t b = (items + per_block - 1) / per_block;
  if (b > max_blocks) b = max_blocks;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

// V contiguous bf16 ↔ fp32: V = 8 is one 16-byte access (pointer 16-byte aligned), V = 1 scalar.
template <int V>
__device__ __forceinline__ void load_bf16(const __nv_bfloat16* p, float (&f)[V]);

template <>
__device__ __forceinline__ void load_bf16<8>(const __nv_bfloat16* p, float (&f)[8]) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

template <>
__device__ __forceinline__ void load_bf16<1>(const __nv_bfloat16* p, float (&f)[1]) {
  f[0] = __bfloat162float(*p);
}

template <int V>
__device__ __forceinline__ void store_bf16(__nv_bfloat16* p, const float (&f)[V]);

template <>
__device__ __forceinline__ void store_bf16<8>(__nv_bfloat16* p, const float (&f)[8]) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = v;
}

template <>
__device__ __forceinline__ void store_bf16<1>(__nv_bfloat16* p, const float (&f)[1]) {
  *p = __float2bfloat16_rn(f[0]);
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block, returned to every thread. red: __shared__ T[32]. Every thread must call it.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  return warp_sum(lane < num_warps ? red[lane] : T(0));
}

}  // namespace detail
}  // namespace cuda
}  // namespace dflash
