// Llama / Qwen3 forward pass over a ragged batch with a paged KV cache.
#include "model/transformer.h"

#include <algorithm>
#include <string>

namespace dflash {

Tensor Transformer::load(const Checkpoint& ckpt, const std::string& name,
                         std::vector<int64_t> shape) {
  Tensor t = backend_.weight({&ckpt.get(name, shape)});
  weight_bytes_ += t.nbytes();
  return t;
}

Tensor Transformer::load_stacked(const Checkpoint& ckpt, const std::vector<std::string>& names,
                                 const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<const StoredTensor*> parts;
  for (size_t i = 0; i < names.size(); ++i) parts.push_back(&ckpt.get(names[i], shapes[i]));
  Tensor t = backend_.weight(parts);
  weight_bytes_ += t.nbytes();
  return t;
}

Transformer::Transformer(const ModelConfig& config, const Checkpoint& ckpt, Backend& backend,
                         std::vector<int> tap_layers)
    : config_(config), backend_(backend), tap_layers_(std::move(tap_layers)) {
  const int64_t h = config.hidden_size, v = config.vocab_size, hd = config.head_dim;
  const int64_t nh = config.num_heads, nkv = config.num_kv_heads, inter = config.intermediate_size;
  for (int l : tap_layers_) {
    DFLASH_ARG_CHECK(l >= 0 && l < config.num_layers, "tap layer ", l,
                     " is outside the model's ", config.num_layers, " layers");
  }
  embed_ = load(ckpt, "model.embed_tokens.weight", {v, h});
  final_norm_ = load(ckpt, "model.norm.weight", {h});
  if (config.tie_word_embeddings) {
    lm_head_ = embed_;
  } else {
    DFLASH_CHECK(ckpt.has("lm_head.weight"), ckpt.dir(),
                 ": config.json has tie_word_embeddings=false but there is no 'lm_head.weight'");
    lm_head_ = load(ckpt, "lm_head.weight", {v, h});
  }
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights w;
    w.input_norm = load(ckpt, p + "input_layernorm.weight", {h});
    w.qkv = load_stacked(ckpt,
                         {p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                          p + "self_attn.v_proj.weight"},
                         {{nh * hd, h}, {nkv * hd, h}, {nkv * hd, h}});
    if (config.qk_norm) {
      w.q_norm = load(ckpt, p + "self_attn.q_norm.weight", {hd});
      w.k_norm = load(ckpt, p + "self_attn.k_norm.weight", {hd});
    }
    w.o = load(ckpt, p + "self_attn.o_proj.weight", {h, nh * hd});
    w.post_norm = load(ckpt, p + "post_attention_layernorm.weight", {h});
    w.gate_up = load_stacked(ckpt, {p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"},
                             {{inter, h}, {inter, h}});
    w.down = load(ckpt, p + "mlp.down_proj.weight", {h, inter});
    layers_.push_back(std::move(w));
  }
  std::vector<float> inv = config.rope_inv_freq();
  inv_freq_ = backend_.upload_f32(inv.data(), {static_cast<int64_t>(inv.size())});
}

KVPool Transformer::make_kv_pool(int64_t num_blocks, int64_t block_size) const {
  KVPool pool;
  pool.num_layers = config_.num_layers;
  pool.num_blocks = num_blocks;
  pool.block_size = block_size;
  pool.num_kv_heads = config_.num_kv_heads;
  pool.head_dim = config_.head_dim;
  std::vector<int64_t> shape = {pool.num_layers, num_blocks, block_size, pool.num_kv_heads,
                                pool.head_dim};
  pool.k = backend_.zeros(shape, backend_.compute_dtype());
  pool.v = backend_.zeros(shape, backend_.compute_dtype());
  return pool;
}

ForwardResult Transformer::forward(const ForwardBatch& batch, KVPool& pool) {
  const ModelConfig& c = config_;
  const int64_t t = batch.num_tokens(), h = c.hidden_size, hd = c.head_dim;
  const int64_t nh = c.num_heads, nkv = c.num_kv_heads, inter = c.intermediate_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const DType dt = backend_.compute_dtype();
  DFLASH_CHECK(t > 0, "forward over an empty batch");

  Tensor ids = backend_.upload_i32(batch.token_ids.data(), {t});
  Tensor positions = backend_.upload_i32(batch.positions.data(), {t});
  Tensor slots = backend_.upload_i32(batch.slots.data(), {t});
  AttentionMeta meta;
  meta.num_seqs = batch.num_seqs();
  meta.max_blocks_per_seq = batch.max_blocks_per_seq;
  meta.causal = true;
  meta.query_start = backend_.upload_i32(batch.query_start.data(), {meta.num_seqs + 1});
  meta.kv_len = backend_.upload_i32(batch.kv_len.data(), {meta.num_seqs});
  meta.block_table = backend_.upload_i32(batch.block_table.data(),
                                         {meta.num_seqs, batch.max_blocks_per_seq});
  for (int s = 0; s < meta.num_seqs; ++s) {
    meta.max_query_len = std::max(meta.max_query_len,
                                  batch.query_start[s + 1] - batch.query_start[s]);
    meta.max_kv_len = std::max(meta.max_kv_len, batch.kv_len[s]);
  }

  Tensor residual = backend_.empty({t, h}, dt);
  Tensor normed = backend_.empty({t, h}, dt);
  Tensor qkv = backend_.empty({t, (nh + 2 * nkv) * hd}, dt);
  Tensor q = backend_.empty({t, nh, hd}, dt);
  Tensor k = backend_.empty({t, nkv, hd}, dt);
  Tensor v = backend_.empty({t, nkv, hd}, dt);
  Tensor attn = backend_.empty({t, nh, hd}, dt);
  Tensor proj = backend_.empty({t, h}, dt);
  Tensor gate_up = backend_.empty({t, 2 * inter}, dt);
  Tensor act = backend_.empty({t, inter}, dt);
  ForwardResult result;
  const int64_t num_taps = static_cast<int64_t>(tap_layers_.size());
  if (batch.want_taps && num_taps > 0) result.taps = backend_.empty({t, num_taps * h}, dt);
  Tensor tap_tmp = result.taps.empty() ? Tensor() : backend_.empty({t, h}, dt);

  backend_.embedding(embed_, ids, residual);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = layers_[l];
    if (l == 0) {
      backend_.rms_norm(residual, w.input_norm, eps, normed);
    } else {
      backend_.add_rms_norm(residual, proj, w.input_norm, eps, normed);  // proj = last MLP out
    }
    backend_.linear(normed, w.qkv, qkv);
    backend_.qkv_norm_rope(qkv, w.q_norm, w.k_norm, eps, positions, inv_freq_, 1.0f, q, k, v);
    backend_.kv_write(pool, l, k, v, slots);
    backend_.paged_attention(q, pool, l, meta, attn);
    backend_.linear(attn.reshape({t, nh * hd}), w.o, proj);
    backend_.add_rms_norm(residual, proj, w.post_norm, eps, normed);
    backend_.linear(normed, w.gate_up, gate_up);
    backend_.silu_mul(gate_up, act);
    backend_.linear(act, w.down, proj);
    if (!result.taps.empty()) {
      auto it = std::find(tap_layers_.begin(), tap_layers_.end(), static_cast<int>(l));
      if (it != tap_layers_.end()) {
        // The layer's output (residual + MLP out), written as column block j of taps.
        backend_.add(residual, proj, tap_tmp);
        const int64_t j = it - tap_layers_.begin();
        backend_.copy_columns(tap_tmp, result.taps, j * h);
      }
    }
  }
  backend_.add_rms_norm(residual, proj, final_norm_, eps, normed);
  const int64_t n = static_cast<int64_t>(batch.logit_rows.size());
  result.logits = backend_.empty({n, c.vocab_size}, DType::kF32);
  if (n > 0) {
    Tensor rows = backend_.upload_i32(batch.logit_rows.data(), {n});
    Tensor picked = backend_.empty({n, h}, dt);
    backend_.gather_rows(normed, rows, picked);
    backend_.linear(picked, lm_head_, result.logits);
  }
  return result;
}

}  // namespace dflash
