// Writes of K/V rows into one layer's paged pools at their slots (slot = block * block_size +
// offset; a negative slot is skipped), and the drafter's fused context path: per-head k_norm +
// RoPE of K, then both written to the pools (one warp per (token, head), rope_common.cuh).
#include "cuda/kernels.h"
#include "cuda/rope_common.cuh"

namespace dflash {
namespace cuda {

namespace {
constexpr int kRopeThreads = 256;
}  // namespace

// k, v [T, row_units], slots [T], k_pool / v_pool [num_slots, row_units];
// U = uint4 (8 bf16) or __nv_bfloat16. x over row units, y grid-strides over tokens.
template <typename U>
static __global__ void kv_write_kernel(const U* k, const U* v, const int32_t* slots,
                                       int64_t num_tokens, int64_t row_units, U* k_pool,
                                       U* v_pool) {
  detail::pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= row_units) return;
  for (int64_t t = blockIdx.y; t < num_tokens; t += gridDim.y) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    k_pool[s * row_units + i] = k[t * row_units + i];
    v_pool[s * row_units + i] = v[t * row_units + i];
  }
}

cudaError_t kv_write(const __nv_bfloat16* k, const __nv_bfloat16* v, const int32_t* slots,
                     int64_t num_tokens, int64_t row_elems, __nv_bfloat16* k_pool,
                     __nv_bfloat16* v_pool, cudaStream_t stream) {
  if (num_tokens <= 0 || row_elems <= 0) return cudaSuccess;
  const bool vec = row_elems % detail::kVec == 0 && detail::aligned16(k) && detail::aligned16(v) &&
                   detail::aligned16(k_pool) && detail::aligned16(v_pool);
  const int64_t units = vec ? row_elems / detail::kVec : row_elems;
  const int threads = units >= 256 ? 256 : static_cast<int>((units + 31) / 32 * 32);
  const dim3 grid(detail::grid_for(units, threads, 1 << 30), detail::grid_for(num_tokens, 1, 65535));
  if (vec) {
    detail::launch(&kv_write_kernel<uint4>, grid, threads, 0, stream, 
        reinterpret_cast<const uint4*>(k), reinterpret_cast<const uint4*>(v), slots, num_tokens,
        units, reinterpret_cast<uint4*>(k_pool), reinterpret_cast<uint4*>(v_pool));
  } else {
    detail::launch(&kv_write_kernel<__nv_bfloat16>, grid, threads, 0, stream, k, v, slots, num_tokens, units, k_pool, v_pool);
  }
  return cudaGetLastError();
}

// kv [C, L, 2 nkv hd] (per layer K heads then V heads), k_norm [L, hd] or null, positions [C],
// inv_freq [hd/2], slots [C], k_pool / v_pool [L, num_slots, nkv hd] (layer stride
// pool_layer_elems). One warp per (token, layer, head) of the 2 nkv heads.
template <int P>
static __global__ void __launch_bounds__(kRopeThreads)
    kv_norm_rope_write_kernel(const __nv_bfloat16* kv, const __nv_bfloat16* k_norm, float eps,
                              const int32_t* positions, const float* inv_freq, const int32_t* slots,
                              int64_t num_tokens, int num_layers, int num_kv_heads, int head_dim,
                              int64_t pool_layer_elems, __nv_bfloat16* k_pool, __nv_bfloat16* v_pool) {
  detail::pdl_begin();
  const int heads = 2 * num_kv_heads;
  const int64_t units = num_tokens * num_layers * heads;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t u = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; u < units;
       u += warps) {
    const int64_t tl = u / heads;  // token * num_layers + layer
    const int h = static_cast<int>(u - tl * heads);
    const int64_t t = tl / num_layers;
    const int l = static_cast<int>(tl - t * num_layers);
    const int64_t s = slots[t];
    if (s < 0) continue;  // uniform over the warp
    const __nv_bfloat16* src = kv + u * head_dim;
    const int64_t base = l * pool_layer_elems;
    if (h < num_kv_heads) {
      detail::norm_rope_head<P>(src, k_norm ? k_norm + static_cast<int64_t>(l) * head_dim : nullptr, eps,
                                static_cast<float>(positions[t]), inv_freq, head_dim,
                                k_pool + base + (s * num_kv_heads + h) * head_dim);
    } else {
      detail::copy_head<P>(src, head_dim, v_pool + base + (s * num_kv_heads + h - num_kv_heads) * head_dim);
    }
  }
}

cudaError_t kv_norm_rope_write_layers(const __nv_bfloat16* kv, const __nv_bfloat16* k_norm, float eps,
                                      const int32_t* positions, const float* inv_freq, const int32_t* slots,
                                      int64_t num_tokens, int64_t num_layers, int64_t num_kv_heads,
                                      int64_t head_dim, int64_t pool_layer_elems, __nv_bfloat16* k_pool,
                                      __nv_bfloat16* v_pool, cudaStream_t stream) {
  if (num_tokens <= 0 || num_kv_heads <= 0 || num_layers <= 0) return cudaSuccess;
  if (head_dim <= 0 || head_dim % 2 != 0) return cudaErrorInvalidValue;
  const uintptr_t bits = reinterpret_cast<uintptr_t>(kv) | reinterpret_cast<uintptr_t>(k_norm) |
                         reinterpret_cast<uintptr_t>(k_pool) | reinterpret_cast<uintptr_t>(v_pool) |
                         static_cast<uintptr_t>(pool_layer_elems * 2);
  const int pairs = detail::rope_pairs_per_lane(head_dim, bits);
  const unsigned blocks =
      detail::grid_for(num_tokens * num_layers * 2 * num_kv_heads, kRopeThreads / 32, 1 << 20);
  const int nl = static_cast<int>(num_layers), nkv = static_cast<int>(num_kv_heads), hd = static_cast<int>(head_dim);
#define DFLASH_KV_ROPE_LAUNCH(P)                                                                \
  detail::launch(&kv_norm_rope_write_kernel<P>, blocks, kRopeThreads, 0, stream,                             \
      kv, k_norm, eps, positions, inv_freq, slots, num_tokens, nl, nkv, hd, pool_layer_elems, k_pool, v_pool)
  switch (pairs) {
    case 4: DFLASH_KV_ROPE_LAUNCH(4); break;
    case 2: DFLASH_KV_ROPE_LAUNCH(2); break;
    case 1: DFLASH_KV_ROPE_LAUNCH(1); break;
    default: DFLASH_KV_ROPE_LAUNCH(0); break;
  }
#undef DFLASH_KV_ROPE_LAUNCH
  return cudaGetLastError();
}

cudaError_t kv_norm_rope_write(const __nv_bfloat16* kv, const __nv_bfloat16* k_norm, float eps,
                               const int32_t* positions, const float* inv_freq,
                               const int32_t* slots, int64_t num_tokens, int64_t num_kv_heads,
                               int64_t head_dim, __nv_bfloat16* k_pool, __nv_bfloat16* v_pool,
                               cudaStream_t stream) {
  return kv_norm_rope_write_layers(kv, k_norm, eps, positions, inv_freq, slots, num_tokens, 1, num_kv_heads,
                                   head_dim, 0, k_pool, v_pool, stream);
}

}  // namespace cuda
}  // namespace dflash
