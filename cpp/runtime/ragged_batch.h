// The ragged-batch layout of a ForwardBatch (model/forward_batch.h), written in one place: the
// rows of several sequences concatenated, each sequence adding its tokens, positions and KV
// slots, its query_start and kv_len entries, its block table row and the rows whose logits are
// wanted. The eager prefill (engine.cpp, speculative_step.cpp) and the drafter inspection
// (propose.cpp) build their batches with it; the decode programs' fixed-shape buffers
// (decode_program.cpp stage()) mirror it.
#pragma once

#include <cstdint>
#include <vector>

#include "kv_cache/block_allocator.h"
#include "model/forward_batch.h"

namespace dflash {

// Appends one sequence to `batch`: tokens [n] at positions q0 .. q0 + n - 1, their KV slots from
// `blocks` (which must already hold them), kv_len q0 + n (the keys the sequence sees after the
// step), its block table row padded with block 0 to max_blocks (>= the blocks it holds), and the
// logits of the rows at positions >= first_logit (none when that is past its last row).
void ragged_batch_append(ForwardBatch& batch, const std::vector<int32_t>& tokens, int64_t q0,
                         const BlockTable& blocks, int max_blocks, int64_t first_logit);

}  // namespace dflash
