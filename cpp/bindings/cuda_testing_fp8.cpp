// Test-only bindings of the FP8 candidate head's kernels of cuda/ (fp8_quantize_rows, linear_fp8,
// rescore_candidates), added to dflash._core.testing as cuda_<op>, with the conventions of
// cuda_testing_dflash2.cpp: torch CUDA tensors in and out (contiguous, outputs passed in, nothing
// allocated), launch on the default stream and synchronise, raising CUDA errors as dflash::Error;
// with `stream` (a cudaStream_t as an int) they launch there without synchronising (benchmarks,
// CUDA-graph capture). Built only with CUDA.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>

#include "bindings/cuda_testing_util.h"
#include "common/error.h"
#include "cuda/kernels.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace dflash {
namespace {

using namespace testing_bindings;

// w [V, H] bf16 -> q [V, H] uint8 (e4m3 bytes), scale [V] fp32.
void cuda_fp8_quantize_rows(const Any& w, const U8& q, const F32& scale, const Stream& stream) {
  DFLASH_ARG_CHECK(w.ndim() == 2 && q.ndim() == 2 && q.shape(0) == w.shape(0) && q.shape(1) == w.shape(1) &&
                       scale.size() == w.shape(0),
                   "fp8_quantize_rows: w [V, H], q [V, H] uint8, scale [V] float32");
  use_device(w.device_id());
  run("fp8_quantize_rows", stream,
      cuda::fp8_quantize_rows(bf16(w, "w"), w.shape(0), w.shape(1), q.data(), scale.data(), as_stream(stream)));
}

// out [M, V] fp32 = x [M, H] bf16 @ (scale[v] * e4m3(q[v, :]))^T, M <= kFp8GemvMaxRows.
void cuda_linear_fp8(const Any& x, const U8& q, const F32& scale, const F32& out, const Stream& stream) {
  DFLASH_ARG_CHECK(x.ndim() == 2 && q.ndim() == 2 && out.ndim() == 2 && x.shape(1) == q.shape(1) &&
                       scale.size() == q.shape(0) && out.shape(0) == x.shape(0) && out.shape(1) == q.shape(0),
                   "linear_fp8: x [M, H], q [V, H], scale [V], out [M, V]");
  use_device(x.device_id());
  run("linear_fp8", stream,
      cuda::linear_fp8(bf16(x, "x"), q.data(), scale.data(), x.shape(0), q.shape(0), q.shape(1), out.data(),
                       as_stream(stream)));
}

// ids [R, K] (in/out, re-sorted), unary [R, K] from h [R, H] and the exact head [V, H] (bf16).
void cuda_rescore_candidates(const Any& h, const Any& head, const I32& ids, const F32& unary, float multiplier,
                             float softcap, const Stream& stream) {
  DFLASH_ARG_CHECK(h.ndim() == 2 && head.ndim() == 2 && ids.ndim() == 2 && h.shape(1) == head.shape(1) &&
                       ids.shape(0) == h.shape(0) && unary.size() == ids.size(),
                   "rescore_candidates: h [R, H], head [V, H], ids [R, K], unary [R, K]");
  use_device(h.device_id());
  run("rescore_candidates", stream,
      cuda::rescore_candidates(bf16(h, "h"), bf16(head, "head"), ids.shape(0), ids.shape(1), h.shape(1),
                               head.shape(0), multiplier, softcap, ids.data(), unary.data(), as_stream(stream)));
}

}  // namespace
}  // namespace dflash

void bind_cuda_testing_fp8(nb::module_& m) {
  using namespace dflash;
  m.def("cuda_fp8_quantize_rows", &cuda_fp8_quantize_rows, "w"_a, "q"_a, "scale"_a, "stream"_a = nb::none());
  m.def("cuda_linear_fp8", &cuda_linear_fp8, "x"_a, "q"_a, "scale"_a, "out"_a, "stream"_a = nb::none());
  m.def("cuda_rescore_candidates", &cuda_rescore_candidates, "h"_a, "head"_a, "ids"_a, "unary"_a,
        "multiplier"_a = 1.0f, "softcap"_a = 0.0f, "stream"_a = nb::none());
  m.attr("cuda_fp8_gemv_max_rows") = cuda::kFp8GemvMaxRows;
}
