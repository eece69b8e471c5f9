// The engine step and request validation (see engine.h).
#include "runtime/engine.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace dflash {

namespace {
SchedulerConfig with_lookahead(SchedulerConfig sched, const Speculator& spec) {
  // A verify block writes K/V for the anchor and n drafts past the committed tokens.
  if (spec.drafter) sched.lookahead_tokens = std::max(sched.lookahead_tokens, spec.num_spec_tokens + 1);
  return sched;
}
}  // namespace

Engine::Engine(Transformer& model, Backend& backend, KVPool& pool, BlockAllocator& allocator,
               const SchedulerConfig& sched, int64_t max_model_len, Speculator spec, EngineOptions options)
    : model_(model),
      backend_(backend),
      pool_(pool),
      allocator_(allocator),
      scheduler_(with_lookahead(sched, spec), allocator),
      max_model_len_(max_model_len),
      spec_(spec),
      async_decode_(options.async_decode) {
  DFLASH_ARG_CHECK(!async_decode_ || spec.drafter == nullptr,
                   "async_decode pipelines target-only decoding; a draft model's steps depend on their "
                   "acceptance counts (turn one of them off)");
  if (spec_.drafter) {
    stats_.accepted_per_position.assign(spec_.num_spec_tokens, 0);
  }
  const int64_t reserved = trash_blocks(spec_, sched.block_size);
  DFLASH_CHECK(pool_.num_blocks >= options.trash_block + reserved && options.trash_block >= allocator_.num_blocks(),
               "the KV pool must hold ", reserved, " reserved blocks past the allocator's");
  DecodeProgramConfig pc;
  pc.max_batch = sched.max_num_seqs;
  pc.max_model_len = max_model_len_;
  pc.block_size = sched.block_size;
  pc.num_spec_tokens = spec_.drafter ? spec_.num_spec_tokens : 0;
  pc.trash_block = options.trash_block;
  pc.pad = options.pad_batches || options.cuda_graphs;
  pc.graphs = options.cuda_graphs;
  pc.feed = async_decode_;
  programs_ = std::make_unique<DecodePrograms>(backend_, model_, pool_, spec_.drafter, spec_.pool, pc);
  programs_->capture();
}

Engine::~Engine() {
  if (pending_) {  // the step in flight reads buffers that die with the engine
    try {
      programs_->wait_step(pending_->slot);
    } catch (...) {
    }
  }
}

bool Engine::abort(int64_t id) {
  drain();
  return scheduler_.abort(id);
}

int64_t Engine::trash_blocks(const Speculator& spec, int64_t block_size) {
  return DecodePrograms::trash_blocks(spec.drafter ? spec.num_spec_tokens + 1 : 1, block_size);
}

