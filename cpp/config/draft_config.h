// DraftConfig: a drafter's config.json (architectures ["DFlashDraftModel"] or
// ["DFlash2DraftModel"], a Qwen3 geometry, block_size, dflash_config.target_layer_ids /
// mask_token_id, and for DFlash2 the conv and selector fields), parsed and checked against its
// target with messages that name both files and the field.
#pragma once

#include <string>
#include <vector>

#include "config/model_config.h"

namespace dflash {

enum class DraftArch { kDFlash, kDFlash2 };

// The DFlash2 additions (dflash_config of a DFlash2DraftModel).
struct DFlash2Config {
  int64_t conv_kernel_size = 0;         // taps T of the in-block conv (current + T-1 back)
  int64_t conv_group_size = 0;          // channels sharing one dynamic correction, g
  int64_t selector_rank = 0;            // codebook / context-gate rank r
  int64_t selector_top_k = 0;           // candidates per slot K
  double output_multiplier = 1.0;       // scale on the unary (candidate) logits
  double final_logit_softcapping = 0.0;  // tanh cap on the unary logits; 0: none
  double input_embedding_scale = 1.0;   // multiplies the block's token embeddings
};

struct DraftConfig {
  DraftArch arch = DraftArch::kDFlash;
  std::string arch_name;           // "DFlashDraftModel" / "DFlash2DraftModel"
  DFlash2Config dflash2;           // arch == kDFlash2 only
  ModelConfig geometry;            // hidden, heads, head_dim, intermediate, eps, rope (Qwen3)
  int64_t block_size = 16;
  int64_t num_target_layers = 0;
  std::vector<int> target_layer_ids;
  int64_t mask_token_id = -1;
  std::vector<int64_t> sliding_window;  // [num_layers] window per layer, 0 = full attention
  // [num_layers] whether the block attends causally. A top-level `is_causal` sets every layer;
  // without it sliding layers are causal and full layers are not (the rule of vLLM and SGLang).
  // A non-causal sliding layer is a symmetric window: |query - key| < window.
  std::vector<bool> layer_causal;
  std::string path;                     // config.json path, for messages
};

// The published default tap selection when target_layer_ids is absent.
std::vector<int> build_target_layer_ids(int64_t num_target_layers, int64_t num_draft_layers);

// Parses draft_dir/config.json; throws dflash::Error naming the file and the field.
DraftConfig draft_config_load(const std::string& draft_dir);
// The same from parsed JSON; `path` names the file in messages.
DraftConfig draft_config_from_json(const Json& j, const std::string& path);

// Checks that the drafter fits the target (fc width, vocabulary, mask id, head geometry,
// layer ids); the error names both config files and the field.
void draft_config_check_target(const DraftConfig& draft, const ModelConfig& target,
                               const std::string& target_dir);

}  // namespace dflash
