// SamplingParams: how one request is generated (length, temperature, filters, seed, stops).
// The runtime validates them when the request is added (dflash::InvalidArgument on a bad value).
#pragma once

#include <cstdint>
#include <vector>

namespace dflash {

struct SamplingParams {
  // New tokens at most (>= 1); a request also stops at max_model_len tokens in all.
  int64_t max_tokens = 256;
  // 0: greedy (argmax); > 0: sampling from softmax(logits / temperature). Finite, >= 0.
  float temperature = 0.0f;
  // Nucleus sampling: the smallest set of most likely tokens whose probability reaches top_p,
  // in (0, 1]; 1 keeps every token.
  float top_p = 1.0f;
  // Only the top_k most likely tokens (>= 0; 0 keeps every token).
  int32_t top_k = 0;
  // The random stream of the request: the same seed gives the same tokens whether the request
  // runs alone or in a batch, and across preemption (with fixed speculation).
  uint64_t seed = 0;
  // Token ids that end the request (emitted as its last token), in addition to the model's EOS.
  std::vector<int32_t> stop_token_ids;
  // Ignore the model's EOS ids (run to max_tokens; benchmarks). stop_token_ids still stop it.
  bool ignore_eos = false;
};

}  // namespace dflash
