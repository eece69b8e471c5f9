// Splits the fused QKV projection into q, k, v heads with Qwen3's optional per-head RMSNorm on
// q and k and rotate-half RoPE on both: one warp per (token, head) unit, 8 warps per block,
// grid-stride over T * (nh + 2 nkv) units (see rope_common.cuh for the lane layout). The
// _write variant puts K and V straight into a layer's paged pools (no separate KV write).
#include "cuda/kernels.h"
#include "cuda/rope_common.cuh"

namespace dflash {
namespace cuda {

namespace {
constexpr int kThreads = 256;
}  // namespace

// qkv [T, (nh + 2 nkv) hd], q_norm / k_norm [hd] or null, positions [T], inv_freq [hd/2],
// q [T, nh, hd]; K/V row r of token t: r = slots[t] (skipped when negative) when slots is
// non-null (k, v are then a layer's paged pools), else r = t (k, v [T, nkv, hd]).
template <int P>
static __global__ void __launch_bounds__(kThreads)
    qkv_norm_rope_kernel(const __nv_bfloat16* qkv, const __nv_bfloat16* q_norm,
                         const __nv_bfloat16* k_norm, float eps, const int32_t* positions,
                         const float* inv_freq, const int32_t* slots, int64_t num_tokens, int num_heads,
                         int num_kv_heads, int head_dim, __nv_bfloat16* q, __nv_bfloat16* k, __nv_bfloat16* v) {
  detail::pdl_begin();
  const int heads = num_heads + 2 * num_kv_heads;
  const int64_t units = num_tokens * heads;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t u = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; u < units;
       u += warps) {
    const int64_t t = u / heads;
    const int h = static_cast<int>(u - t * heads);
    const __nv_bfloat16* src = qkv + u * head_dim;
    const float pos = static_cast<float>(positions[t]);
    if (h < num_heads) {
      detail::norm_rope_head<P>(src, q_norm, eps, pos, inv_freq, head_dim,
                                q + (t * num_heads + h) * head_dim);
      continue;
    }
    const int64_t row = slots ? static_cast<int64_t>(slots[t]) : t;
    if (row < 0) continue;  // uniform over the warp
    if (h < num_heads + num_kv_heads) {
      detail::norm_rope_head<P>(src, k_norm, eps, pos, inv_freq, head_dim,
                                k + (row * num_kv_heads + h - num_heads) * head_dim);
    } else {
      detail::copy_head<P>(src, head_dim, v + (row * num_kv_heads + h - num_heads - num_kv_heads) * head_dim);
    }
  }
}

static cudaError_t launch_qkv_norm_rope(const __nv_bfloat16* qkv, const __nv_bfloat16* q_norm,
                                       const __nv_bfloat16* k_norm, float eps, const int32_t* positions,
                                       const float* inv_freq, const int32_t* slots, int64_t num_tokens,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       __nv_bfloat16* q, __nv_bfloat16* k, __nv_bfloat16* v, cudaStream_t stream) {
  if (num_tokens <= 0 || num_heads + num_kv_heads <= 0) return cudaSuccess;
  if (head_dim <= 0 || head_dim % 2 != 0 || num_heads < 0 || num_kv_heads < 0 ||
      (num_heads > 0 && q == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const uintptr_t bits = reinterpret_cast<uintptr_t>(qkv) | reinterpret_cast<uintptr_t>(q) |
                         reinterpret_cast<uintptr_t>(k) | reinterpret_cast<uintptr_t>(v) |
                         reinterpret_cast<uintptr_t>(q_norm) | reinterpret_cast<uintptr_t>(k_norm);
  const int pairs = detail::rope_pairs_per_lane(head_dim, bits);
  const int64_t units = num_tokens * (num_heads + 2 * num_kv_heads);
  const unsigned blocks = detail::grid_for(units, kThreads / 32, 1 << 20);
  const int nh = static_cast<int>(num_heads), nkv = static_cast<int>(num_kv_heads);
  const int hd = static_cast<int>(head_dim);
#define DFLASH_QKV_LAUNCH(P)                                                                   \
  detail::launch(&qkv_norm_rope_kernel<P>, blocks, kThreads, 0, stream, qkv, q_norm, k_norm, eps, positions, \
                                                           inv_freq, slots, num_tokens, nh, nkv, hd, \
                                                           q, k, v)
  switch (pairs) {
    case 4: DFLASH_QKV_LAUNCH(4); break;
    case 2: DFLASH_QKV_LAUNCH(2); break;
    case 1: DFLASH_QKV_LAUNCH(1); break;
    default: DFLASH_QKV_LAUNCH(0); break;
  }
#undef DFLASH_QKV_LAUNCH
  return cudaGetLastError();
}

cudaError_t qkv_norm_rope(const __nv_bfloat16* qkv, const __nv_bfloat16* q_norm,
                          const __nv_bfloat16* k_norm, float eps, const int32_t* positions,
                          const float* inv_freq, int64_t num_tokens, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, __nv_bfloat16* q,
                          __nv_bfloat16* k, __nv_bfloat16* v, cudaStream_t stream) {
  return launch_qkv_norm_rope(qkv, q_norm, k_norm, eps, positions, inv_freq, nullptr, num_tokens, num_heads,
                              num_kv_heads, head_dim, q, k, v, stream);
}

cudaError_t qkv_norm_rope_write(const __nv_bfloat16* qkv, const __nv_bfloat16* q_norm,
                                const __nv_bfloat16* k_norm, float eps, const int32_t* positions,
                                const float* inv_freq, const int32_t* slots, int64_t num_tokens,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, __nv_bfloat16* q,
                                __nv_bfloat16* k_pool, __nv_bfloat16* v_pool, cudaStream_t stream) {
  if (slots == nullptr) return cudaErrorInvalidValue;
  return launch_qkv_norm_rope(qkv, q_norm, k_norm, eps, positions, inv_freq, slots, num_tokens, num_heads,
                              num_kv_heads, head_dim, q, k_pool, v_pool, stream);
}

}  // namespace cuda
}  // namespace dflash
