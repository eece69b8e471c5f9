// Engine::propose: the drafter inspection of Session.propose / propose_details. One prompt in
// KV blocks of its own: prefill with taps, the drafter's context, then one greedy draft step as a
// decode step makes it, returning the drafts, the LM head's logits at the draft rows and, for a
// K-candidate drafter (DFlash2), the candidates, unary and edge scores and the walked rows. Changes
// nothing else (its blocks are released).
#include "runtime/engine.h"
#include "runtime/ragged_batch.h"

namespace dflash {

namespace {

// Adds one drafter block [anchor, mask x n] at positions q0 .. q0 + n to `batch`, with the logits
// of the n mask rows.
void add_block(ForwardBatch& batch, const BlockTable& blocks, int64_t q0, int32_t anchor, int32_t mask, int64_t n,
               int max_blocks) {
  std::vector<int32_t> tokens(static_cast<size_t>(n + 1), mask);
  tokens[0] = anchor;
  ragged_batch_append(batch, tokens, q0, blocks, max_blocks, /*first_logit=*/q0 + 1);
}

// Greedy draft tokens: the argmax of each drafter logit row.
std::vector<int32_t> argmax_rows(Backend& backend, const Tensor& logits) {
  const int64_t rows = logits.dim(0);
  std::vector<SampleRow> greedy(rows);  // temperature 0
  std::vector<int32_t> out(rows);
  if (rows > 0) backend.sample(logits, greedy, out.data());
  return out;
}

// The int32 tensor t, copied to the host.
std::vector<int32_t> download_i32(Backend& backend, const Tensor& t) {
  std::vector<int32_t> out(t.numel());
  backend.copy_to_host(out.data(), t, out.size() * 4);
  backend.synchronize();
  return out;
}

}  // namespace

void Engine::propose(const std::vector<int32_t>& prompt, std::vector<int32_t>* drafts, std::vector<float>* logits,
                     ProposeDetails* details) {
  DFLASH_ARG_CHECK(spec_.drafter != nullptr, "propose() needs a Session with a draft model");
  Drafter& drafter = *spec_.drafter;
  const int64_t n = spec_.num_spec_tokens, p = static_cast<int64_t>(prompt.size());
  const int64_t vocab = model_.config().vocab_size;
  DFLASH_ARG_CHECK(p > 0, "the prompt is empty");
  DFLASH_ARG_CHECK(p + n + 1 <= max_model_len_, "the prompt has ", p, " tokens; with the ", n,
                   "-token draft block it does not fit max_model_len=", max_model_len_);
  for (int32_t t : prompt) {
    DFLASH_ARG_CHECK(t >= 0 && t < vocab, "prompt token id ", t, " is outside the vocabulary [0, ", vocab, ")");
  }
  const int64_t bs = scheduler_.config().block_size;
  DFLASH_ARG_CHECK(BlockTable::blocks_for(p + n + 1, bs) <= allocator_.num_free(),
                   "not enough free KV cache blocks for propose()");
  BlockTable table(bs);
  table.reserve(p + n + 1, allocator_);
  backend_.begin_step();
  try {
    ForwardBatch pre;
    pre.want_taps = true;
    ragged_batch_append(pre, prompt, 0, table, static_cast<int>(table.blocks().size()), /*first_logit=*/p - 1);
    ForwardResult fwd = model_.forward(pre, pool_);
    const int32_t anchor = argmax_rows(backend_, fwd.logits)[0];
    drafter.update_context(fwd.taps, pre.positions, pre.slots, *spec_.pool);
    ForwardBatch block;
    add_block(block, table, p, anchor, static_cast<int32_t>(drafter.config().mask_token_id), n,
              static_cast<int>(table.blocks().size()));
    const DeviceBatch d = device_batch_upload(backend_, block, /*causal=*/false);
    Tensor draft_logits = drafter.draft_logits(d, *spec_.pool);
    logits->resize(draft_logits.numel());
    backend_.download_f32(draft_logits, logits->data());
    // The drafts as a decode step makes them (greedy sampling parameters).
    const int64_t k = drafter.proposal_width();
    DraftOutputs out;
    out.drafts = backend_.empty({1, n}, DType::kI32);
    if (drafter.proposal_kind() == ProposalKind::kDense) out.realized = backend_.empty({1, n, k}, DType::kF32);
    if (drafter.proposal_kind() == ProposalKind::kCandidates) {
      out.cand_ids = backend_.empty({1, n, k}, DType::kI32);
      out.realized = backend_.empty({1, n, k}, DType::kF32);
      out.unary = backend_.empty({1, n, k}, DType::kF32);
      out.edges = backend_.empty({1, n, k, k}, DType::kF32);
    }
    SampleRow greedy;
    greedy.position = p + 1;
    Tensor params = backend_.upload_i32(reinterpret_cast<const int32_t*>(&greedy),
                                        {static_cast<int64_t>(sizeof(greedy) / 4)});
    params.dtype = DType::kU8;
    params.shape = {static_cast<int64_t>(sizeof(greedy))};
    drafter.propose(d, *spec_.pool, backend_.upload_i32(&anchor, {1}), params, out);
    *drafts = download_i32(backend_, out.drafts);
    if (details && drafter.proposal_kind() == ProposalKind::kCandidates) {
      details->k = k;
      details->cand_ids = download_i32(backend_, out.cand_ids);
      details->unary.resize(out.unary.numel());
      backend_.download_f32(out.unary, details->unary.data());
      details->edges.resize(out.edges.numel());
      backend_.download_f32(out.edges, details->edges.data());
      details->realized.resize(out.realized.numel());
      backend_.download_f32(out.realized, details->realized.data());
    }
  } catch (...) {
    table.release(allocator_);
    throw;
  }
  table.release(allocator_);
}

}  // namespace dflash
