// Host-side sampling primitives shared by the CPU backend's sampler and the acceptance of
// draft tokens: the distribution left by temperature / top-k / top-p, and exact draws from it
// (Gumbel-max on the counter-based Philox stream keyed by (seed, position, token id)).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace dflash {

// The order of logits v[] that sampling and top-K sort by: larger first, lower id first on ties,
// NaN after every number (a strict weak order even on rows holding NaN, which std::sort needs;
// the engine never emits a token sampled from such a row).
inline bool logit_ranks_before(const float* v, int32_t a, int32_t b) {
  const bool na = std::isnan(v[a]), nb = std::isnan(v[b]);
  if (na != nb) return nb;
  if (!na && v[a] != v[b]) return v[a] > v[b];
  return a < b;
}

// The tokens kept by top-k / top-p at row.temperature (> 0) and their probabilities, which sum
// to 1. Without filters every token is kept, in id order.
void filtered_distribution(const float* logits, int64_t vocab, const SampleRow& row,
                           std::vector<int32_t>* ids, std::vector<double>* probs);

// An exact draw from (ids, probs) restricted to tokens other than `excluded` (-1: none) and
// renormalised, with the randomness of (seed, position).
int32_t draw_token(const std::vector<int32_t>& ids, const std::vector<double>& probs, int32_t excluded,
                   uint64_t seed, int64_t position);

// One row of sampling: argmax when temperature <= 0, else a draw from the filtered distribution.
int32_t sample_row_host(const float* logits, int64_t vocab, const SampleRow& row);

}  // namespace dflash
