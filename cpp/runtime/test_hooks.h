// The runtime's test and debugging hooks, kept out of the step code (tests drive them through
// dflash._core; none is part of the public API): a request's forced tokens (teacher forcing) and
// oracle drafts, the recordings of its logits and hidden-state taps (RequestInput, request.h),
// and the draft length schedule of adaptive speculation (Speculator::length_schedule, engine.h).
// The step calls the small functions below; each is a no-op for a request without hooks.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "runtime/request.h"

namespace dflash {

// Checks a request's hooks on entry (InvalidArgument): forced and oracle tokens inside the
// vocabulary [0, vocab), recordings only without a draft model (`speculative` false).
void test_hooks_check(const RequestInput& input, int64_t vocab, bool speculative);

// Checks the draft length schedule: only with adaptive speculation, every entry one of `lengths`
// (ascending: the draft lengths with decode programs).
void length_schedule_check(const std::vector<int64_t>& schedule, bool adaptive, const std::vector<int64_t>& lengths);

// The draft length the schedule sets for speculative decode step `step` (counted from 0, cycling
// through it); nullopt when there is no schedule (the policy chooses).
std::optional<int64_t> scheduled_length(const std::vector<int64_t>& schedule, int64_t step);

// The token r must emit next instead of a sampled one (forced token number output.size()), or
// nullopt.
std::optional<int32_t> forced_token(const Request& r);

// The n drafts of r's next speculative step when it has oracle drafts (draft j is generated token
// number output.size() + j, the oracle's last token past its end); empty otherwise.
std::vector<int32_t> oracle_overrides(const Request& r, int64_t n);

// Whether a request records logits or taps (of the rows an eager step computes for it).
bool records_rows(const RequestInput& input);

// Whether a request has a hook that needs the host at every step (a recording, forced tokens or
// oracle drafts): a decode step launched before its predecessor's outputs are read cannot serve it.
bool needs_host_each_step(const RequestInput& input);

// The first position below `end` (the end of a prefill chunk of r) whose logits r records as
// prompt logits: from max(num_computed, max_computed) (not again after a preemption, whose
// recompute computes those rows a second time) to the prompt's end. `end` when there is none.
int64_t first_prompt_logit(const Request& r, int64_t end);

// Host copies of one step's logits [N, V] and taps [T, width] for the requests that record them.
// Inactive (no request of the step records): downloads nothing and records nothing.
class StepRecorder {
 public:
  explicit StepRecorder(bool active) : active_(active) {}
  bool active() const { return active_; }
  // When active, copies logits [N, vocab] (fp32) and, when not empty, taps [T, width] to the host.
  void download(Backend& backend, const Tensor& logits, int64_t vocab, const Tensor& taps = Tensor());
  // Appends logit rows [row0, row0 + n) to r->logits when r records logits.
  void add_logits(Request* r, int64_t row0, int64_t n) const;
  // Appends the taps of r's rows at positions [max(start, r->max_computed), end) to r->taps when
  // r records taps; `row0` is the batch row of position `start`.
  void add_taps(Request* r, int64_t row0, int64_t start, int64_t end) const;

 private:
  bool active_;
  int64_t vocab_ = 0, width_ = 0;
  std::vector<float> logits_;  // [N, vocab]
  std::vector<float> taps_;    // [T, width], empty without taps
};

}  // namespace dflash
