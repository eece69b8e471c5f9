// The DFlash drafter (z-lab DFlashDraftModel checkpoints, unchanged): fc + hidden_norm turn
// the target's tapped hidden states into context features; every drafter layer projects them
// with its own k_proj/v_proj/k_norm/RoPE into its paged KV cache (append-only, "KV injection");
// a draft is one non-causal forward over the block [anchor, MASK x n] whose final-normed states
// at block positions 1..n go through the target's lm_head. Embedding and lm_head are the
// target's.
#pragma once

#include <string>
#include <vector>

#include "backend/backend.h"
#include "config/draft_config.h"
#include "model/decoder_layer.h"
#include "model/drafter.h"
#include "model/forward_batch.h"
#include "model/transformer.h"

namespace dflash {

class DFlashDrafter : public Drafter {
 public:
  // Loads draft_dir/model.safetensors; checks it against the target (errors name both). Every
  // tensor of the checkpoint must be one config.arch uses (derived drafters load the rest).
  DFlashDrafter(const DraftConfig& config, const std::string& draft_dir, Backend& backend,
                const Transformer& target, const std::string& target_dir);

  const DraftConfig& config() const override { return config_; }
  size_t weight_bytes() const override { return weight_bytes_; }
  KVPool make_kv_pool(int64_t num_blocks, int64_t block_size) const override;

  void update_context(const Tensor& taps, const std::vector<int32_t>& positions,
                      const std::vector<int32_t>& slots, KVPool& pool) override;
  // One GEMM for fc, one for the stacked K/V of all layers, one fused norm/RoPE/write kernel.
  void update_context(const Tensor& taps, const Tensor& positions, const Tensor& slots, KVPool& pool) override;

  // Drafts: the argmax of each draft logit row (computed in the compute dtype); with
  // probabilistic drafts, a draw from softmax(logits / T) per draft at T > 0 (on its own random
  // stream), the logits [R, n, V] being the proposal (ProposalKind::kDense).
  void set_probabilistic(bool on);
  // draft_head="fp8": builds the FP8 copy of the target's LM head once (counted in
  // weight_bytes()). DFlash drafts are then taken from the logits of that copy (their argmax, or
  // with probabilistic drafts the draw and its proposal rows, which stay the distribution the
  // draft was drawn from, so verification is exact either way); DFlash2 picks its candidates on
  // it and re-scores them on the exact head. draft_logits() stays on the exact head. Throws
  // Error, naming this drafter and the backend, when the backend cannot run the FP8 head.
  void set_draft_head_fp8();
  ProposalKind proposal_kind() const override { return probabilistic_ ? ProposalKind::kDense : ProposalKind::kOneHot; }
  int64_t proposal_width() const override { return probabilistic_ ? target_.config().vocab_size : 0; }
  void propose(const DeviceBatch& batch, KVPool& pool, const Tensor& anchors, const Tensor& params,
               DraftOutputs& out) override;
  Tensor draft_logits(const DeviceBatch& batch, KVPool& pool) override;

  // One draft forward over a host batch (see Drafter::propose for its layout): the logits
  // [logit_rows, V] (fp32).
  Tensor draft(const ForwardBatch& batch, KVPool& pool);
  // The same over a batch on the backend; logits in logits_dtype.
  Tensor draft(const DeviceBatch& batch, KVPool& pool, DType logits_dtype);

 protected:
  // The backbone over the batch's blocks: the final-normed hidden states [T, H].
  virtual Tensor backbone(const DeviceBatch& batch, KVPool& pool);
  // The attention mask of layer l within the batch's metadata.
  AttentionMeta layer_meta(const DeviceBatch& batch, size_t l) const;
  // The draft rows' logits [logit_rows, V] (fp32) on the FP8 head (set_draft_head_fp8).
  Tensor fp8_draft_logits(const DeviceBatch& batch, KVPool& pool);

  DraftConfig config_;
  LayerGeometry geometry_;
  Backend& backend_;
  const Transformer& target_;
  Tensor fc_;           // [H, num_taps * target_hidden]
  Tensor hidden_norm_;  // [H]
  Tensor norm_;         // [H]
  Tensor inv_freq_;     // [hd / 2]
  std::vector<LayerWeights> layers_;
  Tensor kv_stacked_;      // [L * 2 nkv hd, H]: per layer k_proj then v_proj
  Tensor k_norm_stacked_;  // [L * hd] or empty
  size_t weight_bytes_ = 0;
  bool probabilistic_ = false;
  Fp8Weight fp8_head_;  // the LM head's FP8 copy [V, H] (empty: drafts on the exact head)
};

}  // namespace dflash
