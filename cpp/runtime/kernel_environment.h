// The environment's overrides of a session's kernel choices: the only place below the Python
// layer that reads environment variables, once, when a session opens.
#pragma once

#include "dflash/kernel_options.h"

namespace dflash {
namespace runtime {

// `options` with each of DFLASH_GEMM, DFLASH_ATTENTION, DFLASH_CPU_GEMM, DFLASH_CUBLASLT_PATH
// (strings, taken as given; the backend validates them), DFLASH_FUSED and DFLASH_PDL ("0": off,
// anything else: on) that is set and not empty in place of its field.
KernelOptions kernel_options_with_environment(KernelOptions options);

}  // namespace runtime
}  // namespace dflash
