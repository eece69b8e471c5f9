// Linear layers through cuBLASLt: out[M, N] = x[M, K] @ w[N, K]^T with bf16 inputs, fp32
// accumulation, and bf16 or fp32 output. The matmul descriptor, layouts and the heuristic's
// algorithm are cached per shape; one workspace, allocated up front, serves every call.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>

#include "backend/cuda/cublaslt_api.h"

namespace dflash {

class CublasLtGemm {
 public:
  // library_path: a libcublasLt.so tried first when cuBLASLt is not loaded yet ("": the default names).
  CublasLtGemm(void* workspace, size_t workspace_bytes, const std::string& library_path = "");
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  // x [M, K] bf16, w [N, K] bf16 (row-major), out [M, N] bf16 or fp32; with accumulate,
  // out += x @ w^T (beta = 1, in place).
  void linear(const void* x, const void* w, void* out, int64_t m, int64_t n, int64_t k, bool out_f32,
              cudaStream_t stream, bool accumulate = false);

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo;
  };
  const Plan& plan(int64_t m, int64_t n, int64_t k, bool out_f32);

  const CublasLtApi& api_;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_;
  size_t workspace_bytes_;
  std::map<std::tuple<int64_t, int64_t, int64_t, bool>, Plan> plans_;
};

}  // namespace dflash
