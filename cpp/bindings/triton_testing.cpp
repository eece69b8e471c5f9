// Test access to the AOT Triton kernels (dflash._core.testing): paged attention and the DFlash2
// lattice walk, over torch CUDA tensors passed through DLPack. Not public API: it loads one
// process-wide triton_aot::Modules on first use (in the context current then, i.e. the device
// torch initialised) and raises on failure. triton_paged_attention launches on the given stream
// (default: the legacy default stream) and synchronises it; triton_lattice_walk synchronises
// the legacy default stream when no stream is given, else only launches there (CUDA-graph
// capture). Built only with CUDA; module.cpp calls bind_triton_testing(testing).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "bindings/cuda_testing_util.h"
#include "common/error.h"
#include "cuda_driver/driver_api.h"
#include "triton_kernels/lattice_walk.h"
#include "triton_kernels/triton_attention.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using dflash::InvalidArgument;
using dflash::PagedAttentionArgs;
using dflash::triton_aot::PagedAttentionPlan;
using dflash::PagedAttentionVariant;
using CudaArray = dflash::testing_bindings::Any;
using CudaI32 = dflash::testing_bindings::I32;
using CudaF32 = dflash::testing_bindings::F32;

// Loaded once and never unloaded: destroying it at interpreter exit could run after the CUDA
// context is gone.
const dflash::triton_aot::Modules& test_modules() {
  static std::once_flag once;
  static const dflash::triton_aot::Modules* modules = nullptr;
  std::call_once(once, [] { modules = new dflash::triton_aot::Modules(); });
  return *modules;
}

const char* variant_name(PagedAttentionVariant v) {
  switch (v) {
    case PagedAttentionVariant::kPrefill:
      return "prefill";
    case PagedAttentionVariant::kDecode:
      return "decode";
    case PagedAttentionVariant::kChunked:
      return "chunked";
    default:
      return "none";
  }
}

nb::tuple triton_paged_attention(const CudaArray& q, const CudaArray& k_pool,
                                 const CudaArray& v_pool, CudaArray& out,
                                 const CudaI32& query_start, const CudaI32& kv_len,
                                 const CudaI32& block_table, bool causal, int32_t window,
                                 int32_t max_query_len, int32_t max_kv_len,
                                 std::optional<CudaArray> workspace, int32_t force_variant,
                                 int32_t force_splits, uintptr_t stream, bool symmetric_window,
                                 bool synchronize) {
  PagedAttentionArgs a = dflash::testing_bindings::paged_attention_args(
      q, k_pool, v_pool, out, query_start, kv_len, block_table, causal, window, symmetric_window, max_query_len,
      max_kv_len, workspace, force_splits);
  DFLASH_ARG_CHECK(force_variant >= 0 && force_variant <= 3,
                   "force_variant: 0 auto, 1 prefill, 2 decode, 3 chunked (batch-invariant)");
  a.force_variant = static_cast<PagedAttentionVariant>(force_variant);

  const dflash::triton_aot::Modules& modules = test_modules();
  PagedAttentionPlan plan;
  const char* why = dflash::triton_aot::paged_attention_plan(modules, a, &plan);
  DFLASH_ARG_CHECK(why == nullptr, "triton_paged_attention: ", why ? why : "");
  {
    nb::gil_scoped_release release;
    const auto& api = dflash::cuda_driver::driver_api();
    const auto s = reinterpret_cast<cudaStream_t>(stream);
    DFLASH_CU_CHECK(dflash::triton_aot::paged_attention(modules, s, a));
    if (synchronize) DFLASH_CU_CHECK(api.cuStreamSynchronize(s));
  }
  return nb::make_tuple(variant_name(plan.variant), plan.num_splits, plan.block_m);
}

