// DFlash drafter: weights, context (KV-injection) update and the block draft forward.
#include "model/dflash_drafter.h"

#include <filesystem>
#include <map>

namespace dflash {

namespace {

// The tensors a drafter of this config uses, with their shapes: the published DFlash set, plus
// the conv and selector tensors of a DFlash2DraftModel.
TensorShapes drafter_tensors(const DraftConfig& c, const ModelConfig& target) {
  const ModelConfig& g = c.geometry;
  const int64_t h = g.hidden_size;
  TensorShapes t;
  t["fc.weight"] = {h, static_cast<int64_t>(c.target_layer_ids.size()) * target.hidden_size};
  t["hidden_norm.weight"] = {h};
  t["norm.weight"] = {h};
  const LayerGeometry lg = layer_geometry(g);
  for (int64_t l = 0; l < g.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    layer_tensor_shapes(p, lg, &t);
    if (c.arch == DraftArch::kDFlash2) {
      const int64_t taps = c.dflash2.conv_kernel_size, groups = h / c.dflash2.conv_group_size;
      for (const char* side : {"attention_conv.", "mlp_conv."}) {
        t[p + side + "base_kernel"] = {2, taps, h};
        t[p + side + "kernel_projection.weight"] = {2 * taps * groups, h};
      }
    }
  }
  if (c.arch == DraftArch::kDFlash2) {
    const int64_t v = target.vocab_size, r = c.dflash2.selector_rank;
    t["candidate_selector.predecessor_codebook"] = {v, r};
    t["candidate_selector.successor_codebook"] = {v, r};
    t["candidate_selector.hidden_projection.weight"] = {r, h};
  }
  return t;
}

// Every tensor of the checkpoint is one the architecture uses, with the shape it needs, and
// every tensor it needs is there: a checkpoint with more layers than num_hidden_layers, or a
// DFlash2 checkpoint labelled DFlashDraftModel, never loads silently as something else.
void check_tensor_set(const Checkpoint& ckpt, const DraftConfig& c, const ModelConfig& target) {
  const std::string owner = detail::concat("a ", c.arch_name, " with ", c.geometry.num_layers, " layers (", c.path,
                                           ")");
  ckpt.check_tensor_set(drafter_tensors(c, target), owner, [&](const std::string& name) {
    const bool dflash2_part = name.find("_conv.") != std::string::npos || name.rfind("candidate_selector.", 0) == 0;
    return std::string(dflash2_part && c.arch == DraftArch::kDFlash
                           ? "; it is a DFlash2 tensor: a DFlash2 checkpoint needs \"architectures\": "
                             "[\"DFlash2DraftModel\"]"
                           : "; check num_hidden_layers and the architecture");
  });
}

// Every tensor has the shape the architecture needs (the error names the tensor and both shapes).
void check_tensor_shapes(const Checkpoint& ckpt, const DraftConfig& c, const ModelConfig& target) {
  for (const auto& [name, shape] : drafter_tensors(c, target)) ckpt.get(name, shape);
}

}  // namespace

DFlashDrafter::DFlashDrafter(const DraftConfig& config, const std::string& draft_dir, Backend& backend,
                             const Transformer& target, const std::string& target_dir)
    : config_(config), geometry_(layer_geometry(config.geometry)), backend_(backend), target_(target) {
  draft_config_check_target(config_, target.config(), target_dir);
  Checkpoint ckpt(draft_dir);
  check_tensor_set(ckpt, config_, target.config());
  const int64_t h = geometry_.hidden;
  const int64_t fc_in = static_cast<int64_t>(config_.target_layer_ids.size()) * target.config().hidden_size;
  const StoredTensor& fc = ckpt.get("fc.weight");
  DFLASH_CHECK(fc.shape == std::vector<int64_t>({h, fc_in}), fc.file, ": 'fc.weight' has shape ",
               shape_str(fc.shape), " but the drafter needs [", h, ", ", fc_in, "] = [hidden_size, ",
               config_.target_layer_ids.size(), " target layers x ", target.config().hidden_size,
               " (hidden_size of ", target_dir, "/config.json)]");
  check_tensor_shapes(ckpt, config_, target.config());
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
  // The context path of all layers as one GEMM: K/V projections stacked [L * 2 nkv hd, H] (a
  // second copy of those rows; the layers' fused QKV keeps its own) and k_norm [L * hd].
  const int64_t kv_rows = geometry_.num_kv_heads * geometry_.head_dim;
  std::vector<const StoredTensor*> kv_parts, norm_parts;
  for (int64_t l = 0; l < config_.geometry.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".self_attn.";
    kv_parts.push_back(&ckpt.get(p + "k_proj.weight", {kv_rows, h}));
    kv_parts.push_back(&ckpt.get(p + "v_proj.weight", {kv_rows, h}));
    if (geometry_.qk_norm) norm_parts.push_back(&ckpt.get(p + "k_norm.weight", {geometry_.head_dim}));
  }
  kv_stacked_ = backend_.weight(kv_parts);
  weight_bytes_ += kv_stacked_.nbytes();
  if (!norm_parts.empty()) {
    k_norm_stacked_ = backend_.weight(norm_parts);
    weight_bytes_ += k_norm_stacked_.nbytes();
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
  DFLASH_CHECK(taps.dim(0) == c, "update_context: ", taps.dim(0), " tap rows for ", c, " positions");
  update_context(taps, backend_.upload_i32(positions.data(), {c}), backend_.upload_i32(slots.data(), {c}), pool);
}

void DFlashDrafter::update_context(const Tensor& taps, const Tensor& positions, const Tensor& slots, KVPool& pool) {
  const int64_t c = taps.dim(0);
  if (c == 0) return;
  const LayerGeometry& g = geometry_;
  const DType dt = backend_.compute_dtype();
  Tensor feat = backend_.empty({c, g.hidden}, dt);
  Tensor ctx = backend_.empty({c, g.hidden}, dt);
  backend_.linear(taps, fc_, feat);
  backend_.rms_norm(feat, hidden_norm_, g.eps, ctx);
  Tensor kv = backend_.empty({c, kv_stacked_.dim(0)}, dt);
  backend_.linear(ctx, kv_stacked_, kv);
  backend_.kv_norm_rope_write_layers(kv, k_norm_stacked_, g.eps, positions, inv_freq_, slots, pool);
}

Tensor DFlashDrafter::draft(const ForwardBatch& batch, KVPool& pool) {
  return draft(device_batch_upload(backend_, batch, /*causal=*/false), pool, DType::kF32);
}

AttentionMeta DFlashDrafter::layer_meta(const DeviceBatch& batch, size_t l) const {
  AttentionMeta meta = batch.meta;
  meta.causal = config_.layer_causal[l];
  meta.window = config_.sliding_window[l];
  meta.symmetric_window = !meta.causal && meta.window > 0;
  return meta;
}

Tensor DFlashDrafter::backbone(const DeviceBatch& batch, KVPool& pool) {
  const int64_t t = batch.num_tokens;
  const LayerGeometry& g = geometry_;
  const DType dt = backend_.compute_dtype();
  LayerScratch s(backend_, g, t);
  Tensor residual = backend_.empty({t, g.hidden}, dt);
  backend_.embedding(target_.embedding(), batch.token_ids, residual);
  for (size_t l = 0; l < layers_.size(); ++l) {
    decoder_layer_forward(backend_, layers_[l], g, batch.positions, inv_freq_, batch.slots, layer_meta(batch, l),
                          pool, static_cast<int64_t>(l), residual, s);
  }
  Tensor normed = backend_.empty({t, g.hidden}, dt);
  backend_.rms_norm(residual, norm_, g.eps, normed);
  return normed;
}

Tensor DFlashDrafter::draft(const DeviceBatch& batch, KVPool& pool, DType logits_dtype) {
  return lm_head_rows(backend_, target_.lm_head(), backbone(batch, pool), batch, logits_dtype);
}

Tensor DFlashDrafter::draft_logits(const DeviceBatch& batch, KVPool& pool) { return draft(batch, pool, DType::kF32); }

void DFlashDrafter::set_draft_head_fp8() {
  if (!fp8_head_.empty()) return;
  try {
    fp8_head_ = backend_.fp8_rows(target_.lm_head());
  } catch (const Error& e) {
    throw Error(detail::concat(config_.path, ": draft_head='fp8' cannot run on the ", backend_.name(),
                               " backend: ", e.what()));
  }
  weight_bytes_ += fp8_head_.nbytes();
}

Tensor DFlashDrafter::fp8_draft_logits(const DeviceBatch& batch, KVPool& pool) {
  Tensor logits = backend_.empty({batch.num_logit_rows(), target_.lm_head().dim(0)}, DType::kF32);
  backend_.linear_fp8(logit_row_states(backend_, backbone(batch, pool), batch), fp8_head_, logits);
  return logits;
}

void DFlashDrafter::set_probabilistic(bool on) {
  DFLASH_ARG_CHECK(!on || config_.arch == DraftArch::kDFlash, config_.path,
                   ": draft_sampling='probabilistic' applies to DFlash (v1) drafters; a DFlash2 drafter walks its "
                   "candidates (greedy at temperature 0, sampled above)");
  probabilistic_ = on;
}

void DFlashDrafter::propose(const DeviceBatch& batch, KVPool& pool, const Tensor& anchors, const Tensor& params,
                            DraftOutputs& out) {
  Tensor drafts = out.drafts.reshape({out.drafts.numel()});
  if (!probabilistic_) {
    backend_.argmax(fp8_head_.empty() ? draft(batch, pool, backend_.compute_dtype()) : fp8_draft_logits(batch, pool),
                    drafts);
    return;
  }
  const int64_t rows = batch.num_logit_rows(), n = rows / batch.meta.num_seqs;
  // The proposal q is the distribution the drafts are drawn from: the FP8 head's logits when it is on.
  Tensor logits = fp8_head_.empty() ? draft(batch, pool, DType::kF32) : fp8_draft_logits(batch, pool);
  DFLASH_CHECK(out.realized.numel() == logits.numel(), "probabilistic drafts: the proposal buffer holds ",
               out.realized.numel(), " values for ", shape_str(logits.shape), " logits");
  backend_.sample_drafts(logits, params, n, drafts);
  Tensor q = out.realized.reshape({rows, logits.dim(1)});
  backend_.copy_columns(logits, q, 0);
}

}  // namespace dflash
