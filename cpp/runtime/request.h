// A generation request as the runtime sees it: token ids in, token ids out, its sampling
// parameters, its KV blocks, its metrics (RequestMetrics, StepOutput: the public types of
// include/dflash/outputs.h), and test/debug hooks (forced tokens, recorded logits
// and hidden-state taps). Its prefill (the prompt, or after a preemption the prompt and all but
// the last generated token) may run in chunks over several steps, and starts after the blocks
// found in the prefix cache (num_computed = the cached tokens on admission).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "dflash/outputs.h"
#include "dflash/sampling_params.h"
#include "kv_cache/block_allocator.h"

namespace dflash {

using Clock = std::chrono::steady_clock;

// The public SamplingParams (include/dflash/sampling_params.h) under the runtime's name.
using SamplingConfig = SamplingParams;

struct RequestInput {
  std::vector<int32_t> prompt;
  SamplingConfig sampling;
  // Debug/test hooks (not part of the public Python API; what the step does with them:
  // runtime/test_hooks.h):
  std::vector<int32_t> forced_tokens;  // emit these instead of sampling (teacher forcing)
  bool record_logits = false;          // keep the logits of every sampled position
  bool record_prompt_logits = false;   // ...and of every prompt position
  bool record_taps = false;            // keep the hidden-state taps of every row
  // Speculative decoding test hook: the drafts proposed at each step are taken from this
  // sequence (the expected continuation: token k is the k-th generated token) instead of the
  // drafter, so tests can drive full-block acceptance.
  std::vector<int32_t> oracle_drafts;
};

enum class RequestStatus { kWaiting, kRunning, kFinished };

struct Request {
  int64_t id = 0;
  RequestInput input;
  std::vector<int32_t> output;   // generated tokens
  int64_t max_new_tokens = 0;    // after clamping to max_model_len
  int64_t num_computed = 0;      // tokens whose K/V are in the cache
  // The most tokens ever in the cache (num_computed before any preemption): recordings (logits,
  // taps) skip rows below it, which a recompute computes a second time.
  int64_t max_computed = 0;
  BlockTable blocks;
  RequestStatus status = RequestStatus::kWaiting;
  std::string finish_reason;     // "stop", "length", "abort" or "error" (non-finite logits)
  RequestMetrics metrics;
  Clock::time_point arrival, first_token, finished_at;
  std::vector<float> logits;     // [num recorded rows, V] when recording
  std::vector<float> taps;       // [num rows, taps * H] when recording

  explicit Request(int64_t block_size) : blocks(block_size) {}
  int64_t num_tokens() const {
    return static_cast<int64_t>(input.prompt.size() + output.size());
  }
  // Tokens the prefill puts in the cache before the request decodes: the prompt (the first
  // token is sampled after it); once tokens are generated (a preempted request), all but the
  // last, which is the anchor of the next decode step as it would have been without preemption.
  int64_t prefill_end() const {
    return output.empty() ? static_cast<int64_t>(input.prompt.size()) : num_tokens() - 1;
  }
  bool prefilling() const { return num_computed < prefill_end(); }
  int32_t token_at(int64_t pos) const {
    const int64_t np = static_cast<int64_t>(input.prompt.size());
    return pos < np ? input.prompt[pos] : output[pos - np];
  }
};

}  // namespace dflash