int64_t Engine::add_request(RequestInput input) {
  const ModelConfig& c = model_.config();
  const int64_t vocab = c.vocab_size;
  const int64_t prompt = static_cast<int64_t>(input.prompt.size());
  const SamplingConfig& s = input.sampling;
  DFLASH_ARG_CHECK(prompt > 0, "the prompt is empty");
  DFLASH_ARG_CHECK(prompt < max_model_len_, "the prompt has ", prompt,
                   " tokens, which does not fit max_model_len=", max_model_len_,
                   " (it must leave room for at least one new token)");
  for (int32_t t : input.prompt) {
    DFLASH_ARG_CHECK(t >= 0 && t < vocab, "prompt token id ", t, " is outside the vocabulary [0, ",
                     vocab, ")");
  }
  for (int32_t t : s.stop_token_ids) {
    DFLASH_ARG_CHECK(t >= 0 && t < vocab, "stop token id ", t, " is outside the vocabulary [0, ",
                     vocab, ")");
  }
  for (int32_t t : input.forced_tokens) {
    DFLASH_ARG_CHECK(t >= 0 && t < vocab, "forced token id ", t, " is outside the vocabulary");
  }
  for (int32_t t : input.oracle_drafts) {
    DFLASH_ARG_CHECK(t >= 0 && t < vocab, "oracle draft token id ", t, " is outside the vocabulary");
  }
  DFLASH_ARG_CHECK(!spec_.drafter || !(input.record_logits || input.record_prompt_logits || input.record_taps),
                   "logit/tap recording is only available without a draft model");
  DFLASH_ARG_CHECK(s.max_tokens >= 1, "max_tokens must be >= 1, got ", s.max_tokens);
  DFLASH_ARG_CHECK(std::isfinite(s.temperature) && s.temperature >= 0.0f,
                   "temperature must be a finite number >= 0, got ", s.temperature);
  DFLASH_ARG_CHECK(s.top_p > 0.0f && s.top_p <= 1.0f, "top_p must be in (0, 1], got ", s.top_p);
  DFLASH_ARG_CHECK(s.top_k >= 0, "top_k must be >= 0 (0 disables it), got ", s.top_k);

  auto req = std::make_unique<Request>(scheduler_.config().block_size);
  req->id = next_id_++;
  req->max_new_tokens = std::min<int64_t>(s.max_tokens, max_model_len_ - prompt);
  req->input = std::move(input);
  const int64_t blocks =
      BlockTable::blocks_for(scheduler_.reserved_tokens(*req), scheduler_.config().block_size);
  DFLASH_ARG_CHECK(blocks <= allocator_.num_blocks(), "the request needs ",
                   scheduler_.reserved_tokens(*req), " KV cache slots (prompt ", prompt,
                   " + max_tokens ", req->max_new_tokens, ") but the cache holds only ",
                   allocator_.num_blocks() * scheduler_.config().block_size,
                   "; raise kv_cache_tokens or lower max_tokens");
  req->metrics.prompt_tokens = prompt;
  if (spec_.drafter) req->metrics.accepted_per_position.assign(spec_.num_spec_tokens, 0);
  req->arrival = Clock::now();
  const int64_t id = req->id;
  scheduler_.add(std::move(req));
  return id;
}

std::string Engine::stop_reason(const Request& req, int32_t token) const {
  const SamplingConfig& s = req.input.sampling;
  const auto& eos = model_.config().eos_token_ids;
  if (!s.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end()) return "stop";
  if (std::find(s.stop_token_ids.begin(), s.stop_token_ids.end(), token) !=
      s.stop_token_ids.end()) {
    return "stop";
  }
  if (static_cast<int64_t>(req.output.size()) >= req.max_new_tokens) return "length";
  return "";
}

int64_t Engine::emit(Request* r, const std::vector<int32_t>& tokens, Clock::time_point now, StepOutput* out) {
  out->request_id = r->id;
  int64_t n = 0;
  for (int32_t token : tokens) {
    r->output.push_back(token);
    out->new_tokens.push_back(token);
    ++n;
    if (r->output.size() == 1) r->first_token = now;
    stats_.num_generated_tokens += 1;
    const std::string reason = stop_reason(*r, token);
    if (!reason.empty()) {
      out->finished = true;
      out->finish_reason = reason;
      break;
    }
  }
  r->metrics.num_steps += 1;
  return n;
}

void Engine::add_rows(ForwardBatch& batch, Request* r, const std::vector<int32_t>& tokens, int max_blocks,
                      bool all_logits) {
  const int64_t start = r->num_computed;
  const int64_t row0 = batch.num_tokens();
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int64_t pos = start + static_cast<int64_t>(i);
    batch.token_ids.push_back(tokens[i]);
    batch.positions.push_back(static_cast<int32_t>(pos));
    batch.slots.push_back(r->blocks.slot(pos));
  }
  r->blocks.truncate(start);
  r->blocks.append(static_cast<int64_t>(tokens.size()));
  if (batch.query_start.empty()) batch.query_start.push_back(0);
  batch.query_start.push_back(static_cast<int32_t>(batch.num_tokens()));
  batch.kv_len.push_back(static_cast<int32_t>(start + static_cast<int64_t>(tokens.size())));
  std::vector<int32_t> row(r->blocks.blocks());
  row.resize(max_blocks, 0);
  batch.block_table.insert(batch.block_table.end(), row.begin(), row.end());
  batch.max_blocks_per_seq = max_blocks;
  for (int64_t t = all_logits ? row0 : batch.num_tokens() - 1; t < batch.num_tokens(); ++t) {
    batch.logit_rows.push_back(static_cast<int32_t>(t));
  }
}

