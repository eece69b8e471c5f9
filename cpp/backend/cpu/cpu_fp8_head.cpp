// The CPU backend's FP8 candidate head (backend.h): the per-row e4m3 copy of a weight, the GEMM
// over it (rows dequantized once into fp32, then dotted with every input row) and the exact
// re-score of the candidates picked on it, fp32.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/host_fp8.h"

namespace dflash {

Fp8Weight CpuBackend::fp8_rows(const Tensor& w) {
  DFLASH_CHECK(w.dtype == DType::kF32 && w.shape.size() == 2 && w.dim(1) >= 1, "fp8_rows: w ", shape_str(w.shape),
               " ", dtype_name(w.dtype), " is not a [V, H] fp32 weight");
  const int64_t v = w.dim(0), h = w.dim(1);
  Fp8Weight out;
  out.q = empty({v, h}, DType::kU8);
  out.scale = empty({v}, DType::kF32);
  parallel(v, h * 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      out.scale.ptr<float>()[r] = fp8_quantize_row(w.ptr<float>() + r * h, h, out.q.ptr<uint8_t>() + r * h);
    }
  });
  return out;
}

void CpuBackend::linear_fp8(const Tensor& x, const Fp8Weight& w, Tensor& out) {
  const int64_t v = w.q.dim(0), h = w.q.dim(1), m = x.numel() / h;
  DFLASH_CHECK(x.dtype == DType::kF32 && w.q.dtype == DType::kU8 && w.scale.numel() == v && x.numel() == m * h &&
                   out.dtype == DType::kF32 && out.numel() == m * v,
               "linear_fp8: x ", shape_str(x.shape), " q ", shape_str(w.q.shape), " out ", shape_str(out.shape));
  float lut[256];
  for (int b = 0; b < 256; ++b) lut[b] = fp8_e4m3_decode(static_cast<uint8_t>(b));
  const float* xp = x.ptr<float>();
  float* op = out.ptr<float>();
  constexpr int64_t kRowsPerItem = 64;
  const int64_t items = (v + kRowsPerItem - 1) / kRowsPerItem;
  parallel(items, kRowsPerItem * h * std::max<int64_t>(m, 1), [&](int64_t i0, int64_t i1) {
    std::vector<float> row(h);
    for (int64_t r = i0 * kRowsPerItem; r < std::min(v, i1 * kRowsPerItem); ++r) {
      const uint8_t* q = w.q.ptr<uint8_t>() + r * h;
      for (int64_t k = 0; k < h; ++k) row[k] = lut[q[k]];
      const float s = w.scale.ptr<float>()[r];
      for (int64_t i = 0; i < m; ++i) {
        const float* xi = xp + i * h;
        float acc = 0.0f;
        for (int64_t k = 0; k < h; ++k) acc += xi[k] * row[k];
        op[i * v + r] = s * acc;
      }
    }
  });
}

void CpuBackend::rescore_candidates(const Tensor& h, const Tensor& head, float multiplier, float softcap, Tensor& ids,
                                    Tensor& unary) {
  const int64_t rows = ids.dim(0), k = ids.dim(1), hidden = head.dim(1), vocab = head.dim(0);
  DFLASH_CHECK(h.dtype == DType::kF32 && head.dtype == DType::kF32 && ids.dtype == DType::kI32 &&
                   h.numel() == rows * hidden && unary.numel() == rows * k,
               "rescore_candidates: h ", shape_str(h.shape), " head ", shape_str(head.shape), " ids ",
               shape_str(ids.shape), " unary ", shape_str(unary.shape));
  parallel(rows, k * hidden, [&](int64_t r0, int64_t r1) {
    std::vector<float> value(k);
    std::vector<int32_t> cand(k);
    std::vector<int64_t> order(k);
    for (int64_t r = r0; r < r1; ++r) {
      const float* hr = h.ptr<float>() + r * hidden;
      int32_t* id = ids.ptr<int32_t>() + r * k;
      for (int64_t j = 0; j < k; ++j) {
        cand[j] = id[j];
        DFLASH_CHECK(cand[j] >= 0 && cand[j] < vocab, "rescore_candidates: id ", cand[j], " outside [0, ", vocab, ")");
        const float* w = head.ptr<float>() + static_cast<int64_t>(cand[j]) * hidden;
        float acc = 0.0f;
        for (int64_t c = 0; c < hidden; ++c) acc += hr[c] * w[c];
        value[j] = acc;
      }
      // topk_candidates' order: larger first, NaN last, lower id first on ties.
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        const bool na = std::isnan(value[a]), nb = std::isnan(value[b]);
        if (na != nb) return nb;
        if (!na && value[a] != value[b]) return value[a] > value[b];
        return cand[a] != cand[b] ? cand[a] < cand[b] : a < b;
      });
      for (int64_t j = 0; j < k; ++j) {
        float v = value[order[j]];
        if (std::isnan(v)) {
          v = -INFINITY;
        } else {
          v *= multiplier;
          if (softcap > 0.0f) v = softcap * std::tanh(v / softcap);
        }
        id[j] = cand[order[j]];
        unary.ptr<float>()[r * k + j] = v;
      }
    }
  });
}

}  // namespace dflash
