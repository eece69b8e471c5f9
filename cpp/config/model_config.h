// ModelConfig: the target model's config.json (LlamaForCausalLM, Qwen3ForCausalLM) parsed into
// a struct and validated with messages that name the field. Also the RoPE inverse frequencies
// for the supported rope types (default, linear, llama3).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/json_util.h"

namespace dflash {

enum class Architecture { kLlama, kQwen3 };

// The largest dimensions a config may declare (far beyond real models: hidden 16384, 128k-262k
// vocabulary, 126 layers, head_dim 256); with them every derived size fits in 64 bits.
constexpr int64_t kMaxModelWidth = int64_t{1} << 20;  // hidden_size, intermediate_size
constexpr int64_t kMaxModelVocab = int64_t{1} << 24;
constexpr int64_t kMaxModelLayers = 4096;
constexpr int64_t kMaxModelHeads = 4096;
constexpr int64_t kMaxModelHeadDim = 4096;

struct RopeConfig {
  std::string type = "default";  // "default", "linear" or "llama3"
  double theta = 10000.0;
  double factor = 1.0;                       // linear, llama3
  double low_freq_factor = 1.0;              // llama3
  double high_freq_factor = 4.0;             // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3
};

struct ModelConfig {
  Architecture arch = Architecture::kLlama;
  std::string arch_name;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  bool qk_norm = false;  // Qwen3
  RopeConfig rope;
  std::vector<int64_t> eos_token_ids;  // config.json + generation_config.json
  int64_t bos_token_id = -1;

  // RoPE inverse frequencies [head_dim / 2] in fp32, as transformers computes them.
  std::vector<float> rope_inv_freq() const;
};

// Parses `model_dir`/config.json (and generation_config.json for EOS ids if present).
// Throws dflash::Error naming the file and the field on anything missing or unsupported.
ModelConfig model_config_load(const std::string& model_dir);
ModelConfig model_config_from_json(const Json& j, const std::string& what);

}  // namespace dflash
