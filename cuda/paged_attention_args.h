// The arguments of one paged-attention launch over one layer's KV pools: the one definition
// shared by the hand-written CUDA decode kernel (cuda/decode_attention.cu, through
// cuda/kernels.h) and the AOT Triton kernels (triton_kernels/triton_attention.h). The CUDA
// backend fills it once per call and hands the same struct to whichever kernel runs. Plain
// C++ (no CUDA types), so both the nvcc and the host-compiler sides include it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dflash {

// The Triton kernel families (the CUDA decode kernel ignores the choice).
enum class PagedAttentionVariant : int32_t {
  kAuto = 0,     // choose (the default)
  kPrefill = 1,  // any number of queries per sequence
  kDecode = 2,   // max_query_len * (num_heads / num_kv_heads) <= 64, optionally split-KV
  // Batch-invariant (deterministic sessions): any number of queries per sequence, keys in chunks
  // at fixed positions folded in order, so a row's bits depend on its own query and keys only;
  // split over the chunks (a fold launch after it) where that pays and the workspace holds them.
  kChunked = 3,
};

struct PagedAttentionArgs {
  // bf16, 16-byte aligned. q, out: [num_tokens, num_heads, head_dim];
  // pools of ONE layer: [num_blocks, block_size, num_kv_heads, head_dim].
  const void* q = nullptr;
  const void* k_pool = nullptr;
  const void* v_pool = nullptr;
  void* out = nullptr;
  // Device int32. query_start [num_seqs + 1]: sequence s owns query rows
  // [query_start[s], query_start[s+1]) whose queries sit at its last positions
  // (kv_len[s] - num_q + i); kv_len [num_seqs]; block_table [num_seqs, max_blocks_per_seq].
  const int32_t* query_start = nullptr;
  const int32_t* kv_len = nullptr;
  const int32_t* block_table = nullptr;
  int32_t num_seqs = 0, num_tokens = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int32_t block_size = 0, max_blocks_per_seq = 0;
  // Host-known upper bounds of the per-sequence query count and kv_len: they pick the kernel,
  // the grid and the split count. A sequence above them is a caller bug (decode: rows dropped).
  int32_t max_query_len = 0, max_kv_len = 0;
  // causal: key j visible iff j <= q_pos; else every query sees all kv_len keys (the drafter's
  // block). window > 0: sliding window q_pos - window < j <= q_pos (implies causal).
  bool causal = true;
  int32_t window = 0;
  // With window > 0 and causal false: a symmetric window instead, keys |q_pos - j| < window
  // (DFlash2's non-causal sliding layers; the queries of a block see keys above their position).
  // Takes precedence over causal, as on the CPU backend; no effect without a window.
  bool symmetric_window = false;
  float scale = 0.0f;  // softmax scale; 0 means 1 / sqrt(head_dim)
  // Split-KV workspace (device, 16-byte aligned): at least paged_attention_workspace_bytes (Triton)
  // or decode_attention_workspace_bytes (CUDA) for the splits wanted; null or too small: no split.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // The CUDA decode kernel's split-KV completion counters: int32 [counter_slots >= num_seqs *
  // num_kv_heads], zeroed once by the owner (the kernel leaves them zero); null: one split.
  int32_t* counters = nullptr;
  int64_t counter_slots = 0;
  // Testing and tuning: force a Triton variant, or a split count (0 = choose; kChunked: 1 folds in
  // the kernel, > 1 splits over every key chunk, whatever the count).
  PagedAttentionVariant force_variant = PagedAttentionVariant::kAuto;
  int32_t force_splits = 0;
  // Testing and tuning: the CUDA decode kernel's tensor-core variant for every row count, not only
  // above 16 rows per (sequence, KV head) (the Triton kernels ignore it).
  bool force_tensor_cores = false;
  // The CUDA-core decode kernel with K/V staged in shared memory by cp.async instead of registers
  // (same results, bit for bit; kernels.attention = "staged"; the Triton kernels ignore it).
  bool staged_kv = false;
};

}  // namespace dflash
