// The DFlash draft–verify step of the engine, batched over requests with ragged acceptance:
// draft (one non-causal drafter forward over [anchor, MASK x n] per decoding request) →
// verify (one causal target forward with taps over prompts of new requests and the blocks of
// decoding ones) → accept (greedy or exact rejection sampling) → commit (truncate the target
// KV, emit tokens with stop checks, append anchor + accepted rows to the drafter's context).
// Also Engine::propose, the one-prompt inspection used to debug drafters.
#include <algorithm>

#include "backend/cpu/host_sampling.h"
#include "runtime/acceptance.h"
#include "runtime/engine.h"

namespace dflash {

namespace {

int max_blocks_of(const std::vector<Request*>& reqs) {
  int m = 0;
  for (const Request* r : reqs) m = std::max<int>(m, static_cast<int>(r->blocks.blocks().size()));
  return m;
}

SampleRow sample_row_of(const Request& r, int64_t position) {
  const SamplingConfig& s = r.input.sampling;
  return SampleRow{s.temperature, s.top_k, s.top_p, s.seed, position};
}

// Adds one drafter block [anchor, mask x n] at positions q0 .. q0 + n to `batch`.
void add_block(ForwardBatch& batch, const BlockTable& blocks, int64_t q0, int32_t anchor, int32_t mask, int64_t n,
               int max_blocks) {
  if (batch.query_start.empty()) batch.query_start.push_back(0);
  const int64_t row0 = batch.num_tokens();
  for (int64_t j = 0; j <= n; ++j) {
    batch.token_ids.push_back(j == 0 ? anchor : mask);
    batch.positions.push_back(static_cast<int32_t>(q0 + j));
    batch.slots.push_back(blocks.slot(q0 + j));
    if (j > 0) batch.logit_rows.push_back(static_cast<int32_t>(row0 + j));
  }
  batch.query_start.push_back(static_cast<int32_t>(batch.num_tokens()));
  batch.kv_len.push_back(static_cast<int32_t>(q0 + n + 1));
  std::vector<int32_t> row(blocks.blocks());
  row.resize(max_blocks, 0);
  batch.block_table.insert(batch.block_table.end(), row.begin(), row.end());
  batch.max_blocks_per_seq = max_blocks;
}

// Greedy draft tokens: the argmax of each drafter logit row.
std::vector<int32_t> argmax_rows(Backend& backend, const Tensor& logits) {
  const int64_t rows = logits.dim(0);
  std::vector<SampleRow> greedy(rows);  // temperature 0
  std::vector<int32_t> out(rows);
  if (rows > 0) backend.sample(logits, greedy, out.data());
  return out;
}

// Seconds since `*t`, after the backend finished its queued work; resets `*t`.
double lap(Backend& backend, Clock::time_point* t) {
  backend.synchronize();
  const Clock::time_point now = Clock::now();
  const double s = std::chrono::duration<double>(now - *t).count();
  *t = now;
  return s;
}

}  // namespace

std::vector<StepOutput> Engine::speculative_step(const std::vector<Request*>& running) {
  DFlashDrafter& drafter = *spec_.drafter;
  const int64_t n = spec_.num_spec_tokens;
  const int32_t mask = static_cast<int32_t>(drafter.config().mask_token_id);
  const int64_t vocab = model_.config().vocab_size;
  const int max_blocks = max_blocks_of(running);
  Clock::time_point t = Clock::now();

  // 1. Draft for every request past its prefill.
  std::vector<std::vector<int32_t>> drafts(running.size());
  ForwardBatch draft_batch;
  std::vector<size_t> decoding;
  for (size_t i = 0; i < running.size(); ++i) {
    Request* r = running[i];
    if (r->num_computed == 0) continue;
    decoding.push_back(i);
    add_block(draft_batch, r->blocks, r->num_computed, r->output.back(), mask, n, max_blocks);
  }
  if (!decoding.empty()) {
    std::vector<int32_t> proposed = argmax_rows(backend_, drafter.draft(draft_batch, *spec_.pool));
    for (size_t d = 0; d < decoding.size(); ++d) {
      Request* r = running[decoding[d]];
      std::vector<int32_t>& out = drafts[decoding[d]];
      out.assign(proposed.begin() + d * n, proposed.begin() + (d + 1) * n);
      const auto& oracle = r->input.oracle_drafts;
      for (int64_t j = 0; j < n && !oracle.empty(); ++j) {
        const size_t k = r->output.size() + j;  // drafts[j] is generated token number k
        out[j] = k < oracle.size() ? oracle[k] : oracle.back();
      }
    }
  }

  stats_.time_draft_s += lap(backend_, &t);

  // 2. Verify: one causal target forward with taps over prompts and [anchor, drafts] blocks.
  ForwardBatch verify;
  verify.want_taps = true;
  for (size_t i = 0; i < running.size(); ++i) {
    Request* r = running[i];
    if (r->num_computed == 0) {
      std::vector<int32_t> prompt(r->input.prompt.begin(), r->input.prompt.end());
      add_rows(verify, r, prompt, max_blocks, false);
    } else {
      std::vector<int32_t> block = {r->output.back()};
      block.insert(block.end(), drafts[i].begin(), drafts[i].end());
      add_rows(verify, r, block, max_blocks, true);
    }
  }
  ForwardResult fwd = model_.forward(verify, pool_);
  std::vector<float> logits(fwd.logits.numel());
  backend_.download_f32(fwd.logits, logits.data());
  stats_.num_forward_tokens += verify.num_tokens();
  stats_.time_verify_s += lap(backend_, &t);

  // 3. Accept and commit.
  const Clock::time_point now = Clock::now();
  std::vector<StepOutput> outputs;
  std::vector<int32_t> ctx_rows, ctx_positions, ctx_slots;
  int64_t logit_row = 0;
  for (size_t i = 0; i < running.size(); ++i) {
    Request* r = running[i];
    const int64_t q0 = r->num_computed;
    const int64_t row0 = verify.query_start[i];
    std::vector<int32_t> emitted;
    int64_t committed = 0;  // rows of this request whose K/V stay (and become drafter context)
    if (q0 == 0) {
      const int64_t prompt = static_cast<int64_t>(r->input.prompt.size());
      const size_t k = r->output.size();
      emitted.push_back(k < r->input.forced_tokens.size()
                            ? r->input.forced_tokens[k]
                            : sample_row_host(logits.data() + logit_row * vocab, vocab, sample_row_of(*r, prompt)));
      logit_row += 1;
      committed = prompt;
    } else {
      AcceptResult acc = accept_drafts(drafts[i].data(), n, logits.data() + logit_row * vocab, vocab,
                                       sample_row_of(*r, q0 + 1), q0 + 1);
      logit_row += n + 1;
      emitted.assign(drafts[i].begin(), drafts[i].begin() + acc.num_accepted);
      emitted.push_back(acc.next_token);
      committed = acc.num_accepted + 1;  // the anchor and the accepted drafts
      RequestMetrics& m = r->metrics;
      m.num_spec_steps += 1;
      m.num_drafted += n;
      m.num_accepted += acc.num_accepted;
      stats_.num_spec_steps += 1;
      stats_.num_drafted += n;
      stats_.num_accepted += acc.num_accepted;
      for (int64_t j = 0; j < acc.num_accepted; ++j) {
        m.accepted_per_position[j] += 1;
        stats_.accepted_per_position[j] += 1;
      }
    }
    r->num_computed = q0 + committed;
    r->blocks.truncate(r->num_computed);  // drop the K/V of rejected drafts (O(1))
    StepOutput out;
    const int64_t appended = emit(r, emitted, now, &out);
    if (q0 > 0) {
      r->metrics.num_spec_emitted += appended;
      stats_.num_spec_emitted += appended;
    }
    if (out.finished) {
      scheduler_.finish(r, out.finish_reason);
      stats_.num_requests_finished += 1;
    } else {
      for (int64_t j = 0; j < committed; ++j) {
        ctx_rows.push_back(static_cast<int32_t>(row0 + j));
        ctx_positions.push_back(static_cast<int32_t>(q0 + j));
        ctx_slots.push_back(r->blocks.slot(q0 + j));
      }
    }
    outputs.push_back(std::move(out));
  }

  stats_.time_accept_s += lap(backend_, &t);

  // 4. Context update: the committed rows' target features into the drafter's KV cache.
  if (!ctx_rows.empty()) {
    const int64_t c = static_cast<int64_t>(ctx_rows.size());
    Tensor rows = backend_.upload_i32(ctx_rows.data(), {c});
    Tensor taps = backend_.empty({c, fwd.taps.dim(1)}, fwd.taps.dtype);
    backend_.gather_rows(fwd.taps, rows, taps);
    drafter.update_context(taps, ctx_positions, ctx_slots, *spec_.pool);
  }
  stats_.time_context_s += lap(backend_, &t);
  return outputs;
}

void Engine::propose(const std::vector<int32_t>& prompt, std::vector<int32_t>* drafts, std::vector<float>* logits) {
  DFLASH_ARG_CHECK(spec_.drafter != nullptr, "propose() needs a Session with a draft model");
  DFlashDrafter& drafter = *spec_.drafter;
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
    pre.query_start.push_back(0);
    std::vector<int32_t> positions;
    for (int64_t i = 0; i < p; ++i) {
      pre.token_ids.push_back(prompt[i]);
      pre.positions.push_back(static_cast<int32_t>(i));
      pre.slots.push_back(table.slot(i));
    }
    pre.query_start.push_back(static_cast<int32_t>(p));
    pre.kv_len.push_back(static_cast<int32_t>(p));
    pre.block_table = table.blocks();
    pre.max_blocks_per_seq = static_cast<int>(table.blocks().size());
    pre.logit_rows.push_back(static_cast<int32_t>(p - 1));
    ForwardResult fwd = model_.forward(pre, pool_);
    const int32_t anchor = argmax_rows(backend_, fwd.logits)[0];
    drafter.update_context(fwd.taps, pre.positions, pre.slots, *spec_.pool);
    ForwardBatch block;
    add_block(block, table, p, anchor, static_cast<int32_t>(drafter.config().mask_token_id), n,
              static_cast<int>(table.blocks().size()));
    Tensor draft_logits = drafter.draft(block, *spec_.pool);
    *drafts = argmax_rows(backend_, draft_logits);
    logits->resize(draft_logits.numel());
    backend_.download_f32(draft_logits, logits->data());
  } catch (...) {
    table.release(allocator_);
    throw;
  }
  table.release(allocator_);
}

}  // namespace dflash