namespace {
int max_blocks_of(const std::vector<Request*>& reqs) {
  int m = 0;
  for (const Request* r : reqs) m = std::max<int>(m, static_cast<int>(r->blocks.blocks().size()));
  return m;
}

// The tokens of r not yet in the KV cache (the prompt for a new request, else the last token).
std::vector<int32_t> pending_tokens(const Request* r) {
  std::vector<int32_t> out;
  for (int64_t pos = r->num_computed; pos < r->num_tokens(); ++pos) out.push_back(r->token_at(pos));
  return out;
}
}  // namespace

std::vector<StepOutput> Engine::step() {
  if (pending_) return finish_pending(/*allow_next=*/true);
  if (!stashed_.empty()) return std::exchange(stashed_, {});
  std::vector<Request*> running = scheduler_.schedule();
  if (running.empty()) return {};
  stats_.num_steps += 1;
  // Requests past their prefill go through the decode program (a graph on CUDA); new prompts
  // (and AR decode rows that record taps) through one eager ragged forward.
  std::vector<Request*> decode, eager;
  for (Request* r : running) {
    const bool decoding = r->num_computed > 0 && (spec_.drafter || !r->input.record_taps);
    (decoding ? decode : eager).push_back(r);
  }
  std::vector<StepOutput> outputs, prefilled;
  double prefill_s = 0.0;
  auto prefill = [&] {
    const Clock::time_point t = Clock::now();
    backend_.begin_step();
    stats_.num_eager_forwards += 1;
    prefilled = spec_.drafter ? speculative_prefill(eager) : autoregressive_step(eager);
    prefill_s = std::chrono::duration<double>(Clock::now() - t).count();
  };
  if (!decode.empty()) {
    const Clock::time_point t0 = Clock::now();
    std::function<void()> overlap = eager.empty() ? std::function<void()>() : std::function<void()>(prefill);
    outputs = spec_.drafter ? speculative_decode(decode, overlap) : autoregressive_decode(decode, overlap);
    stats_.time_decode_s += std::chrono::duration<double>(Clock::now() - t0).count() - prefill_s;
    (programs_->graphs() ? stats_.num_graph_steps : stats_.num_eager_decode_steps) += 1;
  } else {
    prefill();
  }
  outputs.insert(outputs.end(), std::make_move_iterator(prefilled.begin()), std::make_move_iterator(prefilled.end()));
  if (!decode.empty() && eager.empty()) {
    const std::vector<bool> none(decode.size(), false);
    if (can_pipeline(decode, none)) pending_ = launch_ahead(decode, none, /*fed=*/false);
  }
  return outputs;
}

bool Engine::can_pipeline(const std::vector<Request*>& rows, const std::vector<bool>& dead) const {
  if (!async_decode_ || spec_.drafter != nullptr || scheduler_.num_waiting() > 0) return false;
  int64_t alive = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (dead[i] || rows[i]->status == RequestStatus::kFinished) continue;
    const RequestInput& in = rows[i]->input;
    if (in.record_logits || in.record_taps || in.record_prompt_logits || !in.forced_tokens.empty()) return false;
    ++alive;
  }
  // every running request is in this step: nobody needs a step of another kind
  return alive > 0 && alive == scheduler_.num_running();
}

std::optional<Engine::PendingStep> Engine::launch_ahead(const std::vector<Request*>& rows,
                                                        const std::vector<bool>& dead, bool fed) {
  PendingStep next;
  std::vector<DecodeRow> drows;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (dead[i]) continue;
    Request* r = rows[i];
    if (r->status == RequestStatus::kFinished) continue;
    // The step not yet read (fed) emits one more token: the request continues past it only if
    // that token does not reach max_new_tokens (an EOS or stop token cannot be known yet).
    const int64_t pending_tokens = fed ? 1 : 0;
    if (static_cast<int64_t>(r->output.size()) + pending_tokens >= r->max_new_tokens) continue;
    const int64_t q0 = r->num_computed + pending_tokens;
    const SamplingConfig& s = r->input.sampling;
    DecodeRow d;
    d.q0 = q0;
    d.anchor = fed ? 0 : r->token_at(q0);
    d.feed = fed ? static_cast<int32_t>(i) : -1;
    d.blocks = &r->blocks;
    d.sample = SampleRow{s.temperature, s.top_k, s.top_p, s.seed, q0 + 1};
    r->blocks.truncate(q0);
    r->blocks.append(1);
    drows.push_back(d);
    next.rows.push_back(r);
  }
  if (drows.empty()) return std::nullopt;
  next.dead.assign(next.rows.size(), false);
  next.slot = programs_->launch(drows);
  stats_.num_pipelined_steps += 1;
  (programs_->graphs() ? stats_.num_graph_steps : stats_.num_eager_decode_steps) += 1;
  return next;
}