// SampleRow rows uploaded from host lists, freed with the object (not capturable).
class UploadedParams {
 public:
  UploadedParams(const std::vector<float>& temperature, const std::vector<uint64_t>& seed,
                 const std::vector<int64_t>& position, size_t rows) {
    DFLASH_ARG_CHECK(temperature.size() == rows && seed.size() == rows && position.size() == rows,
                     "temperature, seed and position need one entry per request (", rows, ")");
    std::vector<dflash::SampleRow> host(rows);
    for (size_t r = 0; r < rows; ++r) host[r] = dflash::SampleRow(temperature[r], 0, 1.0f, seed[r], position[r]);
    if (rows == 0) return;
    cudaError_t e = cudaMalloc(&ptr_, rows * sizeof(dflash::SampleRow));
    DFLASH_CHECK(e == cudaSuccess, "cudaMalloc: ", cudaGetErrorString(e));
    e = cudaMemcpy(ptr_, host.data(), rows * sizeof(dflash::SampleRow),
                   cudaMemcpyHostToDevice);
    if (e != cudaSuccess) cudaFree(ptr_);
    DFLASH_CHECK(e == cudaSuccess, "cudaMemcpy: ", cudaGetErrorString(e));
  }
  ~UploadedParams() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  UploadedParams(const UploadedParams&) = delete;
  UploadedParams& operator=(const UploadedParams&) = delete;
  const void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

// params: a CUDA tensor of num_reqs SampleRow (uint8 or int32, num_reqs * 32 bytes), or
// else the lists temperature / seed / position (uploaded here; then `stream` must be None).
void triton_lattice_walk(const CudaF32& edges, const CudaI32& ids, std::optional<CudaArray> params,
                         const CudaI32& drafts, const CudaF32& realized,
                         std::optional<std::vector<float>> temperature,
                         std::optional<std::vector<uint64_t>> seed,
                         std::optional<std::vector<int64_t>> position,
                         std::optional<uintptr_t> stream, bool greedy_walk) {
  DFLASH_ARG_CHECK(edges.ndim() == 4 && ids.ndim() == 3 && drafts.ndim() == 2 &&
                       realized.ndim() == 3,
                   "lattice_walk: edges [R, S, K, K], ids [R, S, K], drafts [R, S], "
                   "realized [R, S, K]");
  const size_t r = ids.shape(0), s = ids.shape(1), k = ids.shape(2);
  DFLASH_ARG_CHECK(edges.shape(0) == r && edges.shape(1) == s && edges.shape(2) == k &&
                       edges.shape(3) == k && drafts.shape(0) == r && drafts.shape(1) == s &&
                       realized.shape(0) == r && realized.shape(1) == s && realized.shape(2) == k,
                   "lattice_walk: edges [R, S, K, K], ids [R, S, K], drafts [R, S], "
                   "realized [R, S, K] disagree");
  const int32_t device = edges.device_id();
  DFLASH_ARG_CHECK(ids.device_id() == device && drafts.device_id() == device &&
                       realized.device_id() == device,
                   "all tensors must be on one device");
  const bool lists = temperature.has_value() || seed.has_value() || position.has_value();
  DFLASH_ARG_CHECK(params.has_value() != lists,
                   "lattice_walk: pass either params or temperature, seed and position");
  std::optional<UploadedParams> uploaded;
  dflash::triton_aot::LatticeWalkArgs a;
  if (params.has_value()) {
    const bool byte_words = params->dtype() == nb::dtype<uint8_t>() ||
                            params->dtype() == nb::dtype<int32_t>();
    DFLASH_ARG_CHECK(byte_words && params->nbytes() == r * sizeof(dflash::SampleRow) &&
                         params->device_id() == device,
                     "lattice_walk: params must be a uint8 or int32 CUDA tensor of R * ",
                     sizeof(dflash::SampleRow), " bytes on the tensors' device");
    a.params = params->data();
  } else {
    DFLASH_ARG_CHECK(temperature && seed && position && !stream,
                     "lattice_walk: temperature, seed and position go together, without stream");
    uploaded.emplace(*temperature, *seed, *position, r);
    a.params = uploaded->get();
  }
  a.edges = edges.data();
  a.ids = ids.data();
  a.drafts = drafts.data();
  a.realized = realized.data();
  a.num_reqs = static_cast<int32_t>(r);
  a.slots = static_cast<int32_t>(s);
  a.k = static_cast<int32_t>(k);
  a.greedy_walk = greedy_walk;

  const dflash::triton_aot::Modules& modules = test_modules();
  nb::gil_scoped_release release;
  const auto s_handle = reinterpret_cast<cudaStream_t>(stream.value_or(0));
  const CUresult launched = dflash::triton_aot::lattice_walk(modules, s_handle, a);
  DFLASH_ARG_CHECK(launched != CUDA_ERROR_INVALID_VALUE,
                   "triton_lattice_walk: unsupported arguments (k = ", k, " must be in [1, ",
                   dflash::triton_aot::lattice_walk_max_k(), "]; R = ", r, ", S = ", s, ")");
  DFLASH_CU_CHECK(launched);
  if (!stream) DFLASH_CU_CHECK(dflash::cuda_driver::driver_api().cuStreamSynchronize(s_handle));
}

}  // namespace

