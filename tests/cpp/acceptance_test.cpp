// Acceptance of drafts (cpp/backend/cpu/host_acceptance.h, host_candidates.h): greedy longest
// prefix + bonus token, and exact speculative sampling checked against exact probabilities: over
// many seeds, the first emitted token follows the target's filtered distribution p whatever the
// proposal (one-hot, K candidates, dense), and drafts are accepted with probability
// sum_x min(p(x), q(x)).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cpu/host_acceptance.h"
#include "backend/cpu/host_candidates.h"

namespace dflash {
namespace {

constexpr int kSeeds = 20000;

// softmax(logits / t) in double, restricted to the top_k largest logits (0: all).
std::vector<double> exact_p(const std::vector<float>& logits, double t, int top_k = 0) {
  const size_t v = logits.size();
  std::vector<int> order(v);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  const size_t keep = top_k > 0 ? static_cast<size_t>(top_k) : v;
  std::vector<double> p(v, 0.0);
  double total = 0.0;
  for (size_t i = 0; i < keep; ++i) total += p[order[i]] = std::exp(logits[order[i]] / t);
  for (double& x : p) x /= total;
  return p;
}

// Every empirical frequency within 5 standard deviations (+ a hair) of its probability.
void expect_distribution(const std::vector<int>& counts, const std::vector<double>& p, int n) {
  ASSERT_EQ(counts.size(), p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    const double f = static_cast<double>(counts[i]) / n;
    const double sd = std::sqrt(p[i] * (1 - p[i]) / n);
    EXPECT_NEAR(f, p[i], 5 * sd + 1e-9) << "token " << i;
  }
}

SampleRow row_at(float temperature, uint64_t seed, int64_t position, int32_t top_k = 0) {
  return SampleRow(temperature, top_k, 1.0f, seed, position);
}

int draw(const std::vector<double>& q, std::mt19937_64& rng) {
  std::discrete_distribution<int> d(q.begin(), q.end());
  return d(rng);
}

TEST(GreedyAcceptance, LongestMatchingPrefixThenTheTargetsToken) {
  // Row argmaxes: 2, 4, 1, 0 (the last row gives the bonus token).
  const std::vector<float> logits = {0, 1, 5, 2, 0, /**/ 0, 1, 2, 3, 9, /**/ 1, 8, 2, 3, 4, /**/ 7, 1, 2, 3, 4};
  const SampleRow greedy = row_at(0.0f, 0, 10);
  const std::vector<int32_t> partial = {2, 4, 3};
  AcceptResult r = accept_drafts(partial.data(), 3, logits.data(), 5, greedy, 10);
  EXPECT_EQ(r.num_accepted, 2);
  EXPECT_EQ(r.next_token, 1);
  const std::vector<int32_t> all = {2, 4, 1};
  r = accept_drafts(all.data(), 3, logits.data(), 5, greedy, 10);
  EXPECT_EQ(r.num_accepted, 3);
  EXPECT_EQ(r.next_token, 0);
  const std::vector<int32_t> none = {0, 4, 1};
  r = accept_drafts(none.data(), 3, logits.data(), 5, greedy, 10);
  EXPECT_EQ(r.num_accepted, 0);
  EXPECT_EQ(r.next_token, 2);
  // The candidate path at T = 0 is the same greedy rule.
  const std::vector<int32_t> ids = {2, 3, 4, 1, 0, 2, 1, 2, 3};
  const std::vector<float> realized(9, 0.0f);
  const AcceptResult c = accept_candidates_request(partial.data(), ids.data(), realized.data(), 3, 3, logits.data(),
                                                   5, greedy);
  EXPECT_EQ(c.num_accepted, 2);
  EXPECT_EQ(c.next_token, 1);
}

TEST(SampledAcceptance, OneHotDraftsKeepTheTargetDistribution) {
  const std::vector<float> logits = {1.0f, 0.2f, -0.5f, 0.7f, /**/ -1.0f, 0.5f, 0.0f, 1.5f};
  const float t = 0.8f;
  const std::vector<double> p0 = exact_p({logits.begin(), logits.begin() + 4}, t);
  const std::vector<double> p1 = exact_p({logits.begin() + 4, logits.end()}, t);
  const int32_t draft = 1;
  std::vector<int> first(4, 0), bonus(4, 0);
  int accepted = 0;
  for (int seed = 0; seed < kSeeds; ++seed) {
    const AcceptResult r = accept_drafts(&draft, 1, logits.data(), 4, row_at(t, seed, 7), 7);
    if (r.num_accepted == 1) {
      ++accepted;
      ++first[draft];
      ++bonus[r.next_token];
    } else {
      EXPECT_NE(r.next_token, draft);  // the correction never repeats a rejected one-hot draft
      ++first[r.next_token];
    }
  }
  expect_distribution(first, p0, kSeeds);
  const double sd = std::sqrt(p0[draft] * (1 - p0[draft]) / kSeeds);
  EXPECT_NEAR(static_cast<double>(accepted) / kSeeds, p0[draft], 5 * sd);
  expect_distribution(bonus, p1, accepted);  // after a full accept: the next row's p
  // Deterministic in (seed, position).
  const AcceptResult a = accept_drafts(&draft, 1, logits.data(), 4, row_at(t, 42, 7), 7);
  const AcceptResult b = accept_drafts(&draft, 1, logits.data(), 4, row_at(t, 42, 7), 7);
  EXPECT_EQ(a.num_accepted, b.num_accepted);
  EXPECT_EQ(a.next_token, b.next_token);
}

TEST(SampledAcceptance, TopKFiltersTheTargetDistribution) {
  const std::vector<float> logits = {1.0f, 0.2f, -0.5f, 0.7f, /**/ 0, 0, 0, 0};
  const std::vector<double> p = exact_p({logits.begin(), logits.begin() + 4}, 1.0, /*top_k=*/2);
  const int32_t draft = 2;  // outside the top 2: p(draft) = 0, never accepted
  std::vector<int> first(4, 0);
  for (int seed = 0; seed < kSeeds; ++seed) {
    const AcceptResult r = accept_drafts(&draft, 1, logits.data(), 4, row_at(1.0f, seed, 3, 2), 3);
    ASSERT_EQ(r.num_accepted, 0);
    ++first[r.next_token];
  }
  EXPECT_EQ(first[1] + first[2], 0);
  expect_distribution(first, p, kSeeds);
}

TEST(SampledAcceptance, CandidateProposalsKeepTheTargetDistribution) {
  // DFlash2: the draft is drawn from q = softmax(realized / T) over K = 3 candidate ids.
  const int64_t vocab = 6, k = 3;
  const std::vector<float> logits = {0.3f, 1.1f, -0.2f, 0.0f, 0.9f, -1.0f, /**/ 0, 0, 0, 0, 0, 0};
  const std::vector<int32_t> ids = {4, 0, 2};
  const std::vector<float> realized = {0.5f, 1.2f, -0.3f};
  const float t = 0.7f;
  const std::vector<double> p = exact_p({logits.begin(), logits.begin() + vocab}, t);
  const std::vector<double> q_rows = exact_p(realized, t);
  std::vector<double> q(vocab, 0.0);
  for (int64_t i = 0; i < k; ++i) q[ids[i]] = q_rows[i];
  double expected_accept = 0.0;
  for (int64_t x = 0; x < vocab; ++x) expected_accept += std::min(p[x], q[x]);
  std::vector<int> first(vocab, 0);
  int accepted = 0;
  std::mt19937_64 rng(123);  // the draft's randomness, independent of the verifier's
  for (int seed = 0; seed < kSeeds; ++seed) {
    const int32_t draft = ids[draw(q_rows, rng)];
    const AcceptResult r = accept_candidates_request(&draft, ids.data(), realized.data(), 1, k, logits.data(), vocab,
                                                     row_at(t, seed, 5));
    accepted += r.num_accepted == 1;
    ++first[r.num_accepted == 1 ? draft : r.next_token];
  }
  expect_distribution(first, p, kSeeds);
  const double sd = std::sqrt(expected_accept * (1 - expected_accept) / kSeeds);
  EXPECT_NEAR(static_cast<double>(accepted) / kSeeds, expected_accept, 5 * sd);
}

TEST(SampledAcceptance, DenseProposalsKeepTheTargetDistribution) {
  // DFlash probabilistic drafts: q over the whole vocabulary (ids == nullptr, k == V).
  const int64_t vocab = 5;
  const std::vector<float> logits = {0.5f, -0.5f, 1.5f, 0.0f, 0.2f, /**/ 0, 0, 0, 0, 0};
  const std::vector<float> drafter = {1.0f, 0.8f, -1.0f, 0.4f, 0.0f};
  const float t = 1.3f;
  const std::vector<double> p = exact_p({logits.begin(), logits.begin() + vocab}, t);
  const std::vector<double> q = exact_p(drafter, t);
  std::vector<int> first(vocab, 0);
  std::mt19937_64 rng(7);
  for (int seed = 0; seed < kSeeds; ++seed) {
    const int32_t draft = draw(q, rng);
    const AcceptResult r = accept_candidates_request(&draft, nullptr, drafter.data(), 1, vocab, logits.data(), vocab,
                                                     row_at(t, seed, 9));
    ++first[r.num_accepted == 1 ? draft : r.next_token];
  }
  expect_distribution(first, p, kSeeds);
}

TEST(DraftSampling, ProbabilisticDraftsFollowTheDrafterAndGreedyIsTheArgmax) {
  const std::vector<float> logits = {0.1f, 1.0f, -0.4f, 0.6f};
  EXPECT_EQ(sample_draft_token(logits.data(), 4, row_at(0.0f, 0, 0), 0), 1);
  const float t = 0.9f;
  const std::vector<double> q = exact_p(logits, t);
  std::vector<int> counts(4, 0);
  for (int seed = 0; seed < kSeeds; ++seed) ++counts[sample_draft_token(logits.data(), 4, row_at(t, seed, 0), 11)];
  expect_distribution(counts, q, kSeeds);
}

}  // namespace
}  // namespace dflash
