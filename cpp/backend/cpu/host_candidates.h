// DFlash2's candidate drafting on the host, one request or row at a time: per-row top-K, the
// lattice walk (greedy and Gumbel-sampled) and exact acceptance with the walk's K-candidate
// proposal. The CPU backend's ops are these functions over a batch; GPU kernels are tested
// against them.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "backend/cpu/host_acceptance.h"

namespace dflash {

// The K largest values of logits[V] (sorted descending, lowest id first on ties, NaN below
// every number) into ids[K], with unary[K] = v * multiplier, then softcap * tanh(. / softcap)
// when softcap > 0.
void topk_row(const float* logits, int64_t vocab, int64_t k, float multiplier, float softcap, int32_t* ids,
              float* unary);

// The walk over one request's lattice: edges[S, K, K], ids[S, K]; drafts[S], realized[S, K].
// `row` gives the temperature, the seed and the first draft's position. greedy_walk: the argmax
// walk at every temperature, realized one-hot (0 at the walked candidate, -inf elsewhere).
void walk_request(const float* edges, const int32_t* ids, int64_t slots, int64_t k, const SampleRow& row,
                  bool greedy_walk, int32_t* drafts, float* realized);

// Acceptance of drafts[n] drawn from q_j = softmax(realized[j, :] / T) over ids[j, :] against the
// target logits[n + 1, V] (temperature, top-k, top-p of `row` applied to p; position = the first
// draft's). ids == nullptr: dense proposals, k == V and column i is token i (DFlash's
// probabilistic drafts). T = 0: greedy acceptance, as accept_drafts.
AcceptResult accept_candidates_request(const int32_t* drafts, const int32_t* ids, const float* realized,
                                       int64_t n, int64_t k, const float* logits, int64_t vocab,
                                       const SampleRow& row);

// A probabilistic DFlash draft token from the drafter's logits[V]: at T > 0 a Gumbel-max draw
// from softmax(logits / T), the noise keyed by (seed, position, token id) on the draft stream; at
// T = 0 the argmax (lowest id on ties).
int32_t sample_draft_token(const float* logits, int64_t vocab, const SampleRow& row, int64_t position);

}  // namespace dflash
