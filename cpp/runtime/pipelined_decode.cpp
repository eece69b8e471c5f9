// Pipelined decode (EngineOptions::async_decode): while every running request is decoding and
// none is waiting, each step launches the next one before it waits for its own outputs, so the
// host's work between steps runs while the GPU computes. The next step takes what it needs of
// this one's outputs on the device: AR, the sampled tokens (its anchors); speculative, the
// accepted count a and the next token of each request, which move the request on by a + 1
// positions (Backend::feed_spec_inputs; the host staged the step as if a were -1 and reserved
// blocks for the furthest it can go). The new step's draft length is chosen at its launch (with
// adaptive speculation from the acceptance committed so far, one step earlier than otherwise).
// A step of a request that ends (EOS, stop token, max_tokens) is then computed once for nothing
// and dropped (its row is dead).
// Engine::step (engine.cpp) starts the pipeline after a decode step with no prefill in it and,
// while a step is in flight, finishes it instead of scheduling; abort() drains it first.
//   can_pipeline       whether the next step may be launched ahead;
//   launch_ahead       launches it over the requests that continue (their blocks reserved first);
//   launch_ahead_spec  the same for speculative steps;
//   finish_pending     waits for the step in flight (its successor launched first), emits its tokens
//                      (commit_ar, or commit_spec of speculative_step.cpp);
//   drain              finishes it without a successor (its outputs go to the next step());
//   commit_ar          one token per live row.
#include <algorithm>
#include <utility>

#include "runtime/engine.h"
#include "runtime/test_hooks.h"

namespace dflash {

bool Engine::can_pipeline(const std::vector<Request*>& rows, const std::vector<bool>& dead) const {
  if (!async_decode_ || scheduler_.num_waiting() > 0) return false;
  int64_t alive = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (dead[i] || rows[i]->status == RequestStatus::kFinished) continue;
    if (needs_host_each_step(rows[i]->input)) return false;
    ++alive;
  }
  // every running request is in this step: nobody needs a step of another kind
  return alive > 0 && alive == scheduler_.num_running();
}

std::optional<Engine::PendingStep> Engine::launch_ahead(const std::vector<Request*>& rows,
                                                        const std::vector<bool>& dead, bool fed, int64_t prev_n) {
  if (spec_.drafter) return launch_ahead_spec(rows, dead, fed, prev_n);
  // The step not yet read (fed) emits one more token: a request continues past it only if
  // that token does not reach max_new_tokens (an EOS or stop token cannot be known yet).
  const int64_t pending_tokens = fed ? 1 : 0;
  std::vector<size_t> continuing;
  int64_t more_blocks = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const Request* r = rows[i];
    if (dead[i] || r->status == RequestStatus::kFinished) continue;
    if (static_cast<int64_t>(r->output.size()) + pending_tokens >= r->max_new_tokens) continue;
    continuing.push_back(i);
    more_blocks += std::max<int64_t>(0, BlockTable::blocks_for(r->num_computed + pending_tokens + 1,
                                                                 r->blocks.block_size()) -
                                            static_cast<int64_t>(r->blocks.blocks().size()));
  }
  // Growing a block table may need a preemption, which only the scheduler's step does.
  if (!allocator_.can_allocate(more_blocks)) return std::nullopt;
  PendingStep next;
  std::vector<DecodeRow> drows;
  for (size_t i : continuing) {
    Request* r = rows[i];
    const int64_t q0 = r->num_computed + pending_tokens;
    r->blocks.reserve(q0 + 1, allocator_);
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

std::optional<Engine::PendingStep> Engine::launch_ahead_spec(const std::vector<Request*>& rows,
                                                             const std::vector<bool>& dead, bool fed, int64_t prev_n) {
  // The step not yet read (fed, prev_n drafts) emits 1 to prev_n + 1 tokens and moves its request
  // on as far: a request continues past it unless its first token reaches max_new_tokens, and the
  // new step's q rows lie in [q0, q0 + prev_n + 1 + q) for q0 = num_computed now (without fed:
  // [q0, q0 + q)). The decode programs hold keys up to max_model_len + q: a request nearer its end
  // than that waits for a step of its own (the pipeline pauses while it is not in the step in
  // flight, can_pipeline).
  const int64_t pending_min = fed ? 1 : 0, pending_max = fed ? prev_n + 1 : 0;
  std::vector<size_t> continuing;
  std::vector<Request*> requests;
  for (size_t i = 0; i < rows.size(); ++i) {
    Request* r = rows[i];
    if (dead[i] || r->status == RequestStatus::kFinished) continue;
    if (static_cast<int64_t>(r->output.size()) + pending_min >= r->max_new_tokens) continue;
    if (r->num_computed + pending_max > max_model_len_) continue;
    continuing.push_back(i);
    requests.push_back(r);
  }
  if (continuing.empty()) return std::nullopt;
  // The draft length: fixed, or the adaptive policy's choice from the acceptance committed so far.
  const int64_t n = choose_length(requests), q = n + 1;
  int64_t more_blocks = 0;
  for (const Request* r : requests) {
    more_blocks += std::max<int64_t>(0, BlockTable::blocks_for(r->num_computed + pending_max + q,
                                                                 r->blocks.block_size()) -
                                            static_cast<int64_t>(r->blocks.blocks().size()));
  }
  // Growing a block table may need a preemption, which only the scheduler's step does.
  if (!allocator_.can_allocate(more_blocks)) return std::nullopt;
  PendingStep next;
  next.n = n;
  std::vector<DecodeRow> drows;
  for (size_t i : continuing) {
    Request* r = rows[i];
    const int64_t q0 = r->num_computed;
    r->blocks.reserve(q0 + pending_max + q, allocator_);
    const SamplingConfig& s = r->input.sampling;
    DecodeRow d;
    d.q0 = q0;
    d.anchor = fed ? 0 : r->output.back();
    d.feed = fed ? static_cast<int32_t>(i) : -1;
    d.blocks = &r->blocks;
    d.sample = SampleRow{s.temperature, s.top_k, s.top_p, s.seed, q0 + 1};
    if (!fed) {  // as speculative_decode stages a step (a fed one grows the table when it commits)
      r->blocks.truncate(q0);
      r->blocks.append(q);
    }
    drows.push_back(d);
    next.rows.push_back(r);
  }
  if (drows.empty()) return std::nullopt;
  next.dead.assign(next.rows.size(), false);
  next.slot = programs_->launch(drows, nullptr, n);
  stats_.num_pipelined_steps += 1;
  (programs_->graphs() ? stats_.num_graph_steps : stats_.num_eager_decode_steps) += 1;
  num_spec_decode_steps_ += 1;
  stats_.spec_length_steps[n] += 1;
  return next;
}

std::vector<StepOutput> Engine::finish_pending(bool allow_next) {
  const Clock::time_point t0 = Clock::now();
  PendingStep cur = std::move(*pending_);
  pending_.reset();
  std::optional<PendingStep> next;
  if (allow_next && can_pipeline(cur.rows, cur.dead)) next = launch_ahead(cur.rows, cur.dead, /*fed=*/true, cur.n);
  programs_->wait_step(cur.slot);
  stats_.num_steps += 1;
  std::vector<StepOutput> outputs = spec_.drafter ? commit_spec(cur.rows, cur.dead, cur.n)
                                                  : commit_ar(cur.rows, cur.dead, programs_->tokens(),
                                                              programs_->nonfinite());
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
                                          const int32_t* sampled, const int32_t* nonfinite) {
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
    outputs.push_back(emit_sampled(r, sampled[i], nonfinite[i] != 0, now));
  }
  return outputs;
}

}  // namespace dflash
