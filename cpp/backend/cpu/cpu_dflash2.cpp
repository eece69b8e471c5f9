// The CPU backend's DFlash2 ops (see backend.h): the grouped dynamic conv, per-row top-K, the
// edge scores, the lattice walk and acceptance with the walk's proposal, fp32.
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/host_candidates.h"

namespace dflash {

namespace {

SampleRow unpack_params(const Tensor& params, int64_t r) {
  DFLASH_CHECK(static_cast<int64_t>(params.nbytes()) >= (r + 1) * static_cast<int64_t>(sizeof(SampleRow)),
               "sampling params tensor too small for row ", r);
  return static_cast<const SampleRow*>(params.data)[r];
}

}  // namespace

void CpuBackend::scale(Tensor& x, float factor) {
  float* p = x.ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) p[i] *= factor;
}

void CpuBackend::grouped_conv(const Tensor& x, const Tensor& base, const Tensor& deltas, int64_t side,
                              int64_t block, int64_t group, bool accumulate, Tensor& out) {
  const int64_t n = x.dim(0), h = x.dim(1), taps = base.dim(1), groups = h / group;
  DFLASH_CHECK(base.dim(0) == 2 && base.dim(2) == h && h % group == 0 && deltas.dim(0) == n &&
                   deltas.dim(1) == 2 * taps * groups && out.numel() == n * h && (side == 0 || side == 1) &&
                   block >= 1 && n % block == 0,
               "grouped_conv: x ", shape_str(x.shape), " base ", shape_str(base.shape), " deltas ",
               shape_str(deltas.shape), " group ", group, " block ", block, " side ", side);
  const float* xp = x.ptr<float>();
  const float* bp = base.ptr<float>() + side * taps * h;
  const float* dp = deltas.ptr<float>();
  float* op = out.ptr<float>();
  parallel(n, h * taps, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t in_block = i % block;
      const float* d = dp + i * 2 * taps * groups + side * taps * groups;
      for (int64_t c = 0; c < h; ++c) {
        float acc = 0.0f;
        for (int64_t t = 0; t < taps && t <= in_block; ++t) {
          acc += (bp[t * h + c] + d[t * groups + c / group]) * xp[(i - t) * h + c];
        }
        op[i * h + c] = accumulate ? op[i * h + c] + acc : acc;
      }
    }
  });
}

void CpuBackend::topk_candidates(const Tensor& logits, int64_t k, float multiplier, float softcap, Tensor& ids,
                                 Tensor& unary) {
  const int64_t rows = logits.dim(0), vocab = logits.dim(1);
  DFLASH_CHECK(logits.dtype == DType::kF32 && k >= 1 && k <= vocab && ids.numel() == rows * k &&
                   unary.numel() == rows * k,
               "topk_candidates: logits ", shape_str(logits.shape), " k ", k);
  parallel(rows, vocab * 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      topk_row(logits.ptr<float>() + r * vocab, vocab, k, multiplier, softcap, ids.ptr<int32_t>() + r * k,
               unary.ptr<float>() + r * k);
    }
  });
}

