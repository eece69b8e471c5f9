// Greedy and exact-sampling acceptance of draft tokens on the host (see host_acceptance.h).
#include "backend/cpu/host_acceptance.h"

#include <algorithm>
#include <cmath>

#include "backend/cpu/host_sampling.h"
#include "common/philox.h"

namespace dflash {

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
      r.next_token = draw_token(ids, probs, -1, row.seed(), position);
      return r;
    }
    double p_draft = 0.0;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] == drafts[j]) p_draft = probs[i];
    }
    const float u = philox_uniform(row.seed(), static_cast<uint64_t>(position), 0, kStreamAccept);
    if (static_cast<double>(u) < p_draft) continue;  // accepted with probability p(d)
    r.num_accepted = j;
    r.next_token = draw_token(ids, probs, drafts[j], row.seed(), position);
    return r;
  }
  return r;
}

}  // namespace dflash
