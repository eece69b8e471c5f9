// Environment overrides of KernelOptions (see kernel_environment.h).
#include "runtime/kernel_environment.h"

#include <cstdlib>
#include <string>

namespace dflash {
namespace runtime {

namespace {

void override_string(const char* name, std::string* field) {
  const char* v = std::getenv(name);
  if (v != nullptr && *v != '\0') *field = v;
}

void override_switch(const char* name, bool* field) {
  const char* v = std::getenv(name);
  if (v != nullptr && *v != '\0') *field = std::string(v) != "0";
}

}  // namespace

KernelOptions kernel_options_with_environment(KernelOptions options) {
  override_string("DFLASH_GEMM", &options.gemm);
  override_switch("DFLASH_FUSED", &options.fused_layers);
  override_string("DFLASH_ATTENTION", &options.attention);
  override_string("DFLASH_L2_PREFETCH", &options.l2_prefetch);
  override_switch("DFLASH_ROPE_ATTENTION", &options.rope_attention);
  override_switch("DFLASH_PDL", &options.programmatic_launch);
  override_string("DFLASH_CPU_GEMM", &options.cpu_gemm);
  override_string("DFLASH_CUBLASLT_PATH", &options.cublaslt_path);
  override_switch("DFLASH_BATCH_INVARIANT", &options.batch_invariant);
  return options;
}

}  // namespace runtime
}  // namespace dflash
