// Paged attention on top of the generated Triton launchers (triton_kernels_gen.h): module
// loading with the load-time ABI check, the host-side choice of variant / tile / split count,
// and the launches. See triton_attention.h for the contract and paged_attention.py for the
// kernels.
#include "triton_kernels/triton_attention.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "cuda_driver/driver_api.h"
#include "triton_kernels_gen.h"

namespace dflash {
namespace triton_aot {
namespace {

namespace g = gen;

using PrefillLaunch = CUresult (*)(CUfunction, CUstream, unsigned, unsigned, unsigned,
                                   CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr,
                                   CUdeviceptr, CUdeviceptr, CUdeviceptr, float, int32_t, int32_t,
                                   int32_t, int32_t, int32_t, int32_t, int32_t, int32_t);
using DecodeLaunch = CUresult (*)(CUfunction, CUstream, unsigned, unsigned, unsigned, CUdeviceptr,
                                  CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr,
                                  CUdeviceptr, CUdeviceptr, CUdeviceptr, float, int32_t, int32_t,
                                  int32_t, int32_t, int32_t, int32_t, int32_t, int32_t);
using ReduceLaunch = CUresult (*)(CUfunction, CUstream, unsigned, unsigned, unsigned, CUdeviceptr,
                                  CUdeviceptr, int32_t, int32_t, int32_t);

struct PrefillKernel {
  int id, block_m;
  PrefillLaunch launch;
};
struct DecodeKernel {
  int id, block_m;
  DecodeLaunch launch;
};
struct ReduceKernel {
  int id;
  ReduceLaunch launch;
};
using ChunkedLaunch = CUresult (*)(CUfunction, CUstream, unsigned, unsigned, unsigned, CUdeviceptr,
                                   CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr,
                                   CUdeviceptr, CUdeviceptr, CUdeviceptr, float, int32_t, int32_t,
                                   int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t,
                                   int32_t);
struct ChunkedKernel {
  int id, block_m;
  ChunkedLaunch launch;
};
using FoldLaunch = CUresult (*)(CUfunction, CUstream, unsigned, unsigned, unsigned, CUdeviceptr, CUdeviceptr,
                                CUdeviceptr, CUdeviceptr, int32_t, int32_t, int32_t, int32_t);
struct FoldKernel {
  int id;
  FoldLaunch launch;
};

// Decode tiles: the smallest one holding max_query_len * group rows.
constexpr int kDecodeSmallM = g::paged_attention_decode_hd64_m16::kBlockM;
constexpr int kDecodeLargeM = g::paged_attention_decode_hd64_m64::kBlockM;
static_assert(g::paged_attention_decode_hd128_m16::kBlockM == kDecodeSmallM &&
                  g::paged_attention_decode_hd128_m64::kBlockM == kDecodeLargeM,
              "decode tiles differ between head dims");
constexpr int kMaxSplits = g::paged_attention_split_reduce_hd64::kMaxSplits;
static_assert(g::paged_attention_split_reduce_hd128::kMaxSplits == kMaxSplits, "max splits");

// Split-KV heuristics: aim at two CTAs per SM, each over at least this many keys of max_kv_len
// (one BLOCK_N tile: in decode graphs max_kv_len is an upper bound, so splits must stay cheap).
// Launches on the 64-row tile (verify and drafter blocks) are not split once the unsplit grid
// covers half the SMs: their split reduce costs more than the splits gain. H200, Qwen3-8B
// geometry, 16 queries per sequence, graph-timed per call (bench/results/
// gpu_h200_attention_small.json, 2026-12-04): batch 16 (128 CTAs) at context 512 21.7 us unsplit
// vs 55.6 us in 3 splits, at context 4096 134 vs 141 us; batch 4 (32 CTAs) still gains from
// splits (context 4096: 42.8 vs 130 us). The 16-row tile keeps the rule above (batch 16,
// context 4096, one query: 86 us in 3 splits vs 159 us unsplit).
constexpr int64_t kMinKeysPerSplit = 64;
constexpr int kCtasPerSm = 2;

// The batch-invariant kernel: its key chunk, and the programs below which a launch with more than
// one chunk is split over its chunks (decode and verify steps: a few tiles, many keys each).
constexpr int64_t kKeyChunk = g::paged_attention_chunked_hd64::kKeyChunk;
static_assert(g::paged_attention_chunked_hd128::kKeyChunk == kKeyChunk, "key chunks differ between head dims");
static_assert(kKeyChunk == 256, "paged_attention_plan's message names 256-key chunks");

PrefillKernel prefill_kernel(int head_dim) {
  if (head_dim == 64) {
    namespace k = g::paged_attention_prefill_hd64;
    return {k::kId, k::kBlockM, &k::launch};
  }
  namespace k = g::paged_attention_prefill_hd128;
  return {k::kId, k::kBlockM, &k::launch};
}

DecodeKernel decode_kernel(int head_dim, int rows) {
  if (head_dim == 64) {
    if (rows <= kDecodeSmallM) {
      namespace k = g::paged_attention_decode_hd64_m16;
      return {k::kId, k::kBlockM, &k::launch};
    }
    namespace k = g::paged_attention_decode_hd64_m64;
    return {k::kId, k::kBlockM, &k::launch};
  }
  if (rows <= kDecodeSmallM) {
    namespace k = g::paged_attention_decode_hd128_m16;
    return {k::kId, k::kBlockM, &k::launch};
  }
  namespace k = g::paged_attention_decode_hd128_m64;
  return {k::kId, k::kBlockM, &k::launch};
}

ReduceKernel reduce_kernel(int head_dim) {
  if (head_dim == 64) {
    namespace k = g::paged_attention_split_reduce_hd64;
    return {k::kId, &k::launch};
  }
  namespace k = g::paged_attention_split_reduce_hd128;
  return {k::kId, &k::launch};
}

ChunkedKernel chunked_kernel(int head_dim) {
  if (head_dim == 64) {
    namespace k = g::paged_attention_chunked_hd64;
    return {k::kId, k::kBlockM, &k::launch};
  }
  namespace k = g::paged_attention_chunked_hd128;
  return {k::kId, k::kBlockM, &k::launch};
}

FoldKernel fold_kernel(int head_dim) {
  if (head_dim == 64) {
    namespace k = g::paged_attention_chunk_fold_hd64;
    return {k::kId, &k::launch};
  }
  namespace k = g::paged_attention_chunk_fold_hd128;
  return {k::kId, &k::launch};
}

CUdeviceptr dptr(const void* p) { return reinterpret_cast<CUdeviceptr>(p); }
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

size_t split_bytes(int64_t num_tokens, int64_t num_heads, int64_t head_dim) {
  return static_cast<size_t>(num_tokens) * num_heads * (head_dim + 2) * sizeof(float);
}

// Split count of the decode variant; 0 with *why set when a forced count cannot be honoured.
int32_t choose_splits(const Modules& m, const PagedAttentionArgs& a, const char** why) {
  const size_t per_split = split_bytes(a.num_tokens, a.num_heads, a.head_dim);
  int64_t capacity = 0;
  if (a.workspace != nullptr && aligned16(a.workspace) && per_split > 0) {
    capacity = std::min<int64_t>(kMaxSplits, a.workspace_bytes / per_split);
  }
  if (a.force_splits > 0) {
    if (a.force_splits > kMaxSplits) {
      *why = "force_splits exceeds paged_attention_max_splits()";
      return 0;
    }
    if (a.force_splits > 1 && capacity < a.force_splits) {
      *why = "force_splits needs a 16-byte aligned workspace of "
             "paged_attention_workspace_bytes(num_tokens, num_heads, head_dim, force_splits)";
      return 0;
    }
    return a.force_splits;
  }
  if (capacity < 2) return 1;
  int64_t span = std::max(a.max_kv_len, 0);
  // A window (causal or symmetric: the queries sit at the last positions, so no key lies above
  // kv_len) leaves at most window + num_q - 1 keys.
  if (a.window > 0) span = std::min<int64_t>(span, int64_t{a.window} + a.max_query_len);
  const int64_t ctas = int64_t{a.num_seqs} * a.num_kv_heads;
  const int64_t rows = int64_t{a.max_query_len} * (a.num_heads / a.num_kv_heads);
  if (rows > kDecodeSmallM && 2 * ctas >= m.num_sms()) return 1;
  const int64_t want = (int64_t{kCtasPerSm} * m.num_sms() + ctas - 1) / ctas;
  const int64_t splits = std::min({want, span / kMinKeysPerSplit, capacity});
  return splits >= 2 ? static_cast<int32_t>(splits) : 1;
}

void check_abi(const cuda_driver::DriverApi& api, CUfunction fn, const g::KernelImage& img) {
  size_t offset = 0, size = 0, end = 0;
  for (int i = 0; i < img.num_params; ++i) {
    const CUresult r = api.cuFuncGetParamInfo(fn, static_cast<size_t>(i), &offset, &size);
    DFLASH_CHECK(r == CUDA_SUCCESS && size == img.param_sizes[i] && offset >= end,
                 "Triton kernel ", img.name, ": parameter ", i, " of ", img.num_params,
                 " does not match the generated launcher (driver: ",
                 r == CUDA_SUCCESS ? detail::concat(size, " bytes at offset ", offset)
                                   : cuda_driver::cu_error_string(r),
                 ", launcher: ", static_cast<int>(img.param_sizes[i]),
                 " bytes); was the cubin built by another triton than ", g::kTritonVersion, "?");
    end = offset + size;
  }
  const CUresult extra = api.cuFuncGetParamInfo(fn, static_cast<size_t>(img.num_params), &offset,
                                                &size);
  DFLASH_CHECK(extra != CUDA_SUCCESS, "Triton kernel ", img.name, " has more than the ",
               img.num_params, " parameters its launcher passes (triton ", g::kTritonVersion,
               " convention: arguments, global_scratch, profile_scratch)");
}

}  // namespace

Modules::Modules() {
  const cuda_driver::DriverApi& api = cuda_driver::driver_api();
  CUcontext ctx = nullptr;
  DFLASH_CU_CHECK(api.cuCtxGetCurrent(&ctx));
  if (ctx == nullptr) {
    // Nothing made a context current on this thread yet: use the runtime's current device.
    const cudaError_t err = cudaFree(nullptr);
    DFLASH_CHECK(err == cudaSuccess, "Triton modules: cannot initialise the CUDA device: ",
                 cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
    DFLASH_CU_CHECK(api.cuCtxGetCurrent(&ctx));
    DFLASH_CHECK(ctx != nullptr, "Triton modules: no CUDA context is current");
  }
  CUdevice dev = 0;
  DFLASH_CU_CHECK(api.cuCtxGetDevice(&dev));
  int major = 0, minor = 0, smem_optin = 0;
  const auto attribute = [&](int* value, CUdevice_attribute attr) {
    DFLASH_CU_CHECK(api.cuDeviceGetAttribute(value, attr, dev));
  };
  attribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  attribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  attribute(&num_sms_, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  attribute(&smem_optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
  DFLASH_CHECK(major == 9 && minor == 0,
               "the Triton kernels are compiled for sm_90a (compute capability 9.0, Hopper); "
               "CUDA device ", dev, " has compute capability ", major, ".", minor);

  modules_.reserve(g::kNumKernels);
  functions_.reserve(g::kNumKernels);
  try {
    for (int i = 0; i < g::kNumKernels; ++i) {
      const g::KernelImage& img = g::kKernelImages[i];
      CUmodule mod = nullptr;
      DFLASH_CU_CHECK(api.cuModuleLoadData(&mod, img.cubin));
      modules_.push_back(mod);
      CUfunction fn = nullptr;
      DFLASH_CU_CHECK(api.cuModuleGetFunction(&fn, mod, img.entry));
      DFLASH_CU_CHECK(api.cuFuncLoad(fn));
      check_abi(api, fn, img);
      if (img.shared_bytes > 48 * 1024) {
        DFLASH_CHECK(static_cast<int>(img.shared_bytes) <= smem_optin, "Triton kernel ", img.name,
                     " needs ", img.shared_bytes, " bytes of shared memory; the device allows ",
                     smem_optin);
        DFLASH_CU_CHECK(api.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                               static_cast<int>(img.shared_bytes)));
      }
      int max_threads = 0;
      DFLASH_CU_CHECK(
          api.cuFuncGetAttribute(&max_threads, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn));
      DFLASH_CHECK(max_threads >= static_cast<int>(img.num_threads), "Triton kernel ", img.name,
                   " launches ", img.num_threads, " threads but allows only ", max_threads);
      functions_.push_back(fn);
    }
  } catch (...) {
    for (CUmodule mod : modules_) api.cuModuleUnload(mod);
    throw;
  }
}

Modules::~Modules() {
  const cuda_driver::DriverApi& api = cuda_driver::driver_api();  // resolved by the constructor
  for (CUmodule mod : modules_) api.cuModuleUnload(mod);  // errors (context gone) are ignored
}

int32_t paged_attention_max_splits() { return kMaxSplits; }

size_t paged_attention_workspace_bytes(int32_t max_tokens, int32_t num_heads, int32_t head_dim,
                                       int32_t max_splits) {
  const int64_t splits = std::min<int64_t>(std::max(max_splits, 0), kMaxSplits);
  return splits * split_bytes(std::max(max_tokens, 0), std::max(num_heads, 0),
                              std::max(head_dim, 0));
}

const char* paged_attention_plan(const Modules& m, const PagedAttentionArgs& a,
                                 PagedAttentionPlan* plan) {
  *plan = PagedAttentionPlan{};
  if (a.num_seqs < 0 || a.num_tokens < 0) return "num_seqs and num_tokens must be >= 0";
  if (a.head_dim != 64 && a.head_dim != 128) return "head_dim must be 64 or 128";
  if (a.num_heads <= 0 || a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0) {
    return "num_heads must be a positive multiple of num_kv_heads";
  }
  if (a.window < 0) return "window must be >= 0";
  if (a.force_splits < 0) return "force_splits must be >= 0";
  const int group = a.num_heads / a.num_kv_heads;
  const PrefillKernel prefill = prefill_kernel(a.head_dim);
  if (group > prefill.block_m) return "too many query heads per KV head for the prefill tile";
  if (a.num_seqs == 0 || a.num_tokens == 0) return nullptr;  // nothing to launch
  if (a.block_size <= 0 || a.max_blocks_per_seq <= 0) {
    return "block_size and max_blocks_per_seq must be > 0";
  }
  if (!a.q || !a.k_pool || !a.v_pool || !a.out || !a.query_start || !a.kv_len || !a.block_table) {
    return "null tensor pointer";
  }
  if (!aligned16(a.q) || !aligned16(a.k_pool) || !aligned16(a.v_pool) || !aligned16(a.out)) {
    return "q, k_pool, v_pool and out must be 16-byte aligned";
  }
  const bool decode_fits =
      a.max_query_len >= 1 && int64_t{a.max_query_len} * group <= kDecodeLargeM;
  PagedAttentionVariant variant = a.force_variant;
  if (variant == PagedAttentionVariant::kAuto) {
    variant = decode_fits ? PagedAttentionVariant::kDecode : PagedAttentionVariant::kPrefill;
  }
  if (variant == PagedAttentionVariant::kDecode) {
    if (!decode_fits) {
      return "the decode variant needs 1 <= max_query_len * (num_heads / num_kv_heads) <= 64";
    }
    const char* why = nullptr;
    const int32_t splits = choose_splits(m, a, &why);
    if (splits == 0) return why;
    plan->variant = variant;
    plan->block_m = decode_kernel(a.head_dim, a.max_query_len * group).block_m;
    plan->num_splits = splits;
    plan->grid[0] = static_cast<unsigned>(a.num_seqs);
    plan->grid[1] = static_cast<unsigned>(a.num_kv_heads);
    plan->grid[2] = static_cast<unsigned>(splits);
    return nullptr;
  }
  if (variant == PagedAttentionVariant::kChunked) {
    const ChunkedKernel chunked = chunked_kernel(a.head_dim);
    if (group > chunked.block_m) return "too many query heads per KV head for the chunked tile";
    const int q_per_tile = chunked.block_m / group;
    plan->variant = variant;
    plan->block_m = chunked.block_m;
    plan->grid[0] = static_cast<unsigned>(a.num_tokens / q_per_tile + a.num_seqs);
    plan->grid[1] = static_cast<unsigned>(a.num_kv_heads);
    // Split over the chunks of max_kv_len when there are several, the unsplit grid leaves most
    // SMs idle and the workspace holds a partial per chunk (a row's bits are the same either way).
    const int64_t chunks = std::max<int64_t>(1, (int64_t{std::max(a.max_kv_len, 0)} + kKeyChunk - 1) / kKeyChunk);
    const size_t per_chunk = split_bytes(a.num_tokens, a.num_heads, a.head_dim);
    const bool fits = a.workspace != nullptr && aligned16(a.workspace) && per_chunk > 0 &&
                      static_cast<size_t>(chunks) <= a.workspace_bytes / per_chunk && chunks <= 65535;
    bool split = chunks >= 2 && fits && int64_t{plan->grid[0]} * plan->grid[1] < m.num_sms();
    if (a.force_splits == 1) split = false;
    if (a.force_splits > 1) {
      if (!fits) {
        return "a split chunked launch needs a 16-byte aligned workspace of num_tokens * num_heads * "
               "(head_dim + 2) * 4 bytes per 256-key chunk of max_kv_len";
      }
      split = true;
    }
    plan->num_splits = split ? static_cast<int32_t>(chunks) : 1;
    plan->grid[2] = static_cast<unsigned>(plan->num_splits);
    return nullptr;
  }
  if (variant != PagedAttentionVariant::kPrefill) return "unknown force_variant";
  if (a.force_splits > 1) return "split-KV is implemented by the decode and chunked variants only";
  const int q_per_tile = prefill.block_m / group;
  plan->variant = variant;
  plan->block_m = prefill.block_m;
  plan->num_splits = 1;
  plan->grid[0] = static_cast<unsigned>(a.num_tokens / q_per_tile + a.num_seqs);
  plan->grid[1] = static_cast<unsigned>(a.num_kv_heads);
  plan->grid[2] = 1;
  return nullptr;
}

CUresult paged_attention(const Modules& m, cudaStream_t stream, const PagedAttentionArgs& a) {
  PagedAttentionPlan plan;
  if (paged_attention_plan(m, a, &plan) != nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (plan.grid[0] == 0 || plan.grid[1] == 0 || plan.grid[2] == 0) return CUDA_SUCCESS;
  const float scale = a.scale != 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(a.head_dim));
  // A symmetric window replaces causality (the CPU backend's rule); any other window is causal.
  const int32_t symmetric = (a.symmetric_window && a.window > 0) ? 1 : 0;
  const int32_t causal = (symmetric == 0 && (a.causal || a.window > 0)) ? 1 : 0;
  const CUstream s = stream;
  if (plan.variant == PagedAttentionVariant::kPrefill) {
    const PrefillKernel k = prefill_kernel(a.head_dim);
    return k.launch(m.function(k.id), s, plan.grid[0], plan.grid[1], plan.grid[2], dptr(a.q),
                    dptr(a.k_pool), dptr(a.v_pool), dptr(a.out), dptr(a.query_start),
                    dptr(a.kv_len), dptr(a.block_table), scale, a.num_seqs, a.num_heads,
                    a.num_kv_heads, a.block_size, a.max_blocks_per_seq, causal, a.window,
                    symmetric);
  }
  if (plan.variant == PagedAttentionVariant::kChunked) {
    const ChunkedKernel k = chunked_kernel(a.head_dim);
    const bool split = plan.num_splits > 1;
    const CUdeviceptr workspace = split ? dptr(a.workspace) : 0;
    CUresult r = k.launch(m.function(k.id), s, plan.grid[0], plan.grid[1], plan.grid[2], dptr(a.q),
                          dptr(a.k_pool), dptr(a.v_pool), dptr(a.out), workspace, dptr(a.query_start),
                          dptr(a.kv_len), dptr(a.block_table), scale, a.num_tokens, a.num_seqs,
                          a.num_heads, a.num_kv_heads, a.block_size, a.max_blocks_per_seq, causal,
                          a.window, symmetric, split ? 1 : 0);
    if (r != CUDA_SUCCESS || !split) return r;
    const FoldKernel fold = fold_kernel(a.head_dim);
    return fold.launch(m.function(fold.id), s, static_cast<unsigned>(a.num_tokens),
                       static_cast<unsigned>(a.num_heads), 1, workspace, dptr(a.out), dptr(a.query_start),
                       dptr(a.kv_len), a.num_tokens, a.num_seqs, a.num_heads, plan.num_splits);
  }
  const DecodeKernel k = decode_kernel(a.head_dim, plan.block_m);
  const CUdeviceptr workspace = plan.num_splits > 1 ? dptr(a.workspace) : 0;
  CUresult r = k.launch(m.function(k.id), s, plan.grid[0], plan.grid[1], plan.grid[2], dptr(a.q),
                        dptr(a.k_pool), dptr(a.v_pool), dptr(a.out), workspace,
                        dptr(a.query_start), dptr(a.kv_len), dptr(a.block_table), scale,
                        a.num_tokens, a.num_heads, a.num_kv_heads, a.block_size,
                        a.max_blocks_per_seq, causal, a.window, symmetric);
  if (r != CUDA_SUCCESS || plan.num_splits == 1) return r;
  const ReduceKernel reduce = reduce_kernel(a.head_dim);
  return reduce.launch(m.function(reduce.id), s, static_cast<unsigned>(a.num_tokens),
                       static_cast<unsigned>(a.num_heads), 1, workspace, dptr(a.out),
                       a.num_tokens, a.num_heads, plan.num_splits);
}

}  // namespace triton_aot
}  // namespace dflash
