// DFlash2 candidate drafting on the host (see host_candidates.h).
#include "backend/cpu/host_candidates.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend/cpu/host_sampling.h"
#include "common/philox.h"

namespace dflash {

namespace {

// The index of the largest entry of row[K] (NaN as -inf; lowest index on ties; 0 if all -inf).
int64_t argmax_finite(const float* row, int64_t k) {
  int64_t best = 0;
  float best_v = -INFINITY;
  for (int64_t i = 0; i < k; ++i) {
    const float x = std::isnan(row[i]) ? -INFINITY : row[i];
    if (x > best_v) best = i, best_v = x;
  }
  return best;
}

// q = softmax(row[K] / T) (NaN as -inf; all -inf: one-hot at index 0, what the walk draws).
std::vector<double> proposal(const float* row, int64_t k, float temperature) {
  std::vector<double> q(k, 0.0);
  double m = -INFINITY;
  for (int64_t i = 0; i < k; ++i) {
    if (!std::isnan(row[i])) m = std::max(m, static_cast<double>(row[i]) / temperature);
  }
  if (!std::isfinite(m)) {
    q[argmax_finite(row, k)] = 1.0;
    return q;
  }
  double total = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    total += q[i] = std::isnan(row[i]) ? 0.0 : std::exp(static_cast<double>(row[i]) / temperature - m);
  }
  for (double& x : q) x /= total;
  return q;
}

}  // namespace

void topk_row(const float* logits, int64_t vocab, int64_t k, float multiplier, float softcap, int32_t* ids,
              float* unary) {
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int32_t a, int32_t b) { return logit_ranks_before(logits, a, b); });
  for (int64_t i = 0; i < k; ++i) {
    ids[i] = order[i];
    float v = logits[order[i]];
    if (std::isnan(v)) {
      v = -INFINITY;
    } else {
      v *= multiplier;
      if (softcap > 0.0f) v = softcap * std::tanh(v / softcap);
    }
    unary[i] = v;
  }
}

void walk_request(const float* edges, const int32_t* ids, int64_t slots, int64_t k, const SampleRow& row,
                  bool greedy_walk, int32_t* drafts, float* realized) {
  int64_t prev = 0;
  for (int64_t s = 0; s < slots; ++s) {
    const float* scores = edges + (s * k + prev) * k;
    const int32_t* cand = ids + s * k;
    int64_t idx;
    if (greedy_walk || row.temperature <= 0.0f) {
      idx = argmax_finite(scores, k);
    } else {
      idx = -1;
      double best = -INFINITY;
      const uint64_t position = static_cast<uint64_t>(row.position + s);
      for (int64_t i = 0; i < k; ++i) {
        if (std::isnan(scores[i]) || scores[i] == -INFINITY) continue;
        const float u = philox_uniform(row.seed(), position, static_cast<uint32_t>(cand[i]), kStreamDraftSample);
        const double g = static_cast<double>(scores[i]) / row.temperature - std::log(-std::log(static_cast<double>(u)));
        if (idx < 0 || g > best) idx = i, best = g;
      }
      if (idx < 0) idx = argmax_finite(scores, k);  // every score -inf / NaN
    }
    if (greedy_walk) {
      std::fill(realized + s * k, realized + (s + 1) * k, -INFINITY);
      realized[s * k + idx] = 0.0f;
    } else {
      std::copy(scores, scores + k, realized + s * k);
    }
    drafts[s] = cand[idx];
    prev = idx;
  }
}

AcceptResult accept_candidates_request(const int32_t* drafts, const int32_t* ids, const float* realized,
                                       int64_t n, int64_t k, const float* logits, int64_t vocab,
                                       const SampleRow& row) {
  if (row.temperature <= 0.0f) return accept_drafts(drafts, n, logits, vocab, row, row.position);
  AcceptResult r;
  std::vector<int32_t> p_ids;
  std::vector<double> p_probs;
  for (int64_t j = 0; j <= n; ++j) {
    const int64_t position = row.position + j;
    filtered_distribution(logits + j * vocab, vocab, row, &p_ids, &p_probs);
    if (j == n) {
      r.num_accepted = n;
      r.next_token = draw_token(p_ids, p_probs, -1, row.seed(), position);
      return r;
    }
    const std::vector<double> q = proposal(realized + j * k, k, row.temperature);
    auto q_of = [&](int32_t token) {
      if (ids == nullptr) return token >= 0 && token < k ? q[token] : 0.0;
      for (int64_t i = 0; i < k; ++i) {
        if (ids[j * k + i] == token) return q[i];
      }
      return 0.0;
    };
    double p_x = 0.0;
    for (size_t i = 0; i < p_ids.size(); ++i) {
      if (p_ids[i] == drafts[j]) p_x = p_probs[i];
    }
    const double q_x = q_of(drafts[j]);
    const float u = philox_uniform(row.seed(), static_cast<uint64_t>(position), 0, kStreamAccept);
    if (q_x > 0.0 && static_cast<double>(u) * q_x < p_x) continue;  // accepted with probability min(1, p/q)
    // Rejected: the correction comes from norm(max(p - q, 0)).
    std::vector<double> residual(p_ids.size());
    double total = 0.0;
    for (size_t i = 0; i < p_ids.size(); ++i) total += residual[i] = std::max(p_probs[i] - q_of(p_ids[i]), 0.0);
    r.num_accepted = j;
    if (total > 0.0) {
      r.next_token = draw_token(p_ids, residual, -1, row.seed(), position);
    } else {  // p == q on every token (rejection had probability 0; rounding): draw from p
      r.next_token = draw_token(p_ids, p_probs, -1, row.seed(), position);
    }
    return r;
  }
  return r;
}

int32_t sample_draft_token(const float* logits, int64_t vocab, const SampleRow& row, int64_t position) {
  if (row.temperature <= 0.0f) return static_cast<int32_t>(argmax_finite(logits, vocab));
  int64_t best = -1;
  double best_score = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isnan(logits[i]) || logits[i] == -INFINITY) continue;
    const float u = philox_uniform(row.seed(), static_cast<uint64_t>(position), static_cast<uint32_t>(i),
                                   kStreamDraftSample);
    const double g = static_cast<double>(logits[i]) / row.temperature - std::log(-std::log(static_cast<double>(u)));
    if (best < 0 || g > best_score) best = i, best_score = g;
  }
  return static_cast<int32_t>(best < 0 ? argmax_finite(logits, vocab) : best);
}

}  // namespace dflash
