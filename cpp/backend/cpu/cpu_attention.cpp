// CPU paged attention: for each query row and head, softmax(q k^T / sqrt(hd)) v over the keys
// of its sequence, read through the block table. Causal with a query offset (prefill, decode,
// verify) or non-causal (the drafter's block attends to its whole context and block).
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_backend.h"

namespace dflash {

void CpuBackend::paged_attention(const Tensor& q, const KVPool& pool, int64_t layer,
                                 const AttentionMeta& meta, Tensor& out) {
  const int64_t tokens = q.dim(0), nh = q.dim(1), hd = q.dim(2);
  const int64_t nkv = pool.num_kv_heads, group = nh / nkv, bs = pool.block_size;
  const int64_t row = nkv * hd;
  const int64_t layer_slots = pool.num_blocks * bs;
  const float* kl = pool.k.ptr<float>() + layer * layer_slots * row;
  const float* vl = pool.v.ptr<float>() + layer * layer_slots * row;
  const int32_t* qs = meta.query_start.ptr<int32_t>();
  const int32_t* kv_len = meta.kv_len.ptr<int32_t>();
  const int32_t* table = meta.block_table.ptr<int32_t>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

  std::vector<int32_t> seq_of_row(tokens);
  for (int s = 0; s < meta.num_seqs; ++s) {
    for (int32_t t = qs[s]; t < qs[s + 1]; ++t) seq_of_row[t] = s;
  }

  parallel(tokens * nh, std::max(meta.max_kv_len, 1) * hd * 2, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(meta.max_kv_len > 0 ? meta.max_kv_len : 1);
    std::vector<float> acc(hd);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t t = item / nh, h = item % nh;
      const int s = seq_of_row[t];
      const int64_t num_q = qs[s + 1] - qs[s];
      const int64_t len = kv_len[s];
      const int64_t q_pos = len - num_q + (t - qs[s]);
      const bool symmetric = meta.symmetric_window && meta.window > 0;
      const bool causal = !symmetric && (meta.causal || meta.window > 0);
      const int64_t visible = causal ? q_pos + 1 : symmetric ? std::min<int64_t>(len, q_pos + meta.window) : len;
      const int64_t first_key = meta.window > 0 ? std::max<int64_t>(0, q_pos - meta.window + 1) : 0;
      const float* qv = q.ptr<float>() + (t * nh + h) * hd;
      const int64_t kvh = h / group;
      const int32_t* blocks = table + static_cast<int64_t>(s) * meta.max_blocks_per_seq;
      float max_score = -INFINITY;
      for (int64_t j = first_key; j < visible; ++j) {
        const int64_t slot = static_cast<int64_t>(blocks[j / bs]) * bs + j % bs;
        const float* kv = kl + slot * row + kvh * hd;
        float dot = 0.0f;
        for (int64_t d = 0; d < hd; ++d) dot += qv[d] * kv[d];
        scores[j] = dot * scale;
        max_score = std::max(max_score, scores[j]);
      }
      float denom = 0.0f;
      for (int64_t j = first_key; j < visible; ++j) {
        scores[j] = std::exp(scores[j] - max_score);
        denom += scores[j];
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = first_key; j < visible; ++j) {
        const int64_t slot = static_cast<int64_t>(blocks[j / bs]) * bs + j % bs;
        const float* vv = vl + slot * row + kvh * hd;
        const float p = scores[j];
        for (int64_t d = 0; d < hd; ++d) acc[d] += p * vv[d];
      }
      float* o = out.ptr<float>() + (t * nh + h) * hd;
      const float inv = 1.0f / denom;
      for (int64_t d = 0; d < hd; ++d) o[d] = acc[d] * inv;
    }
  });
}

}  // namespace dflash
