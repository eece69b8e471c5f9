// DFlash2's candidate lattice on the CPU backend (cpp/backend/cpu/cpu_dflash2.cpp): top-K
// candidates, edge scores from the codebooks, the lattice walk (greedy, greedy_walk one-hot rows,
// and the Gumbel-sampled walk, whose picks follow softmax(row / T) exactly) and batched
// acceptance with the walk's rows, checked against values computed here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_backend.h"

namespace dflash {
namespace {

class DFlash2Walk : public ::testing::Test {
 protected:
  Tensor f32(const std::vector<int64_t>& shape, const std::vector<float>& v) {
    Tensor t = backend.empty(shape, DType::kF32);
    EXPECT_EQ(static_cast<size_t>(t.numel()), v.size());
    std::memcpy(t.data, v.data(), v.size() * sizeof(float));
    return t;
  }
  Tensor i32(const std::vector<int64_t>& shape, const std::vector<int32_t>& v) {
    Tensor t = backend.empty(shape, DType::kI32);
    EXPECT_EQ(static_cast<size_t>(t.numel()), v.size());
    std::memcpy(t.data, v.data(), v.size() * sizeof(int32_t));
    return t;
  }
  // One packed SampleRow per request.
  Tensor params(const std::vector<SampleRow>& rows) {
    Tensor t = backend.empty({static_cast<int64_t>(rows.size() * sizeof(SampleRow))}, DType::kU8);
    for (size_t i = 0; i < rows.size(); ++i) t.ptr<SampleRow>()[i] = rows[i];
    return t;
  }
  static SampleRow row(float temperature, uint64_t seed, int64_t position) {
    return SampleRow(temperature, 0, 1.0f, seed, position);
  }

