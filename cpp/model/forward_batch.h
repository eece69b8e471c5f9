// ForwardBatch: the host-side description of one model forward over a ragged batch (the rows
// of several sequences concatenated), built by the engine and read by the model.
#pragma once

#include <cstdint>
#include <vector>

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

}  // namespace dflash
