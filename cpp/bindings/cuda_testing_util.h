// Shared pieces of the test-only CUDA kernel bindings (cuda_testing_*.cpp): the torch-tensor
// types they take, the bf16 pointer check, the device switch, and the launch convention (launch
// on the default stream and synchronise, raising CUDA errors as dflash::Error; with `stream`, a
// cudaStream_t as an int, launch there without synchronising, for benchmarks and graph capture).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>

#include "common/error.h"

namespace dflash {
namespace testing_bindings {

namespace nb = nanobind;

using Any = nb::ndarray<nb::device::cuda, nb::c_contig>;
using F32 = nb::ndarray<float, nb::device::cuda, nb::c_contig>;
using I32 = nb::ndarray<int32_t, nb::device::cuda, nb::c_contig>;
using U8 = nb::ndarray<uint8_t, nb::device::cuda, nb::c_contig>;
using Stream = std::optional<uintptr_t>;

inline __nv_bfloat16* bf16(const Any& a, const char* name) {
  DFLASH_ARG_CHECK(a.dtype().code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && a.dtype().bits == 16,
                   name, " must be a bfloat16 tensor");
  return static_cast<__nv_bfloat16*>(a.data());
}

inline cudaStream_t as_stream(const Stream& s) { return s ? reinterpret_cast<cudaStream_t>(*s) : nullptr; }

// Checks the launch; without a stream also waits for the kernel and checks its completion.
inline void run(const char* op, const Stream& stream, cudaError_t launched) {
  DFLASH_CHECK(launched == cudaSuccess, op, ": launch failed: ", cudaGetErrorString(launched));
  if (stream) return;
  const cudaError_t done = cudaDeviceSynchronize();
  DFLASH_CHECK(done == cudaSuccess, op, ": kernel failed: ", cudaGetErrorString(done));
}

inline void use_device(int device) {
  const cudaError_t e = cudaSetDevice(device);
  DFLASH_CHECK(e == cudaSuccess, "cudaSetDevice(", device, "): ", cudaGetErrorString(e));
}

}  // namespace testing_bindings
}  // namespace dflash
