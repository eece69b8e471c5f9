// The target model: a Llama / Qwen3 decoder (pre-norm, GQA, rotate-half RoPE, SwiGLU,
// optional QK-norm) written once against the Backend op interface. It reads its weights from
// a Checkpoint, keeps K/V in a paged KVPool, and can tap the hidden states (the outputs of
// chosen layers, HF hidden_states[id + 1]) for a drafter.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "config/model_config.h"
#include "model/forward_batch.h"
#include "weights/safetensors.h"

namespace dflash {

struct LayerWeights {
  Tensor input_norm;   // [H]
  Tensor qkv;          // [(nh + 2 nkv) hd, H]
  Tensor q_norm;       // [hd] (Qwen3) or empty
  Tensor k_norm;       // [hd] (Qwen3) or empty
  Tensor o;            // [H, nh hd]
  Tensor post_norm;    // [H]
  Tensor gate_up;      // [2 I, H]
  Tensor down;         // [H, I]
};

struct ForwardResult {
  Tensor logits;  // [N, V] fp32, rows of ForwardBatch::logit_rows
  Tensor taps;    // [T, num_taps * H] when want_taps, else empty
};

class Transformer {
 public:
  // tap_layers: layer indices whose outputs are tapped (may be empty).
  Transformer(const ModelConfig& config, const Checkpoint& ckpt, Backend& backend,
              std::vector<int> tap_layers);

  const ModelConfig& config() const { return config_; }
  const std::vector<int>& tap_layers() const { return tap_layers_; }
  // Bytes of weights held by the backend.
  size_t weight_bytes() const { return weight_bytes_; }
  // Creates a K/V pool of num_blocks blocks for this model.
  KVPool make_kv_pool(int64_t num_blocks, int64_t block_size) const;

  ForwardResult forward(const ForwardBatch& batch, KVPool& pool);

 private:
  Tensor load(const Checkpoint& ckpt, const std::string& name, std::vector<int64_t> shape);
  Tensor load_stacked(const Checkpoint& ckpt, const std::vector<std::string>& names,
                      const std::vector<std::vector<int64_t>>& shapes);

  ModelConfig config_;
  Backend& backend_;
  std::vector<int> tap_layers_;
  Tensor embed_;       // [V, H]
  Tensor final_norm_;  // [H]
  Tensor lm_head_;     // [V, H] (the embedding when tied)
  Tensor inv_freq_;    // [hd / 2]
  std::vector<LayerWeights> layers_;
  size_t weight_bytes_ = 0;
};

}  // namespace dflash
