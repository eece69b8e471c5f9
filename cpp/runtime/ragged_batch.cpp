// ragged_batch_append: one sequence's rows of a ragged ForwardBatch (see ragged_batch.h).
#include "runtime/ragged_batch.h"

#include <algorithm>

#include "common/error.h"

namespace dflash {

void ragged_batch_append(ForwardBatch& batch, const std::vector<int32_t>& tokens, int64_t q0,
                         const BlockTable& blocks, int max_blocks, int64_t first_logit) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  DFLASH_CHECK(static_cast<int64_t>(blocks.blocks().size()) <= max_blocks, "a sequence holds ",
               blocks.blocks().size(), " KV blocks, more than the batch's row of ", max_blocks);
  const int64_t row0 = batch.num_tokens();
  for (int64_t j = 0; j < n; ++j) {
    batch.token_ids.push_back(tokens[j]);
    batch.positions.push_back(static_cast<int32_t>(q0 + j));
    batch.slots.push_back(blocks.slot(q0 + j));
  }
  if (batch.query_start.empty()) batch.query_start.push_back(0);
  batch.query_start.push_back(static_cast<int32_t>(batch.num_tokens()));
  batch.kv_len.push_back(static_cast<int32_t>(q0 + n));
  // [max_blocks]: the sequence's blocks, then block 0 as padding (attention reads only the blocks
  // holding its kv_len keys)
  std::vector<int32_t> row(blocks.blocks());
  row.resize(max_blocks, 0);
  batch.block_table.insert(batch.block_table.end(), row.begin(), row.end());
  batch.max_blocks_per_seq = max_blocks;
  for (int64_t pos = std::max(first_logit, q0); pos < q0 + n; ++pos) {
    batch.logit_rows.push_back(static_cast<int32_t>(row0 + pos - q0));
  }
}

}  // namespace dflash
