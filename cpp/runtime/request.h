// A generation request as the runtime sees it: token ids in, token ids out, its sampling
// parameters, its KV blocks, its metrics, and test/debug hooks (forced tokens, recorded logits
// and hidden-state taps). Its prefill (the prompt, or after a preemption the prompt and all but
// the last generated token) may run in chunks over several steps, and starts after the blocks
// found in the prefix cache (num_computed = the cached tokens on admission).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "kv_cache/block_allocator.h"

namespace dflash {

using Clock = std::chrono::steady_clock;

struct SamplingConfig {
  int64_t max_tokens = 256;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;
  std::vector<int32_t> stop_token_ids;  // in addition to the model's EOS ids
  bool ignore_eos = false;              // benchmarks: run to max_tokens
};

struct RequestInput {
  std::vector<int32_t> prompt;
  SamplingConfig sampling;
  // Debug/test hooks (not part of the public Python API):
  std::vector<int32_t> forced_tokens;  // emit these instead of sampling (teacher forcing)
  bool record_logits = false;          // keep the logits of every sampled position
  bool record_prompt_logits = false;   // ...and of every prompt position
  bool record_taps = false;            // keep the hidden-state taps of every row
  // Speculative decoding test hook: the drafts proposed at each step are taken from this
  // sequence (the expected continuation: token k is the k-th generated token) instead of the
  // drafter, so tests can drive full-block acceptance.
  std::vector<int32_t> oracle_drafts;
};

struct RequestMetrics {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t num_steps = 0;
  double time_to_first_token_s = 0.0;  // from add_request to the first token
  double decode_tokens_per_s = 0.0;    // tokens after the first / time after the first
  double total_time_s = 0.0;
  // Speculative decoding (zero without a drafter):
  int64_t num_spec_steps = 0;        // draft-verify steps
  int64_t num_drafted = 0;           // draft tokens proposed
  int64_t num_accepted = 0;          // draft tokens accepted
  int64_t num_spec_emitted = 0;      // tokens emitted by draft-verify steps (bonus included)
  std::vector<int64_t> accepted_per_position;  // [n] how often draft j was accepted
  int64_t num_preemptions = 0;       // times its KV blocks were taken back (recomputed later)
  int64_t num_cached_tokens = 0;     // prefill tokens found in the prefix cache (summed over admissions)
  // Mean tokens emitted per draft-verify step, bonus included (tau).
  double acceptance_length() const {
    return num_spec_steps ? static_cast<double>(num_spec_emitted) / num_spec_steps : 0.0;
  }
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
  std::string finish_reason;     // "stop", "length" or "abort"
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

// What one step produced for one request.
struct StepOutput {
  int64_t request_id = 0;
  std::vector<int32_t> new_tokens;
  bool finished = false;
  std::string finish_reason;
};

}  // namespace dflash
