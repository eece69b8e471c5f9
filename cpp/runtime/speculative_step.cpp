// The DFlash speculative step, read top to bottom. Engine::step (engine.cpp) schedules the
// running requests and sends prefill chunks here to speculative_prefill and requests past their
// prefill to speculative_decode:
//   prefill   one causal target forward with taps over the chunks (a whole prompt, one chunk of
//             a long one, or a preempted request's prompt + generated tokens being recomputed),
//             every chunk row into the drafter's context (its K/V), and the first token after a
//             new request's last chunk;
//   length    the step's draft length n: num_speculative_tokens, or with adaptive speculation
//             one length for the whole batch chosen by the policy (spec_policy.h) among those
//             with decode programs; n = 0 runs issue_context_step (target forward with taps,
//             sampling, the anchor into the drafter's context: an AR step after which any
//             length can draft again);
//   decode    the rows of the step are staged into the decode program of that length, which
//             runs (one CUDA graph on CUDA, eager on the CPU) issue_speculative below:
//               draft    the drafter proposes n tokens per request from [anchor, MASK x n]
//                        (drafter.h: argmax, sampled, or DFlash2's candidate walk);
//               verify   one causal target forward over [anchor, drafts] with taps;
//               accept   greedy prefix match, or exact rejection sampling against the proposal;
//               context  the verify rows' taps into the drafter's context;
//   commit    back on the host: truncate the target KV to the accepted length, emit the tokens
//             with stop checks, the per-request metrics and the policy's acceptance estimates.
#include <algorithm>

#include "runtime/engine.h"
#include "runtime/test_hooks.h"

