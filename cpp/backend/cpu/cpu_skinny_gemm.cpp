// AVX2/FMA skinny GEMM of the CPU backend (see cpu_skinny_gemm.h). Register tile: 4 rows of x
// by 3 rows of w (12 accumulators + 3 weight vectors + 1 x vector = 16 ymm registers); row and
// column tails use smaller tiles with the same per-output arithmetic. This file is compiled with
// -mavx2 -mfma on x86-64 (elsewhere it is a stub that says unsupported); callers check cpu_skinny_gemm_supported() first.
#include "backend/cpu/cpu_skinny_gemm.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace dflash {

namespace {

// The fixed-order sum of the 8 lanes of v.
inline float lane_sum(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                    // (l0+l4, l1+l5, l2+l6, l3+l7)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));            // (.. +l2+l6, .. +l3+l7)
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

// out[i, j] for MB rows i0.. and NB weight rows j0.. over k.
template <int MB, int NB>
inline void tile(const float* x, const float* w, float* out, int64_t n, int64_t k, int64_t i0, int64_t j0) {
  __m256 acc[MB][NB];
  for (int a = 0; a < MB; ++a) {
    for (int b = 0; b < NB; ++b) acc[a][b] = _mm256_setzero_ps();
  }
  const int64_t k8 = k / 8 * 8;
  for (int64_t p = 0; p < k8; p += 8) {
    __m256 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm256_loadu_ps(w + (j0 + b) * k + p);
    for (int a = 0; a < MB; ++a) {
      const __m256 xv = _mm256_loadu_ps(x + (i0 + a) * k + p);
      for (int b = 0; b < NB; ++b) acc[a][b] = _mm256_fmadd_ps(xv, wv[b], acc[a][b]);
    }
  }
  for (int a = 0; a < MB; ++a) {
    for (int b = 0; b < NB; ++b) {
      float s = lane_sum(acc[a][b]);
      const float* xr = x + (i0 + a) * k;
      const float* wr = w + (j0 + b) * k;
      for (int64_t p = k8; p < k; ++p) s += xr[p] * wr[p];
      out[(i0 + a) * n + j0 + b] = s;
    }
  }
}

template <int MB>
void rows(const float* x, const float* w, float* out, int64_t n, int64_t k, int64_t i0, int64_t n0, int64_t n1) {
  int64_t j = n0;
  for (; j + 3 <= n1; j += 3) tile<MB, 3>(x, w, out, n, k, i0, j);
  for (; j < n1; ++j) tile<MB, 1>(x, w, out, n, k, i0, j);
}

}  // namespace

bool cpu_skinny_gemm_supported() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

void cpu_skinny_gemm(const float* x, const float* w, float* out, int64_t m, int64_t n, int64_t k, int64_t n0,
                     int64_t n1) {
  // Column blocks of 64 weight rows, all M rows per block: the block (64 x K floats) stays in
  // L2 while the row groups reuse it, so weights come from memory once.
  constexpr int64_t kColumnBlock = 64;
  for (int64_t c0 = n0; c0 < n1; c0 += kColumnBlock) {
    const int64_t c1 = c0 + kColumnBlock < n1 ? c0 + kColumnBlock : n1;
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) rows<4>(x, w, out, n, k, i, c0, c1);
    switch (m - i) {
      case 3: rows<3>(x, w, out, n, k, i, c0, c1); break;
      case 2: rows<2>(x, w, out, n, k, i, c0, c1); break;
      case 1: rows<1>(x, w, out, n, k, i, c0, c1); break;
      default: break;
    }
  }
}

}  // namespace dflash

#else  // not x86-64: no skinny kernel, BLAS does every GEMM

namespace dflash {
bool cpu_skinny_gemm_supported() { return false; }
void cpu_skinny_gemm(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t) {}
}  // namespace dflash

#endif
