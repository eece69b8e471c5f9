// Llama / Qwen3 forward pass over a ragged batch with a paged KV cache.
#include "model/transformer.h"

#include <algorithm>
#include <string>

namespace dflash {

TensorShapes transformer_tensors(const ModelConfig& c) {
  const int64_t h = c.hidden_size, v = c.vocab_size;
  TensorShapes t;
  t["model.embed_tokens.weight"] = {v, h};
  t["model.norm.weight"] = {h};
  if (!c.tie_word_embeddings) t["lm_head.weight"] = {v, h};
  const LayerGeometry g = layer_geometry(c);
  for (int64_t l = 0; l < c.num_layers; ++l) layer_tensor_shapes("model.layers." + std::to_string(l) + ".", g, &t);
  return t;
}

void transformer_check_checkpoint(const ModelConfig& c, const Checkpoint& ckpt) {
  DFLASH_CHECK(c.tie_word_embeddings || ckpt.has("lm_head.weight"), ckpt.dir(),
               ": config.json has tie_word_embeddings=false but there is no 'lm_head.weight'");
  const TensorShapes expected = transformer_tensors(c);
  const std::string owner = detail::concat("a ", c.arch_name, " with ", c.num_layers, " layers");
  ckpt.check_tensor_set(expected, owner, [&](const std::string& name) {
    if (name == "lm_head.weight") return std::string(" (config.json has tie_word_embeddings=true)");
    return std::string(" (check num_hidden_layers in config.json)");
  });
  ckpt.get("model.embed_tokens.weight", expected.at("model.embed_tokens.weight"));  // a wrong vocab shows here
  for (const auto& [name, shape] : expected) ckpt.get(name, shape);
}

Transformer::Transformer(const ModelConfig& config, const Checkpoint& ckpt, Backend& backend,
                         std::vector<int> tap_layers)
    : config_(config), geometry_(layer_geometry(config)), backend_(backend), tap_layers_(std::move(tap_layers)) {
  const int64_t h = config.hidden_size, v = config.vocab_size;
  for (int l : tap_layers_) {
    DFLASH_ARG_CHECK(l >= 0 && l < config.num_layers, "tap layer ", l, " is outside the model's ",
                     config.num_layers, " layers");
  }
  transformer_check_checkpoint(config, ckpt);
  auto load = [&](const std::string& name, std::vector<int64_t> shape) {
    return weight_load(backend_, ckpt, name, shape, &weight_bytes_);
  };
  embed_ = load("model.embed_tokens.weight", {v, h});
  final_norm_ = load("model.norm.weight", {h});
  if (config.tie_word_embeddings) {
    lm_head_ = embed_;
  } else {
    lm_head_ = load("lm_head.weight", {v, h});
  }
  for (int64_t l = 0; l < config.num_layers; ++l) {
    layers_.push_back(layer_weights_load(backend_, ckpt, "model.layers." + std::to_string(l) + ".", geometry_,
                                         &weight_bytes_));
  }
  std::vector<float> inv = config.rope_inv_freq();
  inv_freq_ = backend_.upload_f32(inv.data(), {static_cast<int64_t>(inv.size())});
}

KVPool kv_pool_create(Backend& backend, int64_t num_layers, const LayerGeometry& g, int64_t num_blocks,
                      int64_t block_size) {
  KVPool pool;
  pool.num_layers = num_layers;
  pool.num_blocks = num_blocks;
  pool.block_size = block_size;
  pool.num_kv_heads = g.num_kv_heads;
  pool.head_dim = g.head_dim;
  std::vector<int64_t> shape = {num_layers, num_blocks, block_size, g.num_kv_heads, g.head_dim};
  pool.k = backend.zeros(shape, backend.compute_dtype());
  pool.v = backend.zeros(shape, backend.compute_dtype());
  return pool;
}

KVPool Transformer::make_kv_pool(int64_t num_blocks, int64_t block_size) const {
  return kv_pool_create(backend_, config_.num_layers, geometry_, num_blocks, block_size);
}

ForwardResult Transformer::forward(const ForwardBatch& batch, KVPool& pool) {
  DFLASH_CHECK(batch.num_tokens() > 0, "forward over an empty batch");
  return forward(device_batch_upload(backend_, batch, /*causal=*/true), pool);
}

ForwardResult Transformer::forward(const DeviceBatch& batch, KVPool& pool) {
  const int64_t t = batch.num_tokens, h = config_.hidden_size;
  const DType dt = backend_.compute_dtype();
  DFLASH_CHECK(t > 0, "forward over an empty batch");

  LayerScratch s(backend_, geometry_, t);
  Tensor residual = backend_.empty({t, h}, dt);
  ForwardResult result;
  const int64_t num_taps = static_cast<int64_t>(tap_layers_.size());
  if (batch.want_taps && num_taps > 0) result.taps = backend_.empty({t, num_taps * h}, dt);

  backend_.embedding(embed_, batch.token_ids, residual);
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    decoder_layer_forward(backend_, layers_[l], geometry_, batch.positions, inv_freq_, batch.slots, batch.meta, pool,
                          l, residual, s);
    if (!result.taps.empty()) {
      auto it = std::find(tap_layers_.begin(), tap_layers_.end(), static_cast<int>(l));
      if (it != tap_layers_.end()) {  // the layer's output, written as column block j of taps
        backend_.copy_columns(residual, result.taps, (it - tap_layers_.begin()) * h);
      }
    }
  }
  backend_.rms_norm(residual, final_norm_, geometry_.eps, s.normed);
  result.logits = lm_head_rows(backend_, lm_head_, s.normed, batch, DType::kF32);
  return result;
}

Tensor logit_row_states(Backend& backend, const Tensor& normed, const DeviceBatch& batch) {
  if (batch.all_logit_rows) return normed;
  Tensor picked = backend.empty({batch.num_logit_rows(), normed.dim(1)}, normed.dtype);
  if (picked.dim(0) > 0) backend.gather_rows(normed, batch.logit_rows, picked);
  return picked;
}

Tensor lm_head_rows(Backend& backend, const Tensor& lm_head, const Tensor& normed, const DeviceBatch& batch,
                    DType logits_dtype) {
  Tensor logits = backend.empty({batch.num_logit_rows(), lm_head.dim(0)}, logits_dtype);
  if (logits.dim(0) == 0) return logits;
  backend.linear(logit_row_states(backend, normed, batch), lm_head, logits);
  return logits;
}

}  // namespace dflash
