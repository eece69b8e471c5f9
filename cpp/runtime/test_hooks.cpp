// The runtime's test and debugging hooks (see test_hooks.h).
#include "runtime/test_hooks.h"

#include <algorithm>

#include "common/error.h"

namespace dflash {

void test_hooks_check(const RequestInput& input, int64_t vocab, bool speculative) {
  for (int32_t t : input.forced_tokens) {
    DFLASH_ARG_CHECK(t >= 0 && t < vocab, "forced token id ", t, " is outside the vocabulary");
  }
  for (int32_t t : input.oracle_drafts) {
    DFLASH_ARG_CHECK(t >= 0 && t < vocab, "oracle draft token id ", t, " is outside the vocabulary");
  }
  DFLASH_ARG_CHECK(!speculative || !(input.record_logits || input.record_prompt_logits || input.record_taps),
                   "logit/tap recording is only available without a draft model");
}

void length_schedule_check(const std::vector<int64_t>& schedule, bool adaptive, const std::vector<int64_t>& lengths) {
  DFLASH_ARG_CHECK(schedule.empty() || adaptive, "a draft length schedule (test hook) needs adaptive speculation");
  for (int64_t l : schedule) {
    DFLASH_ARG_CHECK(std::binary_search(lengths.begin(), lengths.end(), l), "the draft length schedule ", "holds ", l,
                     ", which is not one of the draft lengths with programs");
  }
}

std::optional<int64_t> scheduled_length(const std::vector<int64_t>& schedule, int64_t step) {
  if (schedule.empty()) return std::nullopt;
  return schedule[static_cast<size_t>(step) % schedule.size()];
}

std::optional<int32_t> forced_token(const Request& r) {
  const size_t k = r.output.size();
  if (k < r.input.forced_tokens.size()) return r.input.forced_tokens[k];
  return std::nullopt;
}

std::vector<int32_t> oracle_overrides(const Request& r, int64_t n) {
  const std::vector<int32_t>& oracle = r.input.oracle_drafts;
  std::vector<int32_t> drafts;
  if (oracle.empty()) return drafts;
  for (int64_t j = 0; j < n; ++j) {
    const size_t k = r.output.size() + j;
    drafts.push_back(k < oracle.size() ? oracle[k] : oracle.back());
  }
  return drafts;
}

bool records_rows(const RequestInput& input) { return input.record_logits || input.record_taps; }

bool needs_host_each_step(const RequestInput& input) {
  return input.record_logits || input.record_taps || input.record_prompt_logits || !input.forced_tokens.empty() ||
         !input.oracle_drafts.empty();
}

int64_t first_prompt_logit(const Request& r, int64_t end) {
  if (!r.input.record_prompt_logits) return end;
  const int64_t prompt = static_cast<int64_t>(r.input.prompt.size());
  const int64_t lo = std::max(r.num_computed, r.max_computed);
  return lo < std::min(end, prompt) ? lo : end;
}

void StepRecorder::download(Backend& backend, const Tensor& logits, int64_t vocab, const Tensor& taps) {
  if (!active_) return;
  vocab_ = vocab;
  logits_.resize(logits.numel());
  if (!logits_.empty()) backend.download_f32(logits, logits_.data());
  if (!taps.empty()) {
    width_ = taps.dim(1);
    taps_.resize(taps.numel());
    backend.download_f32(taps, taps_.data());
  }
}

void StepRecorder::add_logits(Request* r, int64_t row0, int64_t n) const {
  if (!active_ || !r->input.record_logits) return;
  r->logits.insert(r->logits.end(), logits_.begin() + row0 * vocab_, logits_.begin() + (row0 + n) * vocab_);
}

void StepRecorder::add_taps(Request* r, int64_t row0, int64_t start, int64_t end) const {
  if (!active_ || !r->input.record_taps || taps_.empty()) return;
  const int64_t from = std::max(start, r->max_computed);
  if (from < end) {
    r->taps.insert(r->taps.end(), taps_.begin() + (row0 + from - start) * width_,
                   taps_.begin() + (row0 + end - start) * width_);
  }
}

}  // namespace dflash
