// RMSNorm of bf16 rows, and the decoder's fused residual add + RMSNorm. One thread block per
// row (grid-stride over rows); each thread keeps up to kCache 16-byte vectors of its row in
// registers between the sum-of-squares pass and the scaling pass (re-read beyond that).
// Statistics in fp32; out = bf16(w * (x * rsqrt(mean(x^2) + eps))).
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

namespace {
constexpr int kCache = 4;        // vectors per thread held in registers
constexpr int kMaxThreads = 256;  // a 4096-wide row: 512 vectors, 2 per thread
}  // namespace

// residual [R, H] (kAdd: updated in place to bf16(residual + x), and normalised), x [R, H],
// w [H], out [R, H]. V = 8 (16-byte accesses) or 1.
template <int V, bool kAdd>
static __global__ void __launch_bounds__(kMaxThreads)
    rms_norm_kernel(__nv_bfloat16* residual, const __nv_bfloat16* x, const __nv_bfloat16* w,
                    int64_t rows, int hidden, float eps, __nv_bfloat16* out) {
  detail::pdl_begin();
  __shared__ float red[32];
  const int nvec = hidden / V;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const __nv_bfloat16* xr = x + r * hidden;
    __nv_bfloat16* resr = kAdd ? residual + r * hidden : nullptr;
    __nv_bfloat16* outr = out + r * hidden;

    // Pass 1: load (and add), sum of squares.
    auto load = [&](int i, float (&v)[V]) {
      detail::load_bf16<V>(xr + i * V, v);
      if (kAdd) {
        float a[V];
        detail::load_bf16<V>(resr + i * V, a);
#pragma unroll
        for (int e = 0; e < V; ++e) v[e] = __bfloat162float(__float2bfloat16_rn(a[e] + v[e]));
        detail::store_bf16<V>(resr + i * V, v);  // the residual stream stays bf16
      }
    };
    float cache[kCache][V];
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
      const int i = threadIdx.x + c * blockDim.x;
      if (i < nvec) {
        load(i, cache[c]);
#pragma unroll
        for (int e = 0; e < V; ++e) ss += cache[c][e] * cache[c][e];
      }
    }
    for (int i = threadIdx.x + kCache * blockDim.x; i < nvec; i += blockDim.x) {
      float v[V];
      load(i, v);
#pragma unroll
      for (int e = 0; e < V; ++e) ss += v[e] * v[e];
    }
    ss = detail::block_sum(ss, red);
    const float inv = rsqrtf(ss / static_cast<float>(hidden) + eps);

    // Pass 2: scale by inv and the weight.
    auto emit = [&](int i, const float (&v)[V]) {
      float wv[V], o[V];
      detail::load_bf16<V>(w + i * V, wv);
#pragma unroll
      for (int e = 0; e < V; ++e) o[e] = wv[e] * (v[e] * inv);
      detail::store_bf16<V>(outr + i * V, o);
    };
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
      const int i = threadIdx.x + c * blockDim.x;
      if (i < nvec) emit(i, cache[c]);
    }
    for (int i = threadIdx.x + kCache * blockDim.x; i < nvec; i += blockDim.x) {
      float v[V];
      detail::load_bf16<V>((kAdd ? resr : xr) + i * V, v);  // the residual is already updated
      emit(i, v);
    }
  }
}

template <bool kAdd>
static cudaError_t rms_norm_launch(__nv_bfloat16* residual, const __nv_bfloat16* x,
                                   const __nv_bfloat16* w, int64_t rows, int64_t hidden, float eps,
                                   __nv_bfloat16* out, cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return cudaSuccess;
  if (hidden > INT32_MAX / 2) return cudaErrorInvalidValue;
  const bool vec = hidden % detail::kVec == 0 && detail::aligned16(x) && detail::aligned16(w) &&
                   detail::aligned16(out) && (!kAdd || detail::aligned16(residual));
  const int64_t nvec = vec ? hidden / detail::kVec : hidden;
  const int threads = static_cast<int>(nvec >= kMaxThreads ? kMaxThreads : (nvec + 31) / 32 * 32);
  const unsigned blocks = detail::grid_for(rows, 1, 1 << 20);
  const int h = static_cast<int>(hidden);
  if (vec) {
    detail::launch(&rms_norm_kernel<8, kAdd>, blocks, threads, 0, stream, residual, x, w, rows, h, eps, out);
  } else {
    detail::launch(&rms_norm_kernel<1, kAdd>, blocks, threads, 0, stream, residual, x, w, rows, h, eps, out);
  }
  return cudaGetLastError();
}

cudaError_t rms_norm(const __nv_bfloat16* x, const __nv_bfloat16* w, int64_t rows, int64_t hidden,
                     float eps, __nv_bfloat16* out, cudaStream_t stream) {
  return rms_norm_launch<false>(nullptr, x, w, rows, hidden, eps, out, stream);
}

cudaError_t add_rms_norm(__nv_bfloat16* residual, const __nv_bfloat16* x, const __nv_bfloat16* w,
                         int64_t rows, int64_t hidden, float eps, __nv_bfloat16* out,
                         cudaStream_t stream) {
  return rms_norm_launch<true>(residual, x, w, rows, hidden, eps, out, stream);
}

}  // namespace cuda
}  // namespace dflash
