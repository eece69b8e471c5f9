// One warp per attention head: optional per-head RMSNorm (Qwen3's q_norm / k_norm) followed by
// rotate-half RoPE, shared by qkv_norm_rope.cu and kv_write.cu (kv_norm_rope_write). Lane l owns
// the pairs (i, i + hd/2) for i in [l*P, l*P + P), so hd = 64 P (P = 1: hd 64, 2: 128, 4: 256);
// P = 0 is the generic path for any even hd (strided lanes, the head read twice).
// angle = position * inv_freq[i] in fp32 (sincosf, accurate for large positions).
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "cuda/common.cuh"

namespace dflash {
namespace cuda {
namespace detail {

// P contiguous bf16 ↔ fp32 with one access of 2P bytes (pointer aligned to 2P bytes).
template <int P>
__device__ __forceinline__ void load_pairs(const __nv_bfloat16* p, float (&f)[P]) {
  if constexpr (P == 4) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
    const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
    f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
  } else if constexpr (P == 2) {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
    f[0] = a.x, f[1] = a.y;
  } else {
#pragma unroll
    for (int e = 0; e < P; ++e) f[e] = __bfloat162float(p[e]);
  }
}

template <int P>
__device__ __forceinline__ void store_pairs(__nv_bfloat16* p, const float (&f)[P]) {
  if constexpr (P == 4) {
    uint2 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
    h[0] = __floats2bfloat162_rn(f[0], f[1]);
    h[1] = __floats2bfloat162_rn(f[2], f[3]);
    *reinterpret_cast<uint2*>(p) = v;
  } else if constexpr (P == 2) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(f[0], f[1]);
  } else {
#pragma unroll
    for (int e = 0; e < P; ++e) p[e] = __float2bfloat16_rn(f[e]);
  }
}

// dst[hd] = rope(rmsnorm(src[hd]) * norm_w) (no norm when norm_w is null). Called by a whole warp.
template <int P>
__device__ __forceinline__ void norm_rope_head(const __nv_bfloat16* src, const __nv_bfloat16* norm_w,
                                               float eps, float pos, const float* inv_freq, int hd,
                                               __nv_bfloat16* dst) {
  const int lane = threadIdx.x & 31;
  if constexpr (P > 0) {
    constexpr int kHalf = 32 * P;
    const int i0 = lane * P;
    float x1[P], x2[P];
    load_pairs<P>(src + i0, x1);
    load_pairs<P>(src + kHalf + i0, x2);
    if (norm_w != nullptr) {
      float ss = 0.0f;
#pragma unroll
      for (int e = 0; e < P; ++e) ss += x1[e] * x1[e] + x2[e] * x2[e];
      const float inv = rsqrtf(warp_sum(ss) / static_cast<float>(2 * kHalf) + eps);
      float w1[P], w2[P];
      load_pairs<P>(norm_w + i0, w1);
      load_pairs<P>(norm_w + kHalf + i0, w2);
#pragma unroll
      for (int e = 0; e < P; ++e) {
        x1[e] = w1[e] * (x1[e] * inv);
        x2[e] = w2[e] * (x2[e] * inv);
      }
    }
    float o1[P], o2[P];
#pragma unroll
    for (int e = 0; e < P; ++e) {
      float s, c;
      sincosf(pos * inv_freq[i0 + e], &s, &c);
      o1[e] = x1[e] * c - x2[e] * s;
      o2[e] = x2[e] * c + x1[e] * s;
    }
    store_pairs<P>(dst + i0, o1);
    store_pairs<P>(dst + kHalf + i0, o2);
  } else {
    const int half = hd / 2;
    float inv = 1.0f;
    if (norm_w != nullptr) {
      float ss = 0.0f;
      for (int i = lane; i < hd; i += 32) {
        const float x = __bfloat162float(src[i]);
        ss += x * x;
      }
      inv = rsqrtf(warp_sum(ss) / static_cast<float>(hd) + eps);
    }
    for (int i = lane; i < half; i += 32) {
      float x1 = __bfloat162float(src[i]), x2 = __bfloat162float(src[i + half]);
      if (norm_w != nullptr) {
        x1 = __bfloat162float(norm_w[i]) * (x1 * inv);
        x2 = __bfloat162float(norm_w[i + half]) * (x2 * inv);
      }
      float s, c;
      sincosf(pos * inv_freq[i], &s, &c);
      dst[i] = __float2bfloat16_rn(x1 * c - x2 * s);
      dst[i + half] = __float2bfloat16_rn(x2 * c + x1 * s);
    }
  }
}

// dst[hd] = src[hd], the same lane layout. Called by a whole warp.
template <int P>
__device__ __forceinline__ void copy_head(const __nv_bfloat16* src, int hd, __nv_bfloat16* dst) {
  const int lane = threadIdx.x & 31;
  if constexpr (P > 0) {
    constexpr int kHalf = 32 * P;
    const int i0 = lane * P;
    float a[P], b[P];
    load_pairs<P>(src + i0, a);
    load_pairs<P>(src + kHalf + i0, b);
    store_pairs<P>(dst + i0, a);
    store_pairs<P>(dst + kHalf + i0, b);
  } else {
    for (int i = lane; i < hd; i += 32) dst[i] = src[i];
  }
}

// The P of a head: 1, 2 or 4 when hd = 64 P and every pointer allows 2P-byte accesses, else 0.
inline int rope_pairs_per_lane(int64_t hd, uintptr_t pointer_bits) {
  for (int p = 4; p >= 1; p /= 2) {
    if (hd == 64 * p && (pointer_bits & static_cast<uintptr_t>(2 * p - 1)) == 0) return p;
  }
  return 0;
}

}  // namespace detail
}  // namespace cuda
}  // namespace dflash
