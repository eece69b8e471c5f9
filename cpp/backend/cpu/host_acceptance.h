// Acceptance of a block of draft tokens against the target's verify logits, on the host.
// Greedy: the longest prefix where draft == target argmax, plus the target's token after it.
// Sampling (temperature > 0): exact speculative sampling for a one-hot (greedy) proposal,
// with temperature, top-k and top-p applied to the target distribution: draft d is accepted
// with probability p(d); on rejection the token is drawn from p with d removed
// (renormalised); after a full accept the bonus is drawn from p. The randomness is keyed by
// (seed, position): acceptance uniforms on one stream, token draws on another.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace dflash {

struct AcceptResult {
  int64_t num_accepted = 0;  // a: accepted drafts (0..n)
  int32_t next_token = 0;    // the bonus / correction token at position q0 + 1 + a
};

// drafts: [n]; logits: [n + 1, vocab] host fp32 (row j = the target's distribution for the
// token at position first_position + j, where drafts[j] sits); row: sampling parameters.
AcceptResult accept_drafts(const int32_t* drafts, int64_t n, const float* logits, int64_t vocab,
                           const SampleRow& row, int64_t first_position);

}  // namespace dflash
