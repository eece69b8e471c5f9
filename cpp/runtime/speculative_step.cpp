// The DFlash draft–verify steps of the engine, batched over requests with ragged acceptance.
// Prefill of new requests: one causal target forward with taps over their prompts, the first
// token, the prompt rows into the drafter's context. Decode (decode_program.h, one CUDA graph):
// draft over [anchor, MASK x n] → verify [anchor, drafts] with taps → accept (greedy or exact
// rejection sampling) → drafter context; then commit here: truncate the target KV, emit tokens
// with stop checks, metrics. Also Engine::propose, the one-prompt drafter inspection.
#include <algorithm>

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

// The int32 tensor t, copied to the host.
std::vector<int32_t> download_i32(Backend& backend, const Tensor& t) {
  std::vector<int32_t> out(t.numel());
  backend.copy_to_host(out.data(), t, out.size() * 4);
  backend.synchronize();
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

std::vector<StepOutput> Engine::speculative_prefill(const std::vector<Request*>& running) {
  // One causal target forward with taps over the prompts; first token; drafter context.
  Drafter& drafter = *spec_.drafter;
  const int max_blocks = max_blocks_of(running);
  ForwardBatch batch;
  batch.want_taps = true;
  std::vector<SampleRow> rows;
  for (Request* r : running) {
    std::vector<int32_t> prompt(r->input.prompt.begin(), r->input.prompt.end());
    add_rows(batch, r, prompt, max_blocks, false);
    rows.push_back(sample_row_of(*r, static_cast<int64_t>(prompt.size())));
  }
  ForwardResult fwd = model_.forward(batch, pool_);
  std::vector<int32_t> sampled(running.size());
  backend_.sample(fwd.logits, rows, sampled.data());
  stats_.num_forward_tokens += batch.num_tokens();

  const Clock::time_point now = Clock::now();
  std::vector<StepOutput> outputs;
  std::vector<int32_t> ctx_rows, ctx_positions, ctx_slots;
  for (size_t i = 0; i < running.size(); ++i) {
    Request* r = running[i];
    const int64_t prompt = static_cast<int64_t>(r->input.prompt.size());
    r->num_computed = prompt;
    StepOutput out = emit_sampled(r, sampled[i], now);
    if (!out.finished) {
      for (int64_t j = 0; j < prompt; ++j) {
        ctx_rows.push_back(batch.query_start[i] + static_cast<int32_t>(j));
        ctx_positions.push_back(static_cast<int32_t>(j));
        ctx_slots.push_back(r->blocks.slot(j));
      }
    }
    outputs.push_back(std::move(out));
  }
  if (!ctx_rows.empty()) {
    const int64_t c = static_cast<int64_t>(ctx_rows.size());
    Tensor taps = backend_.empty({c, fwd.taps.dim(1)}, fwd.taps.dtype);
    backend_.gather_rows(fwd.taps, backend_.upload_i32(ctx_rows.data(), {c}), taps);
    drafter.update_context(taps, ctx_positions, ctx_slots, *spec_.pool);
  }
  return outputs;
}

std::vector<StepOutput> Engine::speculative_decode(const std::vector<Request*>& running,
                                                   const std::function<void()>& overlap) {
  const int64_t n = spec_.num_spec_tokens;
  std::vector<DecodeRow> rows(running.size());
  std::vector<std::vector<int32_t>> overrides(running.size());
  for (size_t i = 0; i < running.size(); ++i) {
    Request* r = running[i];
    const int64_t q0 = r->num_computed;
    rows[i].anchor = r->output.back();
    rows[i].q0 = q0;
    rows[i].blocks = &r->blocks;
    rows[i].sample = sample_row_of(*r, q0 + 1);
    const auto& oracle = r->input.oracle_drafts;
    if (!oracle.empty()) {  // drafts[j] is generated token number output.size() + j
      for (int64_t j = 0; j < n; ++j) {
        const size_t k = r->output.size() + j;
        overrides[i].push_back(k < oracle.size() ? oracle[k] : oracle.back());
      }
      rows[i].override_drafts = overrides[i].data();
    }
    r->blocks.truncate(q0);
    r->blocks.append(n + 1);  // the verify block's K/V (the tail is dropped after acceptance)
  }
  // Phase times in eager mode (the backend is synchronised between phases there).
  Clock::time_point t = Clock::now();
  double* phase_time[] = {&stats_.time_draft_s, &stats_.time_verify_s, &stats_.time_accept_s,
                          &stats_.time_context_s};
  programs_->launch(rows, [&](int phase) { *phase_time[phase] += lap(backend_, &t); });
  if (overlap) overlap();  // queued behind the program; its own sync also waits for the program
  programs_->wait();
  stats_.num_forward_tokens += static_cast<int64_t>(running.size()) * (n + 1);

  const int32_t* drafts = programs_->drafts();
  const int32_t* accepted = programs_->num_accepted();
  const int32_t* next = programs_->next_token();
  const Clock::time_point now = Clock::now();
  std::vector<StepOutput> outputs;
  for (size_t i = 0; i < running.size(); ++i) {
    Request* r = running[i];
    const int64_t a = accepted[i];
    std::vector<int32_t> emitted(drafts + i * n, drafts + i * n + a);
    emitted.push_back(next[i]);
    RequestMetrics& m = r->metrics;
    m.num_spec_steps += 1;
    m.num_drafted += n;
    m.num_accepted += a;
    stats_.num_spec_steps += 1;
    stats_.num_drafted += n;
    stats_.num_accepted += a;
    for (int64_t j = 0; j < a; ++j) {
      m.accepted_per_position[j] += 1;
      stats_.accepted_per_position[j] += 1;
    }
    r->num_computed += a + 1;  // the anchor and the accepted drafts
    r->blocks.truncate(r->num_computed);  // drop the K/V of rejected drafts (O(1))
    StepOutput out;
    const int64_t appended = emit(r, emitted, now, &out);
    m.num_spec_emitted += appended;
    stats_.num_spec_emitted += appended;
    finish_if_done(r, out);
    outputs.push_back(std::move(out));
  }
  return outputs;
}

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
    pre.query_start.push_back(0);
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
    const SampleParamsPacked packed = sample_params_pack(greedy);
    Tensor params = backend_.upload_i32(reinterpret_cast<const int32_t*>(&packed),
                                        {static_cast<int64_t>(sizeof(packed) / 4)});
    params.dtype = DType::kU8;
    params.shape = {static_cast<int64_t>(sizeof(packed))};
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
