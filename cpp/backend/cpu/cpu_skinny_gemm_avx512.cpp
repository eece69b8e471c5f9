// AVX-512 skinny GEMM of the CPU backend (see cpu_skinny_gemm.h): out[M, N] = x[M, K] @ w[N, K]^T
// for any number of rows M (built for the few of decode and verify steps). Register
// tile: MB rows of x by NB rows of w, MB x NB accumulators of 16 lanes (NB from 6 at one row down
// to 3 at eight, so the tile fits the 32 zmm registers; more than 8 rows run as groups of 8 and
// the rest); every weight row of a column block is read from memory once, by the first row
// group (the block stays in L2 for the others), and from three rows on the next tile's weight
// rows are prefetched while this one runs, so a weight stream is in flight at every tile
// boundary. Each output is the same sequence of operations whatever M and the tile it falls in:
// 16-lane FMAs over k in order, a masked last chunk, then one fixed-order lane sum. This file is
// compiled with -mavx512f -mfma on x86-64 (elsewhere it is a stub); callers check
// cpu_skinny_gemm_avx512_supported() first.
#include "backend/cpu/cpu_skinny_gemm.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace dflash {

namespace {

// The fixed-order sum of the 16 lanes of v (halves, then quarters, ... as a tree).
inline float lane_sum(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

// out[i, j] for MB rows i0.. and NB weight rows j0.. over k; with `prefetch`, the NB weight rows
// after them (the next tile's) are prefetched into L1 alongside, one cache line per 16 k.
template <int MB, int NB>
inline void tile(const float* x, const float* w, float* out, int64_t n, int64_t k, int64_t i0, int64_t j0,
                 bool prefetch) {
  __m512 acc[MB][NB];
  for (int a = 0; a < MB; ++a) {
    for (int b = 0; b < NB; ++b) acc[a][b] = _mm512_setzero_ps();
  }
  const float* wr = w + j0 * k;
  const float* xr = x + i0 * k;
  const int64_t k16 = k / 16 * 16;
  for (int64_t p = 0; p < k16; p += 16) {
    if (prefetch) {
      for (int b = 0; b < NB; ++b) _mm_prefetch(reinterpret_cast<const char*>(wr + (NB + b) * k + p), _MM_HINT_T0);
    }
    __m512 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_ps(wr + b * k + p);
    for (int a = 0; a < MB; ++a) {
      const __m512 xv = _mm512_loadu_ps(xr + a * k + p);
      for (int b = 0; b < NB; ++b) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
    }
  }
  if (k16 < k) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (k - k16)) - 1u);
    __m512 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_maskz_loadu_ps(tail, wr + b * k + k16);
    for (int a = 0; a < MB; ++a) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, xr + a * k + k16);
      for (int b = 0; b < NB; ++b) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
    }
  }
  for (int a = 0; a < MB; ++a) {
    for (int b = 0; b < NB; ++b) out[(i0 + a) * n + j0 + b] = lane_sum(acc[a][b]);
  }
}

// Tile shape by MB, measured on a 2-core AMD EPYC (Zen 5) over every GEMM of a SmolLM2-135M step:
// NB weight rows per tile (MB x NB accumulators + NB weight vectors + one x vector within the
// 32 registers), and whether to prefetch the next tile (at one or two rows the hardware
// prefetcher keeps up and software prefetches only cost issue slots).
template <int MB>
constexpr int tile_columns() {
  return MB <= 4 ? 6 : MB == 5 ? 4 : 3;
}
template <int MB>
constexpr bool tile_prefetch() {
  return MB >= 3;
}

// MB rows from i0 against weight rows [c0, c1); the first row group of a block streams the
// weights from memory (a prefetch past the block or the matrix is a harmless hint), later ones
// find them in L2.
template <int MB>
void rows(const float* x, const float* w, float* out, int64_t n, int64_t k, int64_t i0, int64_t c0, int64_t c1) {
  constexpr int NB = tile_columns<MB>();
  const bool prefetch = tile_prefetch<MB>() && i0 == 0;
  int64_t j = c0;
  for (; j + NB <= c1; j += NB) tile<MB, NB>(x, w, out, n, k, i0, j, prefetch);
  for (; j < c1; ++j) tile<MB, 1>(x, w, out, n, k, i0, j, false);
}

}  // namespace

bool cpu_skinny_gemm_avx512_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  return ok;
}

void cpu_skinny_gemm_avx512(const float* x, const float* w, float* out, int64_t m, int64_t n, int64_t k, int64_t n0,
                            int64_t n1) {
  // Column blocks of up to kCpuSkinnyColumnBlock weight rows, all M rows per block; for long
  // rows (large K) fewer, a multiple of 24 (every tile width divides it), so that the block stays
  // within about 512 KiB of L2 for the row groups after the first.
  constexpr int64_t kBlockBytes = 512 << 10;
  int64_t block = kBlockBytes / (k * static_cast<int64_t>(sizeof(float))) / 24 * 24;
  block = block < 24 ? 24 : block > kCpuSkinnyColumnBlock ? kCpuSkinnyColumnBlock : block;
  for (int64_t c0 = n0; c0 < n1; c0 += block) {
    const int64_t c1 = c0 + block < n1 ? c0 + block : n1;
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) rows<8>(x, w, out, n, k, i, c0, c1);
    switch (m - i) {
      case 7: rows<7>(x, w, out, n, k, i, c0, c1); break;
      case 6: rows<6>(x, w, out, n, k, i, c0, c1); break;
      case 5: rows<5>(x, w, out, n, k, i, c0, c1); break;
      case 4: rows<4>(x, w, out, n, k, i, c0, c1); break;
      case 3: rows<3>(x, w, out, n, k, i, c0, c1); break;
      case 2: rows<2>(x, w, out, n, k, i, c0, c1); break;
      case 1: rows<1>(x, w, out, n, k, i, c0, c1); break;
      default: break;
    }
  }
}

}  // namespace dflash

#else  // not x86-64: no AVX-512 kernel

namespace dflash {
bool cpu_skinny_gemm_avx512_supported() { return false; }
void cpu_skinny_gemm_avx512(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t) {}
}  // namespace dflash

#endif
