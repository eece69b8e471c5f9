// DraftConfig: a DFlash drafter's config.json (architectures ["DFlashDraftModel"], a Qwen3
// geometry, block_size, dflash_config.target_layer_ids / mask_token_id), parsed and checked
// against its target with messages that name both files and the field.
#pragma once

#include <string>
#include <vector>

#include "config/model_config.h"

namespace dflash {

struct DraftConfig {
  ModelConfig geometry;            // hidden, heads, head_dim, intermediate, eps, rope (Qwen3)
  int64_t block_size = 16;
  int64_t num_target_layers = 0;
  std::vector<int> target_layer_ids;
  int64_t mask_token_id = -1;
  std::vector<int64_t> sliding_window;  // [num_layers] window per layer, 0 = full attention
  std::string path;                     // config.json path, for messages
};

// The published default tap selection when target_layer_ids is absent.
std::vector<int> build_target_layer_ids(int64_t num_target_layers, int64_t num_draft_layers);

// Parses draft_dir/config.json; throws dflash::Error naming the file and the field.
DraftConfig draft_config_load(const std::string& draft_dir);

// Checks that the drafter fits the target (fc width, vocabulary, mask id, head geometry,
// layer ids); the error names both config files and the field.
void draft_config_check_target(const DraftConfig& draft, const ModelConfig& target,
                               const std::string& target_dir);

}  // namespace dflash
