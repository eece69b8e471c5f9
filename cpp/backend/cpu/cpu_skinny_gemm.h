// out[M, N] = x[M, K] @ w[N, K]^T on the CPU, built for the rows of decode and verify steps, where
// OpenBLAS runs below the memory bandwidth (GEMV) or packs every weight before using it a few
// times (small-M GEMM). Two kernels: AVX-512 (any M, cpu_skinny_gemm_avx512.cpp: it also beat
// OpenBLAS on prefills of up to 1024 rows) and AVX2 + FMA (kCpuSkinnyMinRows <= M <=
// kCpuSkinnyAvx2MaxRows, cpu_skinny_gemm.cpp); measured on a 2-core AMD EPYC (bench/README.md). In both, each block of weight rows is read from memory once for all M rows,
// and every output is the same sequence of operations (lane partial sums over k, the lanes
// summed in a fixed order) whatever M and the blocking, so a row's result does not depend on the
// batch it is in (for one kernel).
#pragma once

#include <cstdint>

namespace dflash {

constexpr int64_t kCpuSkinnyMinRows = 2;  // AVX2 kernel: 1 row stays on BLAS GEMV
constexpr int64_t kCpuSkinnyAvx2MaxRows = 16;
// Weight rows per column block (a multiple of every tile width: 1, 3, 4, 6): the block of
// kCpuSkinnyColumnBlock x K floats stays in L2 while the row groups reuse it (the AVX-512 kernel
// takes smaller blocks for large K). Also the unit of the backend's thread split.
constexpr int64_t kCpuSkinnyColumnBlock = 96;

// True when this CPU has AVX2 and FMA / AVX-512F and FMA (checked once).
bool cpu_skinny_gemm_supported();
bool cpu_skinny_gemm_avx512_supported();

// Columns [n0, n1) of out[M, N] (row stride N): out[i, j] = sum_k x[i, k] * w[j, k].
void cpu_skinny_gemm(const float* x, const float* w, float* out, int64_t m, int64_t n, int64_t k, int64_t n0,
                     int64_t n1);
void cpu_skinny_gemm_avx512(const float* x, const float* w, float* out, int64_t m, int64_t n, int64_t k, int64_t n0,
                            int64_t n1);

}  // namespace dflash