void CpuBackend::edge_scores(const Tensor& ids, const Tensor& unary, const Tensor& gate, const Tensor& anchors,
                             const Tensor& pred_codebook, const Tensor& succ_codebook, Tensor& edges) {
  const int64_t b = ids.dim(0), slots = ids.dim(1), k = ids.dim(2), rank = gate.dim(-1);
  const int64_t vocab = pred_codebook.dim(0);
  DFLASH_CHECK(unary.numel() == b * slots * k && gate.numel() == b * slots * rank && anchors.numel() == b &&
                   pred_codebook.dim(1) == rank && succ_codebook.dim(0) == vocab && succ_codebook.dim(1) == rank &&
                   edges.numel() == b * slots * k * k,
               "edge_scores: ids ", shape_str(ids.shape), " gate ", shape_str(gate.shape), " codebooks ",
               shape_str(pred_codebook.shape));
  const int32_t* idp = ids.ptr<int32_t>();
  const float* A = pred_codebook.ptr<float>();
  const float* B = succ_codebook.ptr<float>();
  parallel(b * slots, k * k * rank, [&](int64_t i0, int64_t i1) {
    std::vector<float> gated(rank);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t req = i / slots, s = i % slots;
      const float* g = gate.ptr<float>() + i * rank;
      const float* u = unary.ptr<float>() + i * k;
      const int32_t* cand = idp + i * k;
      float* e = edges.ptr<float>() + i * k * k;
      for (int64_t p = 0; p < k; ++p) {
        const int32_t pred = s == 0 ? anchors.ptr<int32_t>()[req] : idp[(i - 1) * k + p];
        DFLASH_CHECK(pred >= 0 && pred < vocab, "edge_scores: predecessor id ", pred, " outside [0, ", vocab, ")");
        for (int64_t j = 0; j < rank; ++j) gated[j] = A[pred * rank + j] * g[j];
        for (int64_t c = 0; c < k; ++c) {
          const float* bc = B + static_cast<int64_t>(cand[c]) * rank;
          float dot = 0.0f;
          for (int64_t j = 0; j < rank; ++j) dot += gated[j] * bc[j];
          e[p * k + c] = u[c] + dot;
        }
      }
    }
  });
}

void CpuBackend::lattice_walk(const Tensor& edges, const Tensor& ids, const Tensor& params, bool greedy_walk,
                              Tensor& drafts, Tensor& realized) {
  const int64_t b = ids.dim(0), slots = ids.dim(1), k = ids.dim(2);
  DFLASH_CHECK(edges.numel() == b * slots * k * k && drafts.numel() == b * slots && realized.numel() == b * slots * k,
               "lattice_walk: edges ", shape_str(edges.shape), " ids ", shape_str(ids.shape));
  for (int64_t r = 0; r < b; ++r) {
    walk_request(edges.ptr<float>() + r * slots * k * k, ids.ptr<int32_t>() + r * slots * k, slots, k,
                 unpack_params(params, r), greedy_walk, drafts.ptr<int32_t>() + r * slots,
                 realized.ptr<float>() + r * slots * k);
  }
}

void CpuBackend::accept_candidates(const Tensor& drafts, const Tensor& ids, const Tensor& realized,
                                   const Tensor& logits, const Tensor& params, Tensor& num_accepted,
                                   Tensor& next_token) {
  const bool dense = ids.shape.empty();  // no candidate ids: dense rows
  const int64_t rows = drafts.dim(0), n = drafts.dim(1), vocab = logits.dim(-1);
  const int64_t k = dense ? realized.dim(-1) : ids.dim(-1);
  DFLASH_CHECK((dense ? k == vocab : ids.numel() == rows * n * k) && realized.numel() == rows * n * k &&
                   logits.numel() == rows * (n + 1) * vocab,
               "accept_candidates: drafts ", shape_str(drafts.shape), " ids ", shape_str(ids.shape), " logits ",
               shape_str(logits.shape));
  for (int64_t r = 0; r < rows; ++r) {
    const AcceptResult a = accept_candidates_request(
        drafts.ptr<int32_t>() + r * n, dense ? nullptr : ids.ptr<int32_t>() + r * n * k,
        realized.ptr<float>() + r * n * k, n, k,
        logits.ptr<float>() + r * (n + 1) * vocab, vocab, unpack_params(params, r));
    num_accepted.ptr<int32_t>()[r] = static_cast<int32_t>(a.num_accepted);
    next_token.ptr<int32_t>()[r] = a.next_token;
  }
}

void CpuBackend::sample_drafts(const Tensor& logits, const Tensor& params, int64_t n, Tensor& drafts) {
  const int64_t rows = logits.dim(0), vocab = logits.dim(1);
  DFLASH_CHECK(logits.dtype == DType::kF32 && n >= 1 && rows % n == 0 && drafts.numel() == rows,
               "sample_drafts: logits ", shape_str(logits.shape), " n ", n, " drafts ", shape_str(drafts.shape));
  parallel(rows, vocab * 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const SampleRow row = unpack_params(params, i / n);
      drafts.ptr<int32_t>()[i] = sample_draft_token(logits.ptr<float>() + i * vocab, vocab, row, row.position + i % n);
    }
  });
}

}  // namespace dflash
