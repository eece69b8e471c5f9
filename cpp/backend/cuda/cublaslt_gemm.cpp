// cuBLASLt GEMM plans and calls (see cublaslt_gemm.h). Row-major y = x w^T is computed as the
// column-major product y^T [N, M] = (w [K, N] col-major)^T x^T [K, M].
#include "backend/cuda/cublaslt_gemm.h"

#include "common/error.h"

namespace dflash {

#define DFLASH_CUBLAS_CHECK(expr)                                                       \
  do {                                                                                  \
    cublasStatus_t st_ = (expr);                                                        \
    DFLASH_CHECK(st_ == CUBLAS_STATUS_SUCCESS, #expr, " failed with cuBLAS status ", \
                 static_cast<int>(st_));                                                \
  } while (0)

CublasLtGemm::CublasLtGemm(void* workspace, size_t workspace_bytes, const std::string& library_path)
    : api_(cublaslt_api(library_path)), workspace_(workspace), workspace_bytes_(workspace_bytes) {
  DFLASH_CUBLAS_CHECK(api_.create(&handle_));
}

CublasLtGemm::~CublasLtGemm() {
  for (auto& [key, p] : plans_) {
    api_.layout_destroy(p.a);
    api_.layout_destroy(p.b);
    api_.layout_destroy(p.c);
    api_.desc_destroy(p.desc);
  }
  if (handle_) api_.destroy(handle_);
}

const CublasLtGemm::Plan& CublasLtGemm::plan(int64_t m, int64_t n, int64_t k, bool out_f32) {
  auto key = std::make_tuple(m, n, k, out_f32);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  Plan p;
  DFLASH_CUBLAS_CHECK(api_.desc_create(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  DFLASH_CUBLAS_CHECK(api_.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  DFLASH_CUBLAS_CHECK(api_.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  // A = w: col-major [K, N], ld K;  B = x: col-major [K, M], ld K;  C = y: col-major [N, M], ld N.
  DFLASH_CUBLAS_CHECK(api_.layout_create(&p.a, CUDA_R_16BF, k, n, k));
  DFLASH_CUBLAS_CHECK(api_.layout_create(&p.b, CUDA_R_16BF, k, m, k));
  DFLASH_CUBLAS_CHECK(api_.layout_create(&p.c, out_f32 ? CUDA_R_32F : CUDA_R_16BF, n, m, n));
  cublasLtMatmulPreference_t pref;
  DFLASH_CUBLAS_CHECK(api_.pref_create(&pref));
  uint64_t ws = workspace_bytes_;
  DFLASH_CUBLAS_CHECK(api_.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  cublasStatus_t st = api_.heuristic(handle_, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  api_.pref_destroy(pref);
  DFLASH_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0, "cuBLASLt found no algorithm for [", m, ", ", k,
               "] x [", n, ", ", k, "]^T (status ", static_cast<int>(st), ")");
  p.algo = result.algo;
  return plans_.emplace(key, p).first->second;
}

void CublasLtGemm::linear(const void* x, const void* w, void* out, int64_t m, int64_t n, int64_t k, bool out_f32,
                          cudaStream_t stream, bool accumulate) {
  if (m == 0) return;
  const Plan& p = plan(m, n, k, out_f32);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  DFLASH_CUBLAS_CHECK(api_.matmul(handle_, p.desc, &alpha, w, p.a, x, p.b, &beta, out, p.c, out, p.c, &p.algo,
                                  workspace_, workspace_bytes_, stream));
}

}  // namespace dflash