std::vector<StepOutput> Engine::finish_pending(bool allow_next) {
  const Clock::time_point t0 = Clock::now();
  PendingStep cur = std::move(*pending_);
  pending_.reset();
  std::optional<PendingStep> next;
  if (allow_next && can_pipeline(cur.rows, cur.dead)) next = launch_ahead(cur.rows, cur.dead, /*fed=*/true);
  programs_->wait_step(cur.slot);
  stats_.num_steps += 1;
  std::vector<StepOutput> outputs = commit_ar(cur.rows, cur.dead, programs_->tokens());
  if (next) {  // requests that ended in this step: their rows of the next one are dropped
    for (size_t j = 0; j < next->rows.size(); ++j) {
      next->dead[j] = next->rows[j]->status == RequestStatus::kFinished;
    }
    pending_ = std::move(next);
  }
  stats_.time_decode_s += std::chrono::duration<double>(Clock::now() - t0).count();
  return outputs;
}

void Engine::drain() {
  if (!pending_) return;
  std::vector<StepOutput> out = finish_pending(/*allow_next=*/false);
  stashed_.insert(stashed_.end(), std::make_move_iterator(out.begin()), std::make_move_iterator(out.end()));
}

std::vector<StepOutput> Engine::commit_ar(const std::vector<Request*>& rows, const std::vector<bool>& dead,
                                          const int32_t* sampled) {
  const Clock::time_point now = Clock::now();
  std::vector<StepOutput> outputs;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (dead[i]) {
      stats_.num_dropped_rows += 1;
      continue;
    }
    Request* r = rows[i];
    r->num_computed += 1;
    stats_.num_forward_tokens += 1;
    outputs.push_back(emit_sampled(r, sampled[i], now));
  }
  return outputs;
}

void Engine::finish_if_done(Request* r, const StepOutput& out) {
  if (out.finished) {
    scheduler_.finish(r, out.finish_reason);
    stats_.num_requests_finished += 1;
  }
}

StepOutput Engine::emit_sampled(Request* r, int32_t sampled, Clock::time_point now) {
  const size_t k = r->output.size();
  const int32_t token = k < r->input.forced_tokens.size() ? r->input.forced_tokens[k] : sampled;
  StepOutput out;
  emit(r, {token}, now, &out);
  finish_if_done(r, out);
  return out;
}

std::vector<StepOutput> Engine::autoregressive_decode(const std::vector<Request*>& running,
                                                      const std::function<void()>& overlap) {
  std::vector<DecodeRow> rows(running.size());
  bool any_record = false;
  for (size_t i = 0; i < running.size(); ++i) {
    Request* r = running[i];
    const int64_t q0 = r->num_computed;
    const SamplingConfig& s = r->input.sampling;
    rows[i].anchor = r->token_at(q0);
    rows[i].q0 = q0;
    rows[i].blocks = &r->blocks;
    rows[i].sample = SampleRow{s.temperature, s.top_k, s.top_p, s.seed, q0 + 1};
    r->blocks.truncate(q0);
    r->blocks.append(1);
    any_record = any_record || r->input.record_logits;
  }
  programs_->launch(rows);
  if (overlap && !any_record) overlap();  // recorded logits live in the arena the overlap reuses
  programs_->wait();
  const int32_t* sampled = programs_->tokens();
  const int64_t vocab = model_.config().vocab_size;
  std::vector<float> host_logits;
  if (any_record) {
    host_logits.resize(programs_->last_logits().numel());
    backend_.download_f32(programs_->last_logits(), host_logits.data());
    if (overlap) overlap();
  }
  stats_.num_forward_tokens += static_cast<int64_t>(running.size());
  const Clock::time_point now = Clock::now();
  std::vector<StepOutput> outputs;
  for (size_t i = 0; i < running.size(); ++i) {
    Request* r = running[i];
    r->num_computed += 1;
    if (r->input.record_logits) {
      r->logits.insert(r->logits.end(), host_logits.begin() + i * vocab, host_logits.begin() + (i + 1) * vocab);
    }
    outputs.push_back(emit_sampled(r, sampled[i], now));
  }
  return outputs;
}

