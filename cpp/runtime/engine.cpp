// The engine step and request validation (see engine.h), and the target-only (AR) steps. The
// speculative step is in speculative_step.cpp, pipelined AR decode in pipelined_decode.cpp, the
// drafter inspection in propose.cpp, the test hooks the step calls in test_hooks.h.
#include "runtime/engine.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "runtime/ragged_batch.h"
#include "runtime/test_hooks.h"

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
  if (spec_.drafter) {
    stats_.accepted_per_position.assign(spec_.num_spec_tokens, 0);
    stats_.spec_length_steps.assign(spec_.num_spec_tokens + 1, 0);
  }
  DFLASH_ARG_CHECK(!spec_.adaptive || spec_.drafter != nullptr, "adaptive speculation needs a draft model");
  if (spec_.adaptive) spec_.lengths = spec_lengths_normalize(spec_.lengths, spec_.num_spec_tokens);
  length_schedule_check(spec_.length_schedule, spec_.adaptive, spec_.lengths);
  DFLASH_ARG_CHECK(!spec_.adaptive || spec_.costs.empty() || spec_.costs.lengths == spec_.lengths,
                   "the speculation cost table must have one cost per draft length with programs");
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
  if (spec_.adaptive) pc.draft_lengths = spec_.lengths;
  programs_ = std::make_unique<DecodePrograms>(backend_, model_, pool_, spec_.drafter, spec_.pool, pc);
  programs_->capture();
  if (spec_.adaptive) {
    SpecCostTable costs = spec_.costs;
    if (costs.empty()) {
      const Clock::time_point t0 = Clock::now();
      costs = programs_->measure_costs();
      stats_.time_measure_costs_s = std::chrono::duration<double>(Clock::now() - t0).count();
    }
    policy_ = std::make_unique<SpecPolicy>(spec_.num_spec_tokens, spec_.policy, std::move(costs));
  }
  programs_->set_host_timers(&stats_);  // after the start-up runs
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
  if (policy_) policy_->forget(id);
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
  test_hooks_check(input, vocab, spec_.drafter != nullptr);
  DFLASH_ARG_CHECK(s.max_tokens >= 1, "max_tokens must be >= 1, got ", s.max_tokens);
  DFLASH_ARG_CHECK(std::isfinite(s.temperature) && s.temperature >= 0.0f,
                   "temperature must be a finite number >= 0, got ", s.temperature);
  DFLASH_ARG_CHECK(s.top_p > 0.0f && s.top_p <= 1.0f, "top_p must be in (0, 1], got ", s.top_p);
  DFLASH_ARG_CHECK(s.top_k >= 0, "top_k must be >= 0 (0 disables it), got ", s.top_k);

  auto req = std::make_unique<Request>(scheduler_.config().block_size);
  req->id = next_id_++;
  req->max_new_tokens = std::min<int64_t>(s.max_tokens, max_model_len_ - prompt);
  req->input = std::move(input);
  // Admission takes only the blocks a request needs now, but one that could not finish alone in
  // the whole cache would wait (or be preempted) forever: refused here.
  const int64_t bs = scheduler_.config().block_size;
  const int64_t worst = scheduler_.worst_case_tokens(*req), cache = allocator_.num_blocks() * bs;
  DFLASH_ARG_CHECK(BlockTable::blocks_for(worst, bs) <= allocator_.num_blocks(), "the request needs ", worst,
                   " KV cache slots (prompt ", prompt, " + max_tokens ", req->max_new_tokens,
                   spec_.drafter ? " + " + std::to_string(worst - prompt - req->max_new_tokens) + " of a verify block" : "",
                   ") but the cache holds only ", cache,
                   BlockTable::blocks_for(prompt + 1, bs) > allocator_.num_blocks()
                       ? " (the prompt alone does not fit); raise kv_cache_tokens"
                       : "; raise kv_cache_tokens or lower max_tokens");
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

