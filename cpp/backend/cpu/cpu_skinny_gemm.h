// out[M, N] = x[M, K] @ w[N, K]^T on the CPU for the few rows of decode and verify steps
// (1 <= M <= kCpuSkinnyMaxRows), with AVX2 + FMA: each block of weight rows is read from memory
// once for all M rows (BLAS runs small-M GEMMs far below the cores' FMA rate). Every output is
// the same sequence of operations (8-lane partial sums over k, the lanes summed in a fixed
// order, then the k tail), whatever M and the blocking, so a row's result does not depend on
// the batch it is in.
#pragma once

#include <cstdint>

namespace dflash {

constexpr int64_t kCpuSkinnyMinRows = 2;
constexpr int64_t kCpuSkinnyMaxRows = 4;

// True when this CPU has AVX2 and FMA (checked once).
bool cpu_skinny_gemm_supported();

// Columns [n0, n1) of out[M, N] (row stride N): out[i, j] = sum_k x[i, k] * w[j, k].
void cpu_skinny_gemm(const float* x, const float* w, float* out, int64_t m, int64_t n, int64_t k, int64_t n0,
                     int64_t n1);

}  // namespace dflash
