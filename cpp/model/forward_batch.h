// ForwardBatch: the host-side description of one model forward over a ragged batch (the rows
// of several sequences concatenated), built by the engine; DeviceBatch: the same on the
// backend, which the model reads (uploaded per step, or static buffers of a captured graph).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace dflash {

struct ForwardBatch {
  std::vector<int32_t> token_ids;    // [T]
  std::vector<int32_t> positions;    // [T] absolute positions
  std::vector<int32_t> slots;        // [T] KV slot of each row (block * block_size + offset)
  std::vector<int32_t> query_start;  // [R + 1] first row of each sequence
  std::vector<int32_t> kv_len;       // [R] keys visible to each sequence after this step
  std::vector<int32_t> block_table;  // [R, max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  std::vector<int32_t> logit_rows;   // [N] rows whose logits are wanted
  bool want_taps = false;            // fill ForwardResult::taps for every row

  int num_seqs() const { return static_cast<int>(kv_len.size()); }
  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
};

// A forward's inputs on the backend. meta's host fields (maxima) size the kernel launches; a
// captured graph uses the largest values it must serve.
struct DeviceBatch {
  int64_t num_tokens = 0;
  Tensor token_ids;   // [T] int32
  Tensor positions;   // [T] int32
  Tensor slots;       // [T] int32
  AttentionMeta meta;
  Tensor logit_rows;  // [N] int32 rows whose logits are wanted (unless all_logit_rows)
  bool all_logit_rows = false;  // logits of every row, in order (no gather)
  bool want_taps = false;

  int64_t num_logit_rows() const { return all_logit_rows ? num_tokens : (logit_rows.shape.empty() ? 0 : logit_rows.dim(0)); }
};

}  // namespace dflash