namespace dflash {

namespace {

int max_blocks_of(const std::vector<PrefillChunk>& chunks) {
  int m = 0;
  for (const PrefillChunk& c : chunks) m = std::max<int>(m, static_cast<int>(c.req->blocks.blocks().size()));
  return m;
}

SampleRow sample_row_of(const Request& r, int64_t position) {
  const SamplingConfig& s = r.input.sampling;
  return SampleRow{s.temperature, s.top_k, s.top_p, s.seed, position};
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

std::vector<StepOutput> Engine::speculative_prefill(const std::vector<PrefillChunk>& chunks) {
  // One causal target forward with taps over the chunks; the drafter's context from the taps of
  // every row (a chunk's context is that of its positions: the same whether the prompt comes in
  // one chunk or several, or is recomputed after a preemption); the first token.
  Drafter& drafter = *spec_.drafter;
  const int max_blocks = max_blocks_of(chunks);
  ForwardBatch batch;
  batch.want_taps = true;
  std::vector<SampleRow> rows;
  for (const PrefillChunk& c : chunks) {
    add_rows(batch, c, max_blocks, c.samples() ? c.end() - 1 : c.end());
    if (c.samples()) rows.push_back(sample_row_of(*c.req, c.end()));
  }
  ForwardResult fwd = model_.forward(batch, pool_);
  std::vector<int32_t> sampled(rows.size()), nonfinite(rows.size(), 0);
  if (!rows.empty()) {
    backend_.sample(fwd.logits, rows, sampled.data());
    nonfinite = nonfinite_rows(fwd.logits);
  }
  stats_.num_forward_tokens += batch.num_tokens();
  // Every row is context; written before the tokens are emitted (which may finish a request and
  // free its blocks; nothing allocates them before the next step, whose writes come later).
  drafter.update_context(fwd.taps, batch.positions, batch.slots, *spec_.pool);

  const Clock::time_point now = Clock::now();
  std::vector<StepOutput> outputs;
  size_t next = 0;
  for (const PrefillChunk& c : chunks) {
    Request* r = c.req;
    const bool samples = c.samples();
    r->num_computed = c.end();
    if (samples) {
      outputs.push_back(emit_sampled(r, sampled[next], nonfinite[next] != 0, now));
      ++next;
    }
  }
  return outputs;
}

void DecodePrograms::issue_speculative(DeviceBatch& d, int64_t n, const Tensor& params,
                                       const std::function<void(int)>& phase) {
  const int64_t b = d.meta.num_seqs, q = n + 1, t = b * q;
  auto mark = [&](int p) {
    if (phase) phase(p);
  };
  // Draft: [anchor, MASK x n] per request over context + block, through the drafting seam.
  d.meta.causal = false;
  d.logit_rows = in_.logit_rows.rows(0, b * n);
  const int64_t k = drafter_->proposal_width();
  const ProposalKind kind = drafter_->proposal_kind();
  DraftOutputs proposal;
  proposal.drafts = proposed_.rows(0, b * n).reshape({b, n});
  if (kind != ProposalKind::kOneHot) proposal.realized = realized_.rows(0, b * n * k).reshape({b, n, k});
  if (kind == ProposalKind::kCandidates) proposal.cand_ids = cand_ids_.rows(0, b * n * k).reshape({b, n, k});
  drafter_->propose(d, *draft_pool_, in_.anchors.rows(0, b), params, proposal);
  Tensor proposed = proposal.drafts;
  Tensor drafts = out_.drafts.rows(0, b * n).reshape({b, n});
  Tensor verify_ids = in_.verify_ids.rows(0, t).reshape({b, q});
  backend_.assemble_drafts(proposed.reshape({b, n}), in_.override_drafts.rows(0, b * n).reshape({b, n}),
                           in_.use_override.rows(0, b), drafts, verify_ids);
  mark(0);
  // Verify: [anchor, drafts] causal, every row's logits, taps for the context update.
  DeviceBatch v = d;
  v.token_ids = in_.verify_ids.rows(0, t);
  v.meta.causal = true;
  v.logit_rows = Tensor();
  v.all_logit_rows = true;
  v.want_taps = true;
  ForwardResult fwd = target_.forward(v, target_pool_);
  mark(1);
  Tensor accepted = out_.num_accepted.rows(0, b), next = out_.next_token.rows(0, b);
  Tensor nonfinite = out_.nonfinite.rows(0, t);
  backend_.nonfinite_rows(fwd.logits, nonfinite);
  if (kind != ProposalKind::kOneHot) {  // cand_ids empty for dense proposals
    backend_.accept_candidates(drafts, proposal.cand_ids, proposal.realized, fwd.logits, params, accepted, next);
  } else {
    backend_.accept(drafts, fwd.logits, params, accepted, next);
  }
  mark(2);
  // Context update of all q rows (the rejected ones are overwritten by the next draft block).
  drafter_->update_context(fwd.taps, d.positions, d.slots, *draft_pool_);
  mark(3);
}

void DecodePrograms::issue_context_step(DeviceBatch& d, const Tensor& params, const std::function<void(int)>& phase) {
  // n = 0: an AR step that keeps the drafter's context exact, so that any later step can draft
  // (with any length) as if every step had drafted: the anchor's target forward with taps, the
  // next token sampled as target-only decoding samples it (the same (seed, position) draws), and
  // the anchor's row into the drafter's context.
  const int64_t b = d.meta.num_seqs;
  auto mark = [&](int p) {
    if (phase) phase(p);
  };
  mark(0);  // nothing drafted
  d.meta.causal = true;
  d.all_logit_rows = true;
  d.want_taps = true;
  ForwardResult fwd = target_.forward(d, target_pool_);
  mark(1);
  Tensor next = out_.next_token.rows(0, b), nonfinite = out_.nonfinite.rows(0, b);
  backend_.nonfinite_rows(fwd.logits, nonfinite);
  backend_.sample_rows(fwd.logits, params, next);
  if (config_.feed) {  // a pipelined successor moves on by num_accepted + 1: nothing was drafted
    Tensor accepted = out_.num_accepted.rows(0, b);
    backend_.clear(accepted);
  }
  mark(2);
  drafter_->update_context(fwd.taps, d.positions, d.slots, *draft_pool_);
  mark(3);
}

int64_t Engine::choose_length(const std::vector<Request*>& running) {
  if (!policy_) return spec_.num_spec_tokens;
  if (const std::optional<int64_t> l = scheduled_length(spec_.length_schedule, num_spec_decode_steps_)) return *l;
  std::vector<int64_t> ids, remaining;
  for (const Request* r : running) {
    ids.push_back(r->id);
    remaining.push_back(r->max_new_tokens - static_cast<int64_t>(r->output.size()));
  }
  return policy_->choose(ids, remaining, programs_->padded(static_cast<int64_t>(running.size())));
}

std::vector<StepOutput> Engine::speculative_decode(const std::vector<Request*>& running,
                                                   const std::function<void()>& overlap) {
  // The step's draft length: fixed, or chosen for the whole batch (adaptive speculation); 0 runs
  // the AR program that keeps the drafter's context.
  const int64_t n = choose_length(running);
  num_spec_decode_steps_ += 1;
  stats_.spec_length_steps[n] += 1;
  std::vector<DecodeRow> rows(running.size());
  std::vector<std::vector<int32_t>> overrides(running.size());  // [running][n] oracle drafts
  for (size_t i = 0; i < running.size(); ++i) {
    Request* r = running[i];
    const int64_t q0 = r->num_computed;
    rows[i].anchor = r->output.back();
    rows[i].q0 = q0;
    rows[i].blocks = &r->blocks;
    rows[i].sample = sample_row_of(*r, q0 + 1);
    overrides[i] = oracle_overrides(*r, n);  // test hook: drafts in place of the drafter's
    if (!overrides[i].empty()) rows[i].override_drafts = overrides[i].data();
    r->blocks.truncate(q0);
    r->blocks.append(n + 1);  // the verify block's K/V (the tail is dropped after acceptance)
  }
  // Phase times in eager mode (the backend is synchronised between phases there).
  Clock::time_point t = Clock::now();
  double* phase_time[] = {&stats_.time_draft_s, &stats_.time_verify_s, &stats_.time_accept_s,
                          &stats_.time_context_s};
  programs_->launch(rows, [&](int phase) { *phase_time[phase] += lap(backend_, &t); }, n);
  if (overlap) overlap();  // queued behind the program; its own sync also waits for the program
  programs_->wait();
  return commit_spec(running, std::vector<bool>(running.size(), false), n);
}

std::vector<StepOutput> Engine::commit_spec(const std::vector<Request*>& running, const std::vector<bool>& dead,
                                            int64_t n) {
  const int32_t* drafts = programs_->drafts();
  const int32_t* accepted = programs_->num_accepted();
  const int32_t* next = programs_->next_token();
  const int32_t* nonfinite = programs_->nonfinite();
  const Clock::time_point now = Clock::now();
  std::vector<StepOutput> outputs;
  for (size_t i = 0; i < running.size(); ++i) {
    if (dead[i]) {  // a pipelined step's row of a request that ended in the step before
      stats_.num_dropped_rows += 1;
      continue;
    }
    stats_.num_forward_tokens += n + 1;
    Request* r = running[i];
    int64_t a = n > 0 ? accepted[i] : 0;
    // The rows the outcome read are 0..a (row j judges draft j; row a gave the next token). From
    // the first of them holding a NaN or an infinity on, nothing is emitted: the drafts it
    // accepted before it stand (as target-only decoding would have emitted them), then the
    // request ends with finish_reason "error".
    int64_t bad = -1;
    for (int64_t j = 0; j <= a; ++j) {
      if (nonfinite[static_cast<int64_t>(i) * (n + 1) + j] != 0) {
        bad = j;
        break;
      }
    }
    if (bad >= 0) a = bad;
    std::vector<int32_t> emitted(drafts + i * n, drafts + i * n + a);
    if (bad < 0) emitted.push_back(next[i]);
    RequestMetrics& m = r->metrics;
    if (n > 0) {  // draft-verify steps (an AR step of adaptive speculation drafts nothing)
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
    }
    if (policy_) policy_->observe(r->id, n, a);
    r->num_computed += bad < 0 ? a + 1 : a;  // the anchor and the accepted drafts (finite rows only)
    // The K/V of rejected drafts is dropped (O(1); a pipelined step staged no tokens: the table
    // grows to them here, inside the blocks its launch reserved).
    if (r->blocks.num_tokens() > r->num_computed) {
      r->blocks.truncate(r->num_computed);
    } else {
      r->blocks.append(r->num_computed - r->blocks.num_tokens());
    }
    StepOutput out;
    const int64_t appended = emit(r, emitted, now, &out);
    if (n > 0) {
      m.num_spec_emitted += appended;
      stats_.num_spec_emitted += appended;
    }
    if (bad >= 0 && !out.finished) {
      fail_nonfinite(r, &out);
    } else {
      finish_if_done(r, out);
    }
    outputs.push_back(std::move(out));
  }
  return outputs;
}

}  // namespace dflash
