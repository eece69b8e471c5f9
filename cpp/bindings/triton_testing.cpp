// Test access to the AOT Triton paged attention (dflash._core.testing), over torch CUDA tensors
// passed through DLPack. Not public API: it loads one process-wide triton_aot::Modules on first
// use (in the context current then, i.e. the device torch initialised), launches on the given
// stream (default: the legacy default stream), synchronises it, and raises on failure. Built
// only with CUDA; module.cpp calls bind_triton_testing(testing).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <mutex>
#include <optional>

#include "common/error.h"
#include "cuda_driver/driver_api.h"
#include "triton_kernels/triton_attention.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using dflash::InvalidArgument;
using dflash::triton_aot::PagedAttentionArgs;
using dflash::triton_aot::PagedAttentionPlan;
using dflash::triton_aot::PagedAttentionVariant;
using CudaArray = nb::ndarray<nb::device::cuda, nb::c_contig>;
using CudaI32 = nb::ndarray<int32_t, nb::device::cuda, nb::c_contig>;

// Loaded once and never unloaded: destroying it at interpreter exit could run after the CUDA
// context is gone.
const dflash::triton_aot::Modules& test_modules() {
  static std::once_flag once;
  static const dflash::triton_aot::Modules* modules = nullptr;
  std::call_once(once, [] { modules = new dflash::triton_aot::Modules(); });
  return *modules;
}

bool is_bf16(const CudaArray& a) {
  return a.dtype().code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) &&
         a.dtype().bits == 16 && a.dtype().lanes == 1;
}

const char* variant_name(PagedAttentionVariant v) {
  switch (v) {
    case PagedAttentionVariant::kPrefill:
      return "prefill";
    case PagedAttentionVariant::kDecode:
      return "decode";
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
                                 int32_t force_splits, uintptr_t stream, bool symmetric_window) {
  DFLASH_ARG_CHECK(q.ndim() == 3 && out.ndim() == 3 && k_pool.ndim() == 4 && v_pool.ndim() == 4,
                   "q/out [T, num_heads, head_dim], pools [num_blocks, block_size, "
                   "num_kv_heads, head_dim]");
  DFLASH_ARG_CHECK(is_bf16(q) && is_bf16(k_pool) && is_bf16(v_pool) && is_bf16(out),
                   "q, k_pool, v_pool and out must be bfloat16");
  for (int d = 0; d < 3; ++d) {
    DFLASH_ARG_CHECK(out.shape(d) == q.shape(d), "out must have q's shape");
  }
  for (int d = 0; d < 4; ++d) {
    DFLASH_ARG_CHECK(k_pool.shape(d) == v_pool.shape(d), "k_pool and v_pool shapes differ");
  }
  DFLASH_ARG_CHECK(k_pool.shape(3) == q.shape(2), "pool head_dim differs from q's");
  DFLASH_ARG_CHECK(query_start.ndim() == 1 && kv_len.ndim() == 1 && block_table.ndim() == 2 &&
                       query_start.shape(0) == kv_len.shape(0) + 1 &&
                       block_table.shape(0) == kv_len.shape(0),
                   "query_start [num_seqs + 1], kv_len [num_seqs], block_table [num_seqs, "
                   "max_blocks_per_seq]");
  const int32_t device = q.device_id();
  DFLASH_ARG_CHECK(k_pool.device_id() == device && v_pool.device_id() == device &&
                       out.device_id() == device && query_start.device_id() == device &&
                       kv_len.device_id() == device && block_table.device_id() == device,
                   "all tensors must be on one device");

  PagedAttentionArgs a;
  a.q = q.data();
  a.k_pool = k_pool.data();
  a.v_pool = v_pool.data();
  a.out = out.data();
  a.query_start = query_start.data();
  a.kv_len = kv_len.data();
  a.block_table = block_table.data();
  a.num_seqs = static_cast<int32_t>(kv_len.shape(0));
  a.num_tokens = static_cast<int32_t>(q.shape(0));
  a.num_heads = static_cast<int32_t>(q.shape(1));
  a.head_dim = static_cast<int32_t>(q.shape(2));
  a.num_kv_heads = static_cast<int32_t>(k_pool.shape(2));
  a.block_size = static_cast<int32_t>(k_pool.shape(1));
  a.max_blocks_per_seq = static_cast<int32_t>(block_table.shape(1));
  a.max_query_len = max_query_len;
  a.max_kv_len = max_kv_len;
  a.causal = causal;
  a.window = window;
  a.symmetric_window = symmetric_window;
  if (workspace.has_value()) {
    DFLASH_ARG_CHECK(workspace->device_id() == device, "workspace must be on q's device");
    a.workspace = workspace->data();
    a.workspace_bytes = workspace->nbytes();
  }
  DFLASH_ARG_CHECK(force_variant >= 0 && force_variant <= 2,
                   "force_variant: 0 auto, 1 prefill, 2 decode");
  a.force_variant = static_cast<PagedAttentionVariant>(force_variant);
  a.force_splits = force_splits;

  const dflash::triton_aot::Modules& modules = test_modules();
  PagedAttentionPlan plan;
  const char* why = dflash::triton_aot::paged_attention_plan(modules, a, &plan);
  DFLASH_ARG_CHECK(why == nullptr, "triton_paged_attention: ", why ? why : "");
  {
    nb::gil_scoped_release release;
    const auto& api = dflash::cuda_driver::driver_api();
    const auto s = reinterpret_cast<cudaStream_t>(stream);
    DFLASH_CU_CHECK(dflash::triton_aot::paged_attention(modules, s, a));
    DFLASH_CU_CHECK(api.cuStreamSynchronize(s));
  }
  return nb::make_tuple(variant_name(plan.variant), plan.num_splits, plan.block_m);
}

}  // namespace

void bind_triton_testing(nb::module_& testing) {
  testing.def("triton_paged_attention", &triton_paged_attention, "q"_a, "k_pool"_a, "v_pool"_a,
              "out"_a, "query_start"_a, "kv_len"_a, "block_table"_a, "causal"_a, "window"_a,
              "max_query_len"_a, "max_kv_len"_a, "workspace"_a = nb::none(),
              "force_variant"_a = 0, "force_splits"_a = 0, "stream"_a = 0,
              "symmetric_window"_a = false,
              "AOT Triton paged attention over torch CUDA tensors (bf16 q/pools/out, int32 "
              "metadata); writes out, synchronises `stream` (an int handle, default the legacy "
              "stream) and returns (variant, num_splits, block_m). force_variant: 0 auto, "
              "1 prefill, 2 decode; force_splits: 0 auto; symmetric_window: with window > 0, "
              "keys |q_pos - j| < window (causal ignored).");
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
}