void bind_triton_testing(nb::module_& testing) {
  testing.def("triton_paged_attention", &triton_paged_attention, "q"_a, "k_pool"_a, "v_pool"_a,
              "out"_a, "query_start"_a, "kv_len"_a, "block_table"_a, "causal"_a, "window"_a,
              "max_query_len"_a, "max_kv_len"_a, "workspace"_a = nb::none(),
              "force_variant"_a = 0, "force_splits"_a = 0, "stream"_a = 0,
              "symmetric_window"_a = false, "synchronize"_a = true,
              "AOT Triton paged attention over torch CUDA tensors (bf16 q/pools/out, int32 "
              "metadata); writes out, synchronises `stream` (an int handle, default the legacy "
              "stream; synchronize=False: launches only, e.g. inside a graph capture) and returns "
              "(variant, num_splits, block_m). force_variant: 0 auto, "
              "1 prefill, 2 decode, 3 chunked (batch-invariant); force_splits: 0 auto (chunked: 1 "
              "folds in the kernel, > 1 splits over every key chunk); symmetric_window: with "
              "window > 0, keys |q_pos - j| < window (causal ignored).");
  testing.def(
      "triton_paged_attention_workspace_bytes",
      [](int32_t max_tokens, int32_t num_heads, int32_t head_dim, int32_t max_splits) {
        return dflash::triton_aot::paged_attention_workspace_bytes(max_tokens, num_heads,
                                                                   head_dim, max_splits);
      },
      "max_tokens"_a, "num_heads"_a, "head_dim"_a, "max_splits"_a,
      "Workspace bytes for split-KV (splits clamped to the maximum).");
  testing.def("triton_paged_attention_max_splits",
              &dflash::triton_aot::paged_attention_max_splits,
              "Largest split count of the split-KV path.");
  testing.def("triton_lattice_walk", &triton_lattice_walk, "edges"_a, "ids"_a,
              "params"_a.none(), "drafts"_a, "realized"_a,
              "temperature"_a.none() = nb::none(), "seed"_a.none() = nb::none(),
              "position"_a.none() = nb::none(), "stream"_a.none() = nb::none(), "greedy_walk"_a = false,
              "AOT Triton DFlash2 lattice walk over torch CUDA tensors: edges [R, S, K, K] fp32, "
              "ids [R, S, K] int32 -> drafts [R, S] int32, realized [R, S, K] fp32. params: R "
              "SampleRow (uint8 / int32 CUDA tensor of R * 32 bytes), or None and the "
              "lists temperature, seed, position (of the first draft). stream: launch there and "
              "return; None: legacy default stream, synchronised. greedy_walk: the argmax walk at "
              "every temperature, realized one-hot (0 at the draft, -inf elsewhere). ValueError when k is outside "
              "[1, triton_lattice_walk_max_k()].");
  testing.def("triton_lattice_walk_max_k", &dflash::triton_aot::lattice_walk_max_k,
              "Largest K of the lattice walk.");
}