void Engine::add_rows(ForwardBatch& batch, const PrefillChunk& c, int max_blocks, int64_t first_logit) {
  Request* r = c.req;
  const int64_t start = r->num_computed, end = c.end();
  std::vector<int32_t> tokens;
  tokens.reserve(static_cast<size_t>(c.num_tokens));
  for (int64_t pos = start; pos < end; ++pos) tokens.push_back(r->token_at(pos));
  ragged_batch_append(batch, tokens, start, r->blocks, max_blocks, first_logit);
  r->blocks.truncate(start);
  r->blocks.append(c.num_tokens);
}

namespace {
int max_blocks_of(const std::vector<PrefillChunk>& chunks) {
  int m = 0;
  for (const PrefillChunk& c : chunks) m = std::max<int>(m, static_cast<int>(c.req->blocks.blocks().size()));
  return m;
}
}  // namespace

std::vector<StepOutput> Engine::step() {
  if (pending_) return finish_pending(/*allow_next=*/true);
  if (!stashed_.empty()) return std::exchange(stashed_, {});
  Schedule plan = scheduler_.schedule();
  stats_.num_preemptions += plan.num_preempted;
  if (plan.empty()) {
    // With nothing running every block is free, and add_request refused requests that do not fit.
    DFLASH_CHECK(!scheduler_.has_unfinished(), "the scheduler ran nothing with ", scheduler_.num_waiting(),
                 " requests waiting and ", scheduler_.num_running(), " running");
    return {};
  }
  stats_.num_steps += 1;
  stats_.num_prefill_chunks += static_cast<int64_t>(plan.prefill.size());
  // Requests past their prefill go through the decode program (a graph on CUDA); prefill chunks
  // (and AR decode rows that record taps) through one eager ragged forward.
  std::vector<Request*> decode;
  std::vector<PrefillChunk> eager = plan.prefill;
  for (Request* r : plan.decode) {
    if (spec_.drafter || !r->input.record_taps) {
      decode.push_back(r);
    } else {
      eager.push_back({r, r->num_tokens() - r->num_computed});
    }
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

void Engine::finish_if_done(Request* r, const StepOutput& out) {
  if (out.finished) {
    if (policy_) policy_->forget(r->id);
    scheduler_.finish(r, out.finish_reason);
    stats_.num_requests_finished += 1;
  }
}

StepOutput Engine::emit_sampled(Request* r, int32_t sampled, bool nonfinite, Clock::time_point now) {
  const std::optional<int32_t> forced = forced_token(*r);
  StepOutput out;
  if (nonfinite && !forced) {
    out.request_id = r->id;
    r->metrics.num_steps += 1;
    fail_nonfinite(r, &out);
    return out;
  }
  emit(r, {forced.value_or(sampled)}, now, &out);
  finish_if_done(r, out);
  return out;
}

void Engine::fail_nonfinite(Request* r, StepOutput* out) {
  out->finished = true;
  out->finish_reason = "error";
  stats_.num_nonfinite_requests += 1;
  finish_if_done(r, *out);
}

std::vector<int32_t> Engine::nonfinite_rows(const Tensor& logits) {
  const int64_t n = logits.dim(0);
  std::vector<int32_t> host(static_cast<size_t>(n), 0);
  if (n == 0) return host;
  Tensor flags = backend_.empty({n}, DType::kI32);
  backend_.nonfinite_rows(logits, flags);
  backend_.copy_to_host(host.data(), flags, static_cast<size_t>(n) * sizeof(int32_t));
  backend_.synchronize();
  return host;
}

std::vector<StepOutput> Engine::autoregressive_decode(const std::vector<Request*>& running,
                                                      const std::function<void()>& overlap) {
  std::vector<DecodeRow> rows(running.size());
  bool any_record = false;  // recorded logits (test hook)
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
  StepRecorder recorder(any_record);
  if (overlap && !recorder.active()) overlap();  // recorded logits live in the arena the overlap reuses
  programs_->wait();
  const int32_t* sampled = programs_->tokens();
  const int32_t* nonfinite = programs_->nonfinite();
  if (recorder.active()) {
    recorder.download(backend_, programs_->last_logits(), model_.config().vocab_size);
    if (overlap) overlap();
  }
  stats_.num_forward_tokens += static_cast<int64_t>(running.size());
  const Clock::time_point now = Clock::now();
  std::vector<StepOutput> outputs;
  for (size_t i = 0; i < running.size(); ++i) {
    Request* r = running[i];
    r->num_computed += 1;
    recorder.add_logits(r, static_cast<int64_t>(i), 1);
    outputs.push_back(emit_sampled(r, sampled[i], nonfinite[i] != 0, now));
  }
  return outputs;
}

std::vector<StepOutput> Engine::autoregressive_step(const std::vector<PrefillChunk>& rows) {
  // One ragged batch of prefill chunks and decode rows. Logits: the last row of a chunk that
  // samples, and the prompt rows of requests that record them (not again after a preemption:
  // recordings skip the rows below max_computed, which a recompute computes a second time).
  ForwardBatch batch;
  const int max_blocks = max_blocks_of(rows);
  std::vector<int64_t> first_logit_row(rows.size()), num_logit_rows(rows.size());
  std::vector<int64_t> sample_idx;  // logit row of each sampling chunk
  std::vector<SampleRow> samples;
  for (size_t i = 0; i < rows.size(); ++i) {
    const PrefillChunk& c = rows[i];
    const Request* r = c.req;
    const int64_t first = std::min(c.samples() ? c.end() - 1 : c.end(), first_prompt_logit(*r, c.end()));
    first_logit_row[i] = static_cast<int64_t>(batch.logit_rows.size());
    add_rows(batch, c, max_blocks, first);
    num_logit_rows[i] = static_cast<int64_t>(batch.logit_rows.size()) - first_logit_row[i];
    batch.want_taps = batch.want_taps || r->input.record_taps;
    if (c.samples()) {
      const SamplingConfig& s = r->input.sampling;
      sample_idx.push_back(static_cast<int64_t>(batch.logit_rows.size()) - 1);
      samples.push_back(SampleRow{s.temperature, s.top_k, s.top_p, s.seed, c.end()});
    }
  }
  ForwardResult fwd = model_.forward(batch, pool_);
  const int64_t vocab = model_.config().vocab_size;

  std::vector<int32_t> sampled(samples.size()), nonfinite(samples.size(), 0);
  if (!samples.empty()) {
    Tensor picked = fwd.logits;
    if (sample_idx.size() != batch.logit_rows.size()) {
      std::vector<int32_t> idx(sample_idx.begin(), sample_idx.end());
      const int64_t n = static_cast<int64_t>(idx.size());
      picked = backend_.empty({n, vocab}, DType::kF32);
      backend_.gather_rows(fwd.logits, backend_.upload_i32(idx.data(), {n}), picked);
    }
    backend_.sample(picked, samples, sampled.data());
    nonfinite = nonfinite_rows(picked);
  }

  // Recordings (tests and debugging) copy to the host.
  bool any_record = false;
  for (const PrefillChunk& c : rows) any_record = any_record || records_rows(c.req->input);
  StepRecorder recorder(any_record);
  recorder.download(backend_, fwd.logits, vocab, fwd.taps);

  const Clock::time_point now = Clock::now();
  stats_.num_forward_tokens += batch.num_tokens();
  std::vector<StepOutput> outputs;
  size_t next_sample = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const PrefillChunk& c = rows[i];
    Request* r = c.req;
    const bool samples_here = c.samples();
    const int64_t start = r->num_computed, end = c.end();
    recorder.add_logits(r, first_logit_row[i], num_logit_rows[i]);
    recorder.add_taps(r, batch.query_start[i], start, end);
    r->num_computed = end;
    if (samples_here) {
      outputs.push_back(emit_sampled(r, sampled[next_sample], nonfinite[next_sample] != 0, now));
      ++next_sample;
    }
  }
  return outputs;
}

}  // namespace dflash
