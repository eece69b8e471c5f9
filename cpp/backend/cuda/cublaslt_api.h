// cuBLASLt loaded at run time (dlopen of libcublasLt.so.13), so the module imports on machines
// without cuBLAS and links against no CUDA library but the static runtime. Types come from the
// cublasLt.h header (PyPI nvidia-cublas or the toolkit).
#pragma once

#include <cublasLt.h>

#include <string>

namespace dflash {

struct CublasLtApi {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtDestroy) destroy = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
};

// Loads the library once (thread-safe), trying `first_try` (when not empty) before the default
// names on that first call; throws dflash::Error saying where it looked.
const CublasLtApi& cublaslt_api(const std::string& first_try = "");

}  // namespace dflash