std::vector<StepOutput> Engine::autoregressive_step(const std::vector<Request*>& running) {
  // One ragged batch: the whole prompt of a new request, the last sampled token otherwise.
  ForwardBatch batch;
  const int max_blocks = max_blocks_of(running);
  std::vector<int64_t> sample_row(running.size()), first_logit_row(running.size());
  for (size_t i = 0; i < running.size(); ++i) {
    Request* r = running[i];
    first_logit_row[i] = static_cast<int64_t>(batch.logit_rows.size());
    add_rows(batch, r, pending_tokens(r), max_blocks, r->input.record_prompt_logits && r->num_computed == 0);
    sample_row[i] = static_cast<int64_t>(batch.logit_rows.size()) - 1;
    batch.want_taps = batch.want_taps || r->input.record_taps;
  }
  ForwardResult fwd = model_.forward(batch, pool_);
  const int64_t vocab = model_.config().vocab_size;

  std::vector<SampleRow> rows(running.size());
  for (size_t i = 0; i < running.size(); ++i) {
    const Request* r = running[i];
    rows[i] = {r->input.sampling.temperature, r->input.sampling.top_k, r->input.sampling.top_p,
               r->input.sampling.seed, r->num_tokens()};
  }
  std::vector<int32_t> sampled(running.size());
  if (batch.logit_rows.size() == running.size()) {
    backend_.sample(fwd.logits, rows, sampled.data());
  } else {
    std::vector<int32_t> idx(sample_row.begin(), sample_row.end());
    const int64_t n = static_cast<int64_t>(idx.size());
    Tensor picked = backend_.empty({n, vocab}, DType::kF32);
    backend_.gather_rows(fwd.logits, backend_.upload_i32(idx.data(), {n}), picked);
    backend_.sample(picked, rows, sampled.data());
  }

  // Recordings (tests and debugging) copy to the host.
  bool any_record = false;
  for (Request* r : running) any_record = any_record || r->input.record_logits || r->input.record_taps;
  std::vector<float> host_logits, host_taps;
  if (any_record) {
    host_logits.resize(fwd.logits.numel());
    backend_.download_f32(fwd.logits, host_logits.data());
    if (!fwd.taps.empty()) {
      host_taps.resize(fwd.taps.numel());
      backend_.download_f32(fwd.taps, host_taps.data());
    }
  }

  const Clock::time_point now = Clock::now();
  stats_.num_forward_tokens += batch.num_tokens();
  std::vector<StepOutput> outputs;
  for (size_t i = 0; i < running.size(); ++i) {
    Request* r = running[i];
    const int64_t fed_from = r->num_computed;
    r->num_computed = r->num_tokens();
    if (r->input.record_logits) {
      const int64_t n = sample_row[i] + 1 - first_logit_row[i];
      r->logits.insert(r->logits.end(), host_logits.begin() + first_logit_row[i] * vocab,
                       host_logits.begin() + (first_logit_row[i] + n) * vocab);
    }
    if (r->input.record_taps && !host_taps.empty()) {
      const int64_t width = fwd.taps.dim(1), row0 = batch.query_start[i];
      const int64_t n = r->num_computed - fed_from;
      r->taps.insert(r->taps.end(), host_taps.begin() + row0 * width, host_taps.begin() + (row0 + n) * width);
    }
    outputs.push_back(emit_sampled(r, sampled[i], now));
  }
  return outputs;
}

}  // namespace dflash
