// CUDA driver API entry points resolved once at run time through the CUDA runtime
// (cudaGetDriverEntryPointByVersion), so that the library links only the static cudart and
// never libcuda: the build and CI machines have no driver, and `import dflash` must work there.
// Each pointer has the prototype of the driver version it is requested at (<cudaTypedefs.h>),
// not the one of the headers' CUDA version (cuCtxSynchronize, for one, changed in 13.0).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

#include "common/error.h"

namespace dflash {
namespace cuda_driver {

// The driver functions dflash calls. All non-null once driver_api() has returned.
struct DriverApi {
  PFN_cuGetErrorString_v6000 cuGetErrorString;
  PFN_cuGetErrorName_v6000 cuGetErrorName;
  PFN_cuCtxGetCurrent_v4000 cuCtxGetCurrent;
  PFN_cuCtxGetDevice_v2000 cuCtxGetDevice;
  PFN_cuCtxSynchronize_v2000 cuCtxSynchronize;
  PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute;
  PFN_cuModuleLoadData_v2000 cuModuleLoadData;
  PFN_cuModuleUnload_v2000 cuModuleUnload;
  PFN_cuModuleGetFunction_v2000 cuModuleGetFunction;
  PFN_cuFuncGetAttribute_v2020 cuFuncGetAttribute;
  PFN_cuFuncSetAttribute_v9000 cuFuncSetAttribute;
  PFN_cuFuncGetParamInfo_v12040 cuFuncGetParamInfo;  // driver >= 12.4
  PFN_cuFuncLoad_v12040 cuFuncLoad;                  // driver >= 12.4
  PFN_cuLaunchKernel_v4000 cuLaunchKernel;
  PFN_cuLaunchKernelEx_v11060 cuLaunchKernelEx;
  PFN_cuStreamSynchronize_v2000 cuStreamSynchronize;
};

// Resolves every entry point on the first call (thread-safe) and returns them. Throws
// dflash::Error naming the first one that is missing (no driver, or one older than 12.4); a later
// call tries again. After one successful call it never throws.
const DriverApi& driver_api();

// Whether kernels are launched with programmatic dependent launch (on by default): one
// process-wide switch for the Triton launchers and the hand-written kernels (cuda/common.cuh),
// set by the CUDA backend from KernelOptions::programmatic_launch when a session opens.
bool pdl_enabled();
void set_pdl_enabled(bool on);

// "CUDA_ERROR_NAME: description" of a driver result; never throws (falls back to the number
// when the driver is unavailable).
std::string cu_error_string(CUresult result);

}  // namespace cuda_driver
}  // namespace dflash

// DFLASH_CU_CHECK(expr): evaluates a CUresult expression, throws dflash::Error with the
// expression and the driver's error text when it is not CUDA_SUCCESS.
#define DFLASH_CU_CHECK(expr)                                                                \
  do {                                                                                       \
    const CUresult dflash_cu_result_ = (expr);                                               \
    if (dflash_cu_result_ != CUDA_SUCCESS) {                                                 \
      throw ::dflash::Error(::dflash::detail::concat(                                        \
          #expr, " failed: ", ::dflash::cuda_driver::cu_error_string(dflash_cu_result_), " [", \
          __FILE__, ":", __LINE__, "]"));                                                    \
    }                                                                                        \
  } while (0)
