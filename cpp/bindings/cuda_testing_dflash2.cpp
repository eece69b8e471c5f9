// Test-only bindings of the DFlash2 drafting kernels of cuda/ (grouped conv, bf16 scale, edge
// scores), added to dflash._core.testing as cuda_<op>, with the conventions of cuda_testing.cpp:
// torch CUDA tensors in and out (contiguous, outputs passed in), launch on the default stream and
// synchronise, raising CUDA errors as dflash::Error; with `stream` (a cudaStream_t as an int) they
// launch there without synchronising (benchmarks, CUDA-graph capture). Built only with CUDA.
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

void cuda_grouped_conv(const Any& x, const Any& base, const Any& deltas, int64_t side, int64_t block, int64_t group,
                       bool accumulate, const Any& out, const Stream& stream) {
  DFLASH_ARG_CHECK(x.ndim() == 2 && base.ndim() == 3 && deltas.ndim() == 2 && out.ndim() == 2 &&
                       out.shape(0) == x.shape(0) && out.shape(1) == x.shape(1) && base.shape(0) == 2 &&
                       base.shape(2) == x.shape(1) && deltas.shape(0) == x.shape(0) && group >= 1 &&
                       x.shape(1) % group == 0 &&
                       deltas.shape(1) == 2 * base.shape(1) * (x.shape(1) / static_cast<size_t>(group)),
                   "grouped_conv: x [N, H], base [2, T, H], deltas [N, 2 T H / group], out [N, H]");
  use_device(x.device_id());
  run("grouped_conv", stream,
      cuda::grouped_conv(bf16(x, "x"), bf16(base, "base"), bf16(deltas, "deltas"), x.shape(0), x.shape(1),
                         base.shape(1), group, side, block, accumulate, bf16(out, "out"), as_stream(stream)));
}

void cuda_scale_bf16(const Any& x, float factor, const Stream& stream) {
  use_device(x.device_id());
  run("scale_bf16", stream, cuda::scale_bf16(bf16(x, "x"), static_cast<int64_t>(x.size()), factor, as_stream(stream)));
}

void cuda_edge_scores(const I32& ids, const F32& unary, const F32& gate, const I32& anchors, const Any& pred_codebook,
                      const Any& succ_codebook, const F32& edges, const Stream& stream) {
  DFLASH_ARG_CHECK(ids.ndim() == 3 && gate.ndim() == 3 && pred_codebook.ndim() == 2 && succ_codebook.ndim() == 2 &&
                       unary.size() == ids.size() && anchors.size() == ids.shape(0) &&
                       gate.shape(0) == ids.shape(0) && gate.shape(1) == ids.shape(1) &&
                       pred_codebook.shape(1) == gate.shape(2) && succ_codebook.shape(1) == gate.shape(2) &&
                       succ_codebook.shape(0) == pred_codebook.shape(0) && edges.size() == ids.size() * ids.shape(2),
                   "edge_scores: ids [R, S, K], unary [R, S, K], gate [R, S, r], anchors [R], codebooks [V, r], "
                   "edges [R, S, K, K]");
  use_device(ids.device_id());
  run("edge_scores", stream,
      cuda::edge_scores(ids.data(), unary.data(), gate.data(), anchors.data(), bf16(pred_codebook, "pred_codebook"),
                        bf16(succ_codebook, "succ_codebook"), ids.shape(0), ids.shape(1), ids.shape(2),
                        gate.shape(2), pred_codebook.shape(0), edges.data(), as_stream(stream)));
}

}  // namespace
}  // namespace dflash

void bind_cuda_testing_dflash2(nb::module_& m) {
  using namespace dflash;
  m.def("cuda_grouped_conv", &cuda_grouped_conv, "x"_a, "base"_a, "deltas"_a, "side"_a, "block"_a, "group"_a,
        "accumulate"_a, "out"_a, "stream"_a = nb::none());
  m.def("cuda_scale_bf16", &cuda_scale_bf16, "x"_a, "factor"_a, "stream"_a = nb::none());
  m.def("cuda_edge_scores", &cuda_edge_scores, "ids"_a, "unary"_a, "gate"_a, "anchors"_a, "pred_codebook"_a,
        "succ_codebook"_a, "edges"_a, "stream"_a = nb::none());
}