  CpuBackend backend{1};
};

TEST_F(DFlash2Walk, TopKSortsDescendingWithTiesByIdAndNaNLast) {
  const float nan = std::nanf("");
  Tensor logits = f32({2, 5}, {0.5f, 2.0f, nan, 2.0f, -1.0f, /**/ nan, nan, 3.0f, nan, nan});
  Tensor ids = backend.empty({2, 3}, DType::kI32), unary = backend.empty({2, 3}, DType::kF32);
  backend.topk_candidates(logits, 3, /*multiplier=*/2.0f, /*softcap=*/0.0f, ids, unary);
  const int32_t* id = ids.ptr<int32_t>();
  const float* u = unary.ptr<float>();
  EXPECT_EQ(std::vector<int32_t>(id, id + 3), (std::vector<int32_t>{1, 3, 0}));
  EXPECT_EQ(std::vector<float>(u, u + 3), (std::vector<float>{4.0f, 4.0f, 1.0f}));
  // A row with one number fills up with its NaN ids, lowest first, valued -inf.
  EXPECT_EQ(std::vector<int32_t>(id + 3, id + 6), (std::vector<int32_t>{2, 0, 1}));
  EXPECT_EQ(u[3], 6.0f);
  EXPECT_TRUE(std::isinf(u[4]) && u[4] < 0);
  // The softcap: softcap * tanh(v * multiplier / softcap).
  Tensor top1 = backend.empty({2, 1}, DType::kI32), capped = backend.empty({2, 1}, DType::kF32);
  backend.topk_candidates(logits, 1, 2.0f, 3.0f, top1, capped);
  EXPECT_EQ(top1.ptr<int32_t>()[0], 1);
  EXPECT_FLOAT_EQ(capped.ptr<float>()[0], 3.0f * std::tanh(4.0f / 3.0f));
}

TEST_F(DFlash2Walk, EdgeScoresAddTheGatedCodebookProduct) {
  // One request, 2 slots, K = 2 candidates, rank 2, vocabulary 4.
  const std::vector<float> a = {1, 0, 0, 1, 1, 1, 2, -1}, b = {0.5f, 0, 0, 2, 1, -1, 3, 0};  // [V, r]
  Tensor ids = i32({1, 2, 2}, {3, 1, 0, 2});
  Tensor unary = f32({1, 2, 2}, {0.1f, 0.2f, 0.3f, 0.4f});
  Tensor gate = f32({1, 2, 2}, {1.0f, 2.0f, -1.0f, 0.5f});
  Tensor anchors = i32({1}, {2});
  Tensor edges = backend.empty({1, 2, 2, 2}, DType::kF32);
  backend.edge_scores(ids, unary, gate, anchors, f32({4, 2}, a), f32({4, 2}, b), edges);
  const int32_t cand[2][2] = {{3, 1}, {0, 2}};
  const float un[2][2] = {{0.1f, 0.2f}, {0.3f, 0.4f}}, g[2][2] = {{1.0f, 2.0f}, {-1.0f, 0.5f}};
  for (int s = 0; s < 2; ++s) {
    for (int p = 0; p < 2; ++p) {
      const int pred = s == 0 ? 2 : cand[0][p];
      for (int c = 0; c < 2; ++c) {
        float want = un[s][c];
        for (int j = 0; j < 2; ++j) want += a[pred * 2 + j] * g[s][j] * b[cand[s][c] * 2 + j];
        EXPECT_FLOAT_EQ(edges.ptr<float>()[(s * 2 + p) * 2 + c], want) << s << " " << p << " " << c;
      }
    }
  }
}

TEST_F(DFlash2Walk, GreedyWalkFollowsTheArgmaxFromThePreviousPick) {
  // 3 slots, K = 3: edges[s, prev, :]; the walk starts from prev = 0.
  const std::vector<float> e = {
      0.1f, 0.9f, 0.3f, /**/ 0, 0, 0, /**/ 0, 0, 0,           // slot 0: from prev 0 -> idx 1
      5.0f, 0.0f, 0.0f, /**/ 0.2f, 0.1f, 0.8f, /**/ 0, 0, 0,  // slot 1: from prev 1 -> idx 2
      0, 0, 0, /**/ 0, 0, 0, /**/ 0.4f, 0.4f, 0.1f,           // slot 2: from prev 2 -> idx 0 (tie: lowest)
  };
  Tensor edges = f32({1, 3, 3, 3}, e);
  Tensor ids = i32({1, 3, 3}, {10, 11, 12, 20, 21, 22, 30, 31, 32});
  Tensor drafts = backend.empty({1, 3}, DType::kI32), realized = backend.empty({1, 3, 3}, DType::kF32);
  backend.lattice_walk(edges, ids, params({row(0.0f, 0, 0)}), /*greedy_walk=*/false, drafts, realized);
  EXPECT_EQ(std::vector<int32_t>(drafts.ptr<int32_t>(), drafts.ptr<int32_t>() + 3), (std::vector<int32_t>{11, 22, 30}));
  const float* r = realized.ptr<float>();
  EXPECT_EQ(std::vector<float>(r, r + 3), (std::vector<float>{0.1f, 0.9f, 0.3f}));
  EXPECT_EQ(std::vector<float>(r + 3, r + 6), (std::vector<float>{0.2f, 0.1f, 0.8f}));
  EXPECT_EQ(std::vector<float>(r + 6, r + 9), (std::vector<float>{0.4f, 0.4f, 0.1f}));
  // greedy_walk: the same picks at any temperature, with one-hot realized rows.
  backend.lattice_walk(edges, ids, params({row(1.0f, 5, 0)}), /*greedy_walk=*/true, drafts, realized);
  EXPECT_EQ(std::vector<int32_t>(drafts.ptr<int32_t>(), drafts.ptr<int32_t>() + 3), (std::vector<int32_t>{11, 22, 30}));
  const int picked[3] = {1, 2, 0};
  for (int s = 0; s < 3; ++s) {
    for (int c = 0; c < 3; ++c) {
      const float v = realized.ptr<float>()[s * 3 + c];
      if (c == picked[s]) {
        EXPECT_EQ(v, 0.0f);
      } else {
        EXPECT_TRUE(std::isinf(v) && v < 0);
      }
    }
  }
}

TEST_F(DFlash2Walk, SampledWalkPicksFollowTheSoftmaxOfTheRow) {
  const std::vector<float> first_row = {0.5f, 1.5f, -0.5f};
  std::vector<float> e(1 * 1 * 3 * 3, 0.0f);
  std::copy(first_row.begin(), first_row.end(), e.begin());
  Tensor edges = f32({1, 1, 3, 3}, e);
  Tensor ids = i32({1, 1, 3}, {7, 8, 9});
  Tensor drafts = backend.empty({1, 1}, DType::kI32), realized = backend.empty({1, 1, 3}, DType::kF32);
  const float t = 0.8f;
  double z = 0.0;
  std::vector<double> q(3);
  for (int i = 0; i < 3; ++i) z += q[i] = std::exp(first_row[i] / t);
  const int n = 20000;
  std::vector<int> counts(3, 0);
  for (int seed = 0; seed < n; ++seed) {
    backend.lattice_walk(edges, ids, params({row(t, seed, 4)}), false, drafts, realized);
    const int32_t d = drafts.ptr<int32_t>()[0];
    ASSERT_GE(d, 7);
    ASSERT_LE(d, 9);
    ++counts[d - 7];
  }
  for (int i = 0; i < 3; ++i) {
    const double p = q[i] / z, f = static_cast<double>(counts[i]) / n;
    EXPECT_NEAR(f, p, 5 * std::sqrt(p * (1 - p) / n)) << "candidate " << i;
  }
}

TEST_F(DFlash2Walk, BatchedAcceptanceUsesEachRequestsWalkedRows) {
  // Two requests, 2 drafts each, K = 2, vocabulary 3, greedy: the longest prefix matching the
  // target's argmax, then its token.
  Tensor drafts = i32({2, 2}, {1, 2, 0, 1});
  Tensor ids = i32({2, 2, 2}, {1, 0, 2, 1, 0, 2, 1, 2});
  Tensor realized = f32({2, 2, 2}, {0, -1, 0, -1, 0, -1, 0, -1});
  Tensor logits = f32({2, 3, 3}, {0, 5, 1, /**/ 0, 1, 5, /**/ 9, 0, 0,     // request 0: both accepted, bonus 0
                                  0, 1, 5, /**/ 0, 0, 0, /**/ 0, 0, 0});   // request 1: draft 0 rejected, token 2
  Tensor accepted = backend.empty({2}, DType::kI32), next = backend.empty({2}, DType::kI32);
  backend.accept_candidates(drafts, ids, realized, logits, params({row(0.0f, 0, 3), row(0.0f, 0, 8)}), accepted, next);
  EXPECT_EQ(accepted.ptr<int32_t>()[0], 2);
  EXPECT_EQ(next.ptr<int32_t>()[0], 0);
  EXPECT_EQ(accepted.ptr<int32_t>()[1], 0);
  EXPECT_EQ(next.ptr<int32_t>()[1], 2);
}

}  // namespace
}  // namespace dflash
