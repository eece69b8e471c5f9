// The DFlash2 drafter (z-lab DFlash2DraftModel checkpoints, unchanged): the DFlash backbone with
// a grouped dynamic depthwise conv around each attention and MLP sublayer (prepare on the
// normed input, finish on the sublayer's output, both sides' dynamic coefficients from one
// projection of the input; taps never cross a block), then the candidate selector: per slot
// the top-K of the target's LM head, edge scores between adjacent slots' candidates from two
// codebooks and a context gate, and the lattice walk (greedy, or Gumbel-sampled at T > 0 with
// the walked rows as the proposal q). It always runs whole: no path drafts without the conv or
// the selector. With the FP8 candidate head (set_draft_head_fp8) the K candidates of a slot are
// picked on an e4m3 copy of the LM head and re-scored on the exact head, so only the choice of
// candidates is approximate; the scores, the walk and verification are exact.
#pragma once

#include <string>
#include <vector>

#include "model/dflash_drafter.h"

namespace dflash {

class DFlash2Drafter : public DFlashDrafter {
 public:
  DFlash2Drafter(const DraftConfig& config, const std::string& draft_dir, Backend& backend,
                 const Transformer& target, const std::string& target_dir);

  ProposalKind proposal_kind() const override { return ProposalKind::kCandidates; }
  int64_t proposal_width() const override { return config_.dflash2.selector_top_k; }
  void propose(const DeviceBatch& batch, KVPool& pool, const Tensor& anchors, const Tensor& params,
               DraftOutputs& out) override;
  // draft_sampling="greedy": the argmax walk at every temperature, proposed one-hot (realized rows
  // 0 at the draft, -inf elsewhere), so T > 0 verification accepts a draft with p(draft).
  void set_greedy_walk(bool on) { greedy_walk_ = on; }

 protected:
  Tensor backbone(const DeviceBatch& batch, KVPool& pool) override;

 private:
  struct Conv {
    Tensor base;        // [2, T, H]
    Tensor projection;  // [2 T H / g, H]
  };
  struct LayerConvs {
    Conv attention, mlp;
  };
  // The conv around a sublayer: prepare(x) -> out, with both sides' deltas [N, 2 T G] from x;
  // residual += finish(y, deltas).
  void conv_prepare(const Conv& conv, const Tensor& x, int64_t block, Tensor& deltas, Tensor& out);
  void conv_finish_add(const Conv& conv, const Tensor& y, const Tensor& deltas, int64_t block, Tensor& residual);

  std::vector<LayerConvs> convs_;
  Tensor pred_codebook_;      // A [V, r]
  Tensor succ_codebook_;      // B [V, r]
  Tensor hidden_projection_;  // [r, H]
  bool greedy_walk_ = false;  // the argmax walk at every temperature (draft_sampling="greedy")
};

}  // namespace dflash
