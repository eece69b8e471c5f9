// DFlash drafter: weights, context (KV-injection) update and the block draft forward.
#include "model/dflash_drafter.h"

#include <filesystem>

namespace dflash {

DFlashDrafter::DFlashDrafter(const DraftConfig& config, const std::string& draft_dir, Backend& backend,
                             const Transformer& target, const std::string& target_dir)
    : config_(config), geometry_(layer_geometry(config.geometry)), backend_(backend), target_(target) {
  draft_config_check_target(config_, target.config(), target_dir);
  Checkpoint ckpt(draft_dir);
  const int64_t h = geometry_.hidden;
  const int64_t fc_in = static_cast<int64_t>(config_.target_layer_ids.size()) * target.config().hidden_size;
  const StoredTensor& fc = ckpt.get("fc.weight");
  DFLASH_CHECK(fc.shape == std::vector<int64_t>({h, fc_in}), fc.file, ": 'fc.weight' has shape ",
               shape_str(fc.shape), " but the drafter needs [", h, ", ", fc_in, "] = [hidden_size, ",
               config_.target_layer_ids.size(), " target layers x ", target.config().hidden_size,
               " (hidden_size of ", target_dir, "/config.json)]");
  auto load = [&](const std::string& name, std::vector<int64_t> shape) {
    return weight_load(backend_, ckpt, name, shape, &weight_bytes_);
  };
  fc_ = load("fc.weight", {h, fc_in});
  hidden_norm_ = load("hidden_norm.weight", {h});
  norm_ = load("norm.weight", {h});
  for (int64_t l = 0; l < config_.geometry.num_layers; ++l) {
    layers_.push_back(
        layer_weights_load(backend_, ckpt, "layers." + std::to_string(l) + ".", geometry_, &weight_bytes_));
  }
  std::vector<float> inv = config_.geometry.rope_inv_freq();
  inv_freq_ = backend_.upload_f32(inv.data(), {static_cast<int64_t>(inv.size())});
}

KVPool DFlashDrafter::make_kv_pool(int64_t num_blocks, int64_t block_size) const {
  return kv_pool_create(backend_, config_.geometry.num_layers, geometry_, num_blocks, block_size);
}

void DFlashDrafter::update_context(const Tensor& taps, const std::vector<int32_t>& positions,
                                   const std::vector<int32_t>& slots, KVPool& pool) {
  const int64_t c = static_cast<int64_t>(positions.size());
  if (c == 0) return;
  const LayerGeometry& g = geometry_;
  const DType dt = backend_.compute_dtype();
  DFLASH_CHECK(taps.dim(0) == c, "update_context: ", taps.dim(0), " tap rows for ", c, " positions");
  Tensor pos = backend_.upload_i32(positions.data(), {c});
  Tensor slot = backend_.upload_i32(slots.data(), {c});
  Tensor feat = backend_.empty({c, g.hidden}, dt);
  Tensor ctx = backend_.empty({c, g.hidden}, dt);
  backend_.linear(taps, fc_, feat);
  backend_.rms_norm(feat, hidden_norm_, g.eps, ctx);
  Tensor kv = backend_.empty({c, 2 * g.num_kv_heads * g.head_dim}, dt);
  Tensor no_q = backend_.empty({c, 0, g.head_dim}, dt);
  Tensor k = backend_.empty({c, g.num_kv_heads, g.head_dim}, dt);
  Tensor v = backend_.empty({c, g.num_kv_heads, g.head_dim}, dt);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerWeights& w = layers_[l];
    backend_.linear(ctx, w.kv_weight(g), kv);
    backend_.qkv_norm_rope(kv, Tensor(), w.k_norm, g.eps, pos, inv_freq_, 1.0f, no_q, k, v);
    backend_.kv_write(pool, static_cast<int64_t>(l), k, v, slot);
  }
}

Tensor DFlashDrafter::draft(const ForwardBatch& batch, KVPool& pool) {
  const int64_t t = batch.num_tokens();
  const LayerGeometry& g = geometry_;
  const DType dt = backend_.compute_dtype();
  Tensor ids = backend_.upload_i32(batch.token_ids.data(), {t});
  Tensor positions = backend_.upload_i32(batch.positions.data(), {t});
  Tensor slots = backend_.upload_i32(batch.slots.data(), {t});
  AttentionMeta full = attention_meta_build(backend_, batch, /*causal=*/false);
  LayerScratch s(backend_, g, t);
  Tensor residual = backend_.empty({t, g.hidden}, dt);
  backend_.embedding(target_.embedding(), ids, residual);
  for (size_t l = 0; l < layers_.size(); ++l) {
    AttentionMeta meta = full;
    meta.window = config_.sliding_window[l];
    decoder_layer_forward(backend_, layers_[l], g, l == 0, positions, inv_freq_, slots, meta, pool,
                          static_cast<int64_t>(l), residual, s);
  }
  backend_.add_rms_norm(residual, s.proj, norm_, g.eps, s.normed);
  const int64_t n = static_cast<int64_t>(batch.logit_rows.size());
  Tensor logits = backend_.empty({n, target_.config().vocab_size}, DType::kF32);
  if (n > 0) {
    Tensor rows = backend_.upload_i32(batch.logit_rows.data(), {n});
    Tensor picked = backend_.empty({n, g.hidden}, dt);
    backend_.gather_rows(s.normed, rows, picked);
    backend_.linear(picked, target_.lm_head(), logits);
  }
  return logits;
}

}  // namespace dflash
