// CPU sampling: greedy argmax, or temperature + top-k + top-p followed by Gumbel-max with the
// counter-based Philox stream keyed by (seed, position, token index). Gumbel-max over the kept
// tokens samples exactly from their renormalised softmax.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "common/philox.h"

namespace dflash {

int32_t sample_row_host(const float* logits, int64_t vocab, const SampleRow& row) {
  if (row.temperature <= 0.0f) {
    return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  }
  const float inv_t = 1.0f / row.temperature;
  std::vector<int32_t> kept;
  const bool use_top_k = row.top_k > 0 && row.top_k < vocab;
  const bool use_top_p = row.top_p < 1.0f;
  if (use_top_k || use_top_p) {
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    auto by_logit = [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };
    int64_t n = vocab;
    if (use_top_k) {
      n = row.top_k;
      std::partial_sort(order.begin(), order.begin() + n, order.end(), by_logit);
    } else {
      std::sort(order.begin(), order.end(), by_logit);
    }
    if (use_top_p) {
      const float max_z = logits[order[0]] * inv_t;
      double total = 0.0;
      std::vector<double> p(n);
      for (int64_t i = 0; i < n; ++i) {
        p[i] = std::exp(static_cast<double>(logits[order[i]] * inv_t - max_z));
        total += p[i];
      }
      double cum = 0.0;
      int64_t keep = n;
      for (int64_t i = 0; i < n; ++i) {
        cum += p[i] / total;
        if (cum >= row.top_p) {
          keep = i + 1;
          break;
        }
      }
      n = keep;
    }
    kept.assign(order.begin(), order.begin() + n);
  }
  auto gumbel_score = [&](int32_t i) {
    const float u = philox_uniform(row.seed, static_cast<uint64_t>(row.position),
                                   static_cast<uint32_t>(i), kStreamTargetSample);
    return logits[i] * inv_t - std::log(-std::log(u));
  };
  int32_t best = -1;
  float best_score = -INFINITY;
  if (kept.empty()) {
    for (int32_t i = 0; i < vocab; ++i) {
      const float sc = gumbel_score(i);
      if (best < 0 || sc > best_score) best = i, best_score = sc;
    }
  } else {
    for (int32_t i : kept) {
      const float sc = gumbel_score(i);
      if (best < 0 || sc > best_score || (sc == best_score && i < best)) best = i, best_score = sc;
    }
  }
  return best;
}

void CpuBackend::sample(const Tensor& logits, const std::vector<SampleRow>& rows,
                        int32_t* tokens_out) {
  const int64_t vocab = logits.dim(1);
  const int64_t n = static_cast<int64_t>(rows.size());
  parallel(n, vocab * 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      tokens_out[r] = sample_row_host(logits.ptr<float>() + r * vocab, vocab, rows[r]);
    }
  });
}

}  // namespace dflash
