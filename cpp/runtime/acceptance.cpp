// Greedy and exact-sampling acceptance of draft tokens (see acceptance.h).
#include "runtime/acceptance.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/cpu/cpu_backend.h"
#include "common/philox.h"

namespace dflash {

void filtered_distribution(const float* logits, int64_t vocab, const SampleRow& row,
                           std::vector<int32_t>* ids, std::vector<double>* probs) {
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  int64_t n = vocab;
  if (row.top_k > 0 && row.top_k < vocab) {
    n = row.top_k;
    std::partial_sort(order.begin(), order.begin() + n, order.end(), by_logit);
  } else {
    std::sort(order.begin(), order.end(), by_logit);
  }
  const double inv_t = 1.0 / row.temperature;
  const double max_z = logits[order[0]] * inv_t;
  std::vector<double> p(n);
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    p[i] = std::exp(logits[order[i]] * inv_t - max_z);
    total += p[i];
  }
  int64_t keep = n;
  if (row.top_p < 1.0f) {
    double cum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      cum += p[i] / total;
      if (cum >= row.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept_total = 0.0;
  for (int64_t i = 0; i < keep; ++i) kept_total += p[i];
  ids->assign(order.begin(), order.begin() + keep);
  probs->resize(keep);
  for (int64_t i = 0; i < keep; ++i) (*probs)[i] = p[i] / kept_total;
}

namespace {

// Gumbel-max draw over the kept tokens except `excluded` (-1 for none): exact sampling from
// the distribution restricted to them and renormalised.
int32_t draw(const std::vector<int32_t>& ids, const std::vector<double>& probs, int32_t excluded,
             uint64_t seed, int64_t position) {
  int32_t best = -1;
  double best_score = -INFINITY;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] == excluded || probs[i] <= 0.0) continue;
    const float u = philox_uniform(seed, static_cast<uint64_t>(position), static_cast<uint32_t>(ids[i]),
                                   kStreamTargetSample);
    const double score = std::log(probs[i]) - std::log(-std::log(static_cast<double>(u)));
    if (best < 0 || score > best_score) best = ids[i], best_score = score;
  }
  return best;
}

}  // namespace

AcceptResult accept_drafts(const int32_t* drafts, int64_t n, const float* logits, int64_t vocab,
                           const SampleRow& row, int64_t first_position) {
  AcceptResult r;
  if (row.temperature <= 0.0f) {
    for (int64_t j = 0; j <= n; ++j) {
      const float* l = logits + j * vocab;
      const int32_t best = static_cast<int32_t>(std::max_element(l, l + vocab) - l);
      if (j == n || drafts[j] != best) {
        r.num_accepted = j;
        r.next_token = best;
        return r;
      }
    }
  }
  std::vector<int32_t> ids;
  std::vector<double> probs;
  for (int64_t j = 0; j <= n; ++j) {
    const int64_t position = first_position + j;
    filtered_distribution(logits + j * vocab, vocab, row, &ids, &probs);
    if (j == n) {
      r.num_accepted = n;
      r.next_token = draw(ids, probs, -1, row.seed, position);
      return r;
    }
    double p_draft = 0.0;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] == drafts[j]) p_draft = probs[i];
    }
    const float u = philox_uniform(row.seed, static_cast<uint64_t>(position), 0, kStreamAccept);
    if (static_cast<double>(u) < p_draft) continue;  // accepted with probability p(d)
    r.num_accepted = j;
    r.next_token = draw(ids, probs, drafts[j], row.seed, position);
    return r;
  }
  return r;
}

}  // namespace dflash
