// Run-time loading of cuBLASLt (see cublaslt_api.h).
#include "backend/cuda/cublaslt_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "common/error.h"

namespace dflash {

namespace {

void* open_library(const std::string& first_try, std::string* tried) {
  std::vector<std::string> names;
  if (!first_try.empty()) names.push_back(first_try);
  names.push_back("libcublasLt.so.13");
  names.push_back("/usr/local/cuda/lib64/libcublasLt.so.13");
  for (const auto& n : names) {
    if (void* h = dlopen(n.c_str(), RTLD_NOW | RTLD_GLOBAL)) return h;
    *tried += (tried->empty() ? "" : ", ") + n;
  }
  return nullptr;
}

template <typename Fn>
void resolve(void* lib, const char* name, Fn* out) {
  *out = reinterpret_cast<Fn>(dlsym(lib, name));
  DFLASH_CHECK(*out != nullptr, "libcublasLt has no symbol ", name);
}

}  // namespace

const CublasLtApi& cublaslt_api(const std::string& first_try) {
  static CublasLtApi api;
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [&first_try] {
    std::string tried;
    void* lib = open_library(first_try, &tried);
    if (!lib) {
      error = "cannot load cuBLASLt (tried " + tried +
              "); install the PyPI package nvidia-cublas or set DFLASH_CUBLASLT_PATH (KernelOptions::cublaslt_path)";
      return;
    }
    try {
      resolve(lib, "cublasLtCreate", &api.create);
      resolve(lib, "cublasLtDestroy", &api.destroy);
      resolve(lib, "cublasLtMatmulDescCreate", &api.desc_create);
      resolve(lib, "cublasLtMatmulDescDestroy", &api.desc_destroy);
      resolve(lib, "cublasLtMatmulDescSetAttribute", &api.desc_set);
      resolve(lib, "cublasLtMatrixLayoutCreate", &api.layout_create);
      resolve(lib, "cublasLtMatrixLayoutDestroy", &api.layout_destroy);
      resolve(lib, "cublasLtMatmulPreferenceCreate", &api.pref_create);
      resolve(lib, "cublasLtMatmulPreferenceDestroy", &api.pref_destroy);
      resolve(lib, "cublasLtMatmulPreferenceSetAttribute", &api.pref_set);
      resolve(lib, "cublasLtMatmulAlgoGetHeuristic", &api.heuristic);
      resolve(lib, "cublasLtMatmul", &api.matmul);
    } catch (const Error& e) {
      error = e.what();
    }
  });
  DFLASH_CHECK(error.empty(), error);
  return api;
}

}  // namespace dflash
