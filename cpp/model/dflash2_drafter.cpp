// DFlash2 drafter: conv weights, the backbone with convs (spec placement: prepare before
// attention / MLP on the normed input, finish on the sublayer's output before the residual add),
// and the candidate selector (top-K on the exact LM head, or on its FP8 copy followed by an
// exact re-score; edge scores; walk).
#include "model/dflash2_drafter.h"

namespace dflash {

DFlash2Drafter::DFlash2Drafter(const DraftConfig& config, const std::string& draft_dir, Backend& backend,
                               const Transformer& target, const std::string& target_dir)
    : DFlashDrafter(config, draft_dir, backend, target, target_dir) {
  DFLASH_CHECK(config_.arch == DraftArch::kDFlash2, config_.path, ": not a DFlash2DraftModel");
  const DFlash2Config& c = config_.dflash2;
  const int64_t h = geometry_.hidden, taps = c.conv_kernel_size, groups = h / c.conv_group_size;
  const int64_t vocab = target.config().vocab_size, rank = c.selector_rank;
  try {
    backend.dflash2_check_limits(c.selector_top_k, rank, taps, vocab);
  } catch (const Error& e) {
    throw Error(detail::concat(config_.path, ": this DFlash2 drafter cannot run on the ", backend.name(),
                               " backend: ", e.what()));
  }
  Checkpoint ckpt(draft_dir);
  auto load = [&](const std::string& name, std::vector<int64_t> shape) {
    return weight_load(backend_, ckpt, name, shape, &weight_bytes_);
  };
  for (int64_t l = 0; l < config_.geometry.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    LayerConvs lc;
    lc.attention.base = load(p + "attention_conv.base_kernel", {2, taps, h});
    lc.attention.projection = load(p + "attention_conv.kernel_projection.weight", {2 * taps * groups, h});
    lc.mlp.base = load(p + "mlp_conv.base_kernel", {2, taps, h});
    lc.mlp.projection = load(p + "mlp_conv.kernel_projection.weight", {2 * taps * groups, h});
    convs_.push_back(lc);
  }
  pred_codebook_ = load("candidate_selector.predecessor_codebook", {vocab, rank});
  succ_codebook_ = load("candidate_selector.successor_codebook", {vocab, rank});
  hidden_projection_ = load("candidate_selector.hidden_projection.weight", {rank, h});
}

void DFlash2Drafter::conv_prepare(const Conv& conv, const Tensor& x, int64_t block, Tensor& deltas, Tensor& out) {
  backend_.linear(x, conv.projection, deltas);
  backend_.grouped_conv(x, conv.base, deltas, 0, block, config_.dflash2.conv_group_size, /*accumulate=*/false, out);
}

void DFlash2Drafter::conv_finish_add(const Conv& conv, const Tensor& y, const Tensor& deltas, int64_t block,
                                     Tensor& residual) {
  backend_.grouped_conv(y, conv.base, deltas, 1, block, config_.dflash2.conv_group_size, /*accumulate=*/true,
                        residual);
}

Tensor DFlash2Drafter::backbone(const DeviceBatch& batch, KVPool& pool) {
  const int64_t t = batch.num_tokens, r = batch.meta.num_seqs;
  DFLASH_CHECK(r >= 1 && t % r == 0, "DFlash2 draft: ", t, " rows are not whole blocks of ", r, " requests");
  const int64_t block = t / r;  // [anchor, MASK x n] per request, contiguous
  const LayerGeometry& g = geometry_;
  const DType dt = backend_.compute_dtype();
  const int64_t h = g.hidden, nh = g.num_heads, hd = g.head_dim;
  const int64_t width = 2 * config_.dflash2.conv_kernel_size * (h / config_.dflash2.conv_group_size);
  LayerScratch s(backend_, g, t);
  Tensor residual = backend_.empty({t, h}, dt);
  Tensor conv_in = backend_.empty({t, h}, dt);
  Tensor deltas = backend_.empty({t, width}, dt);
  backend_.embedding(target_.embedding(), batch.token_ids, residual);
  if (config_.dflash2.input_embedding_scale != 1.0) {
    backend_.scale(residual, static_cast<float>(config_.dflash2.input_embedding_scale));
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerWeights& w = layers_[l];
    const LayerConvs& c = convs_[l];
    // h = h + finish(attn(prepare(norm(h))))
    backend_.rms_norm(residual, w.input_norm, g.eps, s.normed);
    conv_prepare(c.attention, s.normed, block, deltas, conv_in);
    backend_.linear(conv_in, w.qkv, s.qkv);
    backend_.rope_write_attention(s.qkv, w.q_norm, w.k_norm, g.eps, batch.positions, inv_freq_, batch.slots, pool,
                                  static_cast<int64_t>(l), layer_meta(batch, l), s.q, s.k, s.v, s.attn);
    backend_.linear(s.attn.reshape({t, nh * hd}), w.o, s.proj);
    conv_finish_add(c.attention, s.proj, deltas, block, residual);
    // h = h + finish(mlp(prepare(norm(h))))
    backend_.rms_norm(residual, w.post_norm, g.eps, s.normed);
    conv_prepare(c.mlp, s.normed, block, deltas, conv_in);
    backend_.linear(conv_in, w.gate_up, s.gate_up);
    backend_.silu_mul(s.gate_up, s.act);
    backend_.linear(s.act, w.down, s.proj);
    conv_finish_add(c.mlp, s.proj, deltas, block, residual);
  }
  Tensor normed = backend_.empty({t, h}, dt);
  backend_.rms_norm(residual, norm_, g.eps, normed);
  return normed;
}

void DFlash2Drafter::propose(const DeviceBatch& batch, KVPool& pool, const Tensor& anchors, const Tensor& params,
                             DraftOutputs& out) {
  const DFlash2Config& c = config_.dflash2;
  const int64_t r = batch.meta.num_seqs, rows = batch.num_logit_rows(), n = rows / r, k = c.selector_top_k;
  DFLASH_CHECK(rows == r * n && out.drafts.numel() == rows && out.cand_ids.numel() == rows * k &&
                   out.realized.numel() == rows * k,
               "DFlash2 propose: ", rows, " draft rows for ", r, " requests, outputs drafts ",
               shape_str(out.drafts.shape), " cand_ids ", shape_str(out.cand_ids.shape));
  Tensor picked = logit_row_states(backend_, backbone(batch, pool), batch);
  // Candidates: top-K of the target's LM head per slot; unary = the K values scaled and capped.
  const float multiplier = static_cast<float>(c.output_multiplier);
  const float softcap = static_cast<float>(c.final_logit_softcapping);
  Tensor logits = backend_.empty({rows, target_.lm_head().dim(0)}, DType::kF32);
  Tensor ids = out.cand_ids.reshape({r, n, k});
  Tensor unary = !out.unary.shape.empty() ? out.unary : backend_.empty({rows, k}, DType::kF32);
  Tensor flat_ids = ids.reshape({rows, k});
  if (fp8_head_.empty()) {
    backend_.linear(picked, target_.lm_head(), logits);
    backend_.topk_candidates(logits, k, multiplier, softcap, flat_ids, unary);
  } else {
    // The FP8 head picks the K ids (its values are dropped: multiplier 1, no cap); the exact head
    // re-scores and re-sorts them.
    backend_.linear_fp8(picked, fp8_head_, logits);
    backend_.topk_candidates(logits, k, 1.0f, 0.0f, flat_ids, unary);
    backend_.rescore_candidates(picked, target_.lm_head(), multiplier, softcap, flat_ids, unary);
  }
  // Edges from the context gate at each slot, then the walk.
  Tensor gate = backend_.empty({rows, c.selector_rank}, DType::kF32);
  backend_.linear(picked, hidden_projection_, gate);
  Tensor edges = !out.edges.shape.empty() ? out.edges : backend_.empty({r, n, k, k}, DType::kF32);
  backend_.edge_scores(ids, unary.reshape({r, n, k}), gate.reshape({r, n, c.selector_rank}), anchors,
                       pred_codebook_, succ_codebook_, edges);
  backend_.lattice_walk(edges, ids, params, greedy_walk_, out.drafts, out.realized);
}

}  // namespace dflash
