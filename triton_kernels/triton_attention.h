// Paged attention through the ahead-of-time compiled Triton kernels (paged_attention.py): the
// stable API the CUDA backend calls. Modules loads every cubin once (at Session start);
// paged_attention() picks the kernel variant, tile and split-KV count on the host from the
// host-known bounds in PagedAttentionArgs (cuda/paged_attention_args.h) and launches on the given stream. It never allocates,
// synchronises or throws, so it can be captured into CUDA graphs (the launch shape depends only
// on the host-side fields: keep them fixed for a captured graph).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/paged_attention_args.h"

namespace dflash {
namespace triton_aot {

// What paged_attention() will launch for given arguments.
struct PagedAttentionPlan {
  PagedAttentionVariant variant = PagedAttentionVariant::kAuto;  // kPrefill, kDecode or kChunked
  int32_t block_m = 0;     // query rows (query x head of a group) per CTA
  // decode: KV splits per (sequence, kv head), > 1 adds a reduce launch; chunked: the key chunks
  // of max_kv_len when split over them (a fold launch after it), else 1
  int32_t num_splits = 1;
  unsigned grid[3] = {0, 0, 0};  // of the attention kernel (all 0: nothing to do)
};

// The loaded cubins of every generated kernel, bound to the CUDA context that was current when
// it was constructed (use it only on that context's device). Immutable after construction, so
// concurrent paged_attention() calls are safe. Not copyable.
class Modules {
 public:
  // Loads every image into the current context (initialising the runtime's current device if no
  // context is current), forces the functions to load (no lazy loading inside a launch or a
  // graph capture), checks each kernel's parameter ABI with cuFuncGetParamInfo against the
  // generated sizes, and raises the dynamic shared-memory limit where a kernel needs > 48 KiB.
  // Throws dflash::Error (wrong GPU architecture, no driver, ABI mismatch, ...).
  Modules();
  ~Modules();
  Modules(const Modules&) = delete;
  Modules& operator=(const Modules&) = delete;

  CUfunction function(int kernel_id) const { return functions_[kernel_id]; }
  int num_sms() const { return num_sms_; }

 private:
  std::vector<CUmodule> modules_;
  std::vector<CUfunction> functions_;
  int num_sms_ = 0;
};

// Largest split count paged_attention() uses (the reduce kernel's MAX_SPLITS).
int32_t paged_attention_max_splits();

// Workspace bytes for split-KV over at most max_tokens query rows with up to max_splits splits
// (clamped to paged_attention_max_splits()).
size_t paged_attention_workspace_bytes(int32_t max_tokens, int32_t num_heads, int32_t head_dim,
                                       int32_t max_splits);

// Chooses what paged_attention() launches. Returns nullptr on success, else a static string
// saying which argument is unsupported (paged_attention then returns CUDA_ERROR_INVALID_VALUE).
const char* paged_attention_plan(const Modules& m, const PagedAttentionArgs& a,
                                 PagedAttentionPlan* plan);

// out = softmax(q k^T * scale) v over each sequence's paged keys; picks variant and grid with
// paged_attention_plan and launches on `stream` (one kernel, or two with split-KV). Returns
// CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE for unsupported arguments, or the launch error.
CUresult paged_attention(const Modules& m, cudaStream_t stream, const PagedAttentionArgs& a);

}  // namespace triton_aot
}  // namespace dflash
