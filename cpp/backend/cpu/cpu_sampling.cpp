// Host sampling (see host_sampling.h) and the CPU backend's batched sample op.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/host_sampling.h"
#include "common/philox.h"

namespace dflash {

void filtered_distribution(const float* logits, int64_t vocab, const SampleRow& row,
                           std::vector<int32_t>* ids, std::vector<double>* probs) {
  const double inv_t = 1.0 / row.temperature;
  const bool use_top_k = row.top_k > 0 && row.top_k < vocab;
  const bool use_top_p = row.top_p < 1.0f;
  ids->resize(vocab);
  std::iota(ids->begin(), ids->end(), 0);
  int64_t n = vocab;
  if (use_top_k || use_top_p) {
    auto by_logit = [&](int32_t a, int32_t b) { return logit_ranks_before(logits, a, b); };
    if (use_top_k) {
      n = row.top_k;
      std::partial_sort(ids->begin(), ids->begin() + n, ids->end(), by_logit);
    } else {
      std::sort(ids->begin(), ids->end(), by_logit);
    }
  }
  double max_z = -INFINITY;
  for (int64_t i = 0; i < n; ++i) max_z = std::max(max_z, logits[(*ids)[i]] * inv_t);
  probs->resize(n);
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += ((*probs)[i] = std::exp(logits[(*ids)[i]] * inv_t - max_z));
  if (use_top_p) {  // ids are sorted by probability here
    double cum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      cum += (*probs)[i] / total;
      if (cum >= row.top_p) {
        n = i + 1;
        break;
      }
    }
    total = 0.0;
    for (int64_t i = 0; i < n; ++i) total += (*probs)[i];
  }
  ids->resize(n);
  probs->resize(n);
  for (double& p : *probs) p /= total;
}

int32_t draw_token(const std::vector<int32_t>& ids, const std::vector<double>& probs, int32_t excluded,
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

int32_t sample_row_host(const float* logits, int64_t vocab, const SampleRow& row) {
  if (row.temperature <= 0.0f) {
    return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  }
  std::vector<int32_t> ids;
  std::vector<double> probs;
  filtered_distribution(logits, vocab, row, &ids, &probs);
  return draw_token(ids, probs, -1, row.seed(), row.position);
}

void CpuBackend::sample(const Tensor& logits, const std::vector<SampleRow>& rows, int32_t* tokens_out) {
  const int64_t vocab = logits.dim(1);
  const int64_t n = static_cast<int64_t>(rows.size());
  parallel(n, vocab * 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      tokens_out[r] = sample_row_host(logits.ptr<float>() + r * vocab, vocab, rows[r]);
    }
  });
}

}  // namespace dflash
