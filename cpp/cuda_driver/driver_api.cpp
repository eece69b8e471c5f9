// Run-time resolution of the CUDA driver API through the static CUDA runtime (see driver_api.h).
#include "cuda_driver/driver_api.h"

#include <atomic>
#include <cstdlib>

#include <cuda_runtime_api.h>

namespace dflash {
namespace cuda_driver {
namespace {

// Driver version whose prototype the DriverApi member types (PFN_*_vNNNN) describe.
constexpr int kBaseVersion = 12000;
constexpr int kV12040 = 12040;

template <typename Fn>
void resolve(Fn* out, const char* name, int version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &query);
  if (err != cudaSuccess || query != cudaDriverEntryPointSuccess || fn == nullptr) {
    const char* why = query == cudaDriverEntryPointVersionNotSufficent
                          ? "the installed driver is too old"
                          : (query == cudaDriverEntryPointSymbolNotFound ? "symbol not found"
                                                                         : "lookup failed");
    throw Error(detail::concat("CUDA driver entry point ", name, " (version ", version,
                               ") is unavailable: ", why, "; cudaGetDriverEntryPointByVersion: ",
                               cudaGetErrorName(err), " (", cudaGetErrorString(err),
                               "). Is an NVIDIA driver for CUDA >= 12.4 installed?"));
  }
  *out = reinterpret_cast<Fn>(fn);
}

DriverApi resolve_all() {
  DriverApi api{};
  resolve(&api.cuGetErrorString, "cuGetErrorString", kBaseVersion);
  resolve(&api.cuGetErrorName, "cuGetErrorName", kBaseVersion);
  resolve(&api.cuCtxGetCurrent, "cuCtxGetCurrent", kBaseVersion);
  resolve(&api.cuCtxGetDevice, "cuCtxGetDevice", kBaseVersion);
  resolve(&api.cuCtxSynchronize, "cuCtxSynchronize", kBaseVersion);
  resolve(&api.cuDeviceGetAttribute, "cuDeviceGetAttribute", kBaseVersion);
  resolve(&api.cuModuleLoadData, "cuModuleLoadData", kBaseVersion);
  resolve(&api.cuModuleUnload, "cuModuleUnload", kBaseVersion);
  resolve(&api.cuModuleGetFunction, "cuModuleGetFunction", kBaseVersion);
  resolve(&api.cuFuncGetAttribute, "cuFuncGetAttribute", kBaseVersion);
  resolve(&api.cuFuncSetAttribute, "cuFuncSetAttribute", kBaseVersion);
  resolve(&api.cuFuncGetParamInfo, "cuFuncGetParamInfo", kV12040);
  resolve(&api.cuFuncLoad, "cuFuncLoad", kV12040);
  resolve(&api.cuLaunchKernel, "cuLaunchKernel", kBaseVersion);
  resolve(&api.cuLaunchKernelEx, "cuLaunchKernelEx", kBaseVersion);
  resolve(&api.cuStreamSynchronize, "cuStreamSynchronize", kBaseVersion);
  return api;
}

}  // namespace

const DriverApi& driver_api() {
  static const DriverApi api = resolve_all();  // a throw leaves it uninitialised: retried
  return api;
}

namespace {
std::atomic<bool> pdl_on{true};
}  // namespace

bool pdl_enabled() { return pdl_on.load(std::memory_order_relaxed); }

void set_pdl_enabled(bool on) { pdl_on.store(on, std::memory_order_relaxed); }

std::string cu_error_string(CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  try {
    const DriverApi& api = driver_api();
    api.cuGetErrorName(result, &name);
    api.cuGetErrorString(result, &text);
  } catch (const Error&) {
    name = nullptr;
  }
  if (name == nullptr) return detail::concat("CUresult ", static_cast<int>(result));
  return detail::concat(name, ": ", text != nullptr ? text : "(no description)");
}

}  // namespace cuda_driver
}  // namespace dflash
