// The target model: a Llama / Qwen3 decoder (pre-norm, GQA, rotate-half RoPE, SwiGLU,
// optional QK-norm) written once against the Backend op interface. It reads its weights from
// a Checkpoint, keeps K/V in a paged KVPool, and can tap the hidden states (the outputs of
// chosen layers, HF hidden_states[id + 1], pre-final-norm) for a drafter.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "config/model_config.h"
#include "model/decoder_layer.h"
#include "model/forward_batch.h"
#include "weights/safetensors.h"

namespace dflash {

struct ForwardResult {
  Tensor logits;  // [N, V] fp32, rows of ForwardBatch::logit_rows
  Tensor taps;    // [T, num_taps * H] when want_taps, else empty
};

class Transformer {
 public:
  // tap_layers: layer indices whose outputs are tapped (may be empty).
  Transformer(const ModelConfig& config, const Checkpoint& ckpt, Backend& backend, std::vector<int> tap_layers);

  const ModelConfig& config() const { return config_; }
  const std::vector<int>& tap_layers() const { return tap_layers_; }
  const Tensor& embedding() const { return embed_; }  // [V, H]
  const Tensor& lm_head() const { return lm_head_; }  // [V, H]
  const Tensor& inv_freq() const { return inv_freq_; }
  // Bytes of weights held by the backend.
  size_t weight_bytes() const { return weight_bytes_; }
  // Creates a K/V pool of num_blocks blocks for this model.
  KVPool make_kv_pool(int64_t num_blocks, int64_t block_size) const;

  // A causal forward over the batch (uploaded first) / over a batch already on the backend.
  ForwardResult forward(const ForwardBatch& batch, KVPool& pool);
  ForwardResult forward(const DeviceBatch& batch, KVPool& pool);

 private:
  ModelConfig config_;
  LayerGeometry geometry_;
  Backend& backend_;
  std::vector<int> tap_layers_;
  Tensor embed_;       // [V, H]
  Tensor final_norm_;  // [H]
  Tensor lm_head_;     // [V, H] (the embedding when tied)
  Tensor inv_freq_;    // [hd / 2]
  std::vector<LayerWeights> layers_;
  size_t weight_bytes_ = 0;
};

// The tensors a target of this config uses, with their shapes (lm_head.weight only untied).
TensorShapes transformer_tensors(const ModelConfig& config);

// Checks that `ckpt` holds exactly the tensors of transformer_tensors(config) with their shapes:
// an unused tensor (a second layer when num_hidden_layers says 1, an lm_head of a tied model)
// or a missing or misshapen one is a dflash::Error naming it. Allocates nothing.
void transformer_check_checkpoint(const ModelConfig& config, const Checkpoint& ckpt);

// The normed rows [N, H] of batch.logit_rows (normed itself when the batch wants all rows).
Tensor logit_row_states(Backend& backend, const Tensor& normed, const DeviceBatch& batch);

// logits[N, V] (logits_dtype) = normed rows of batch.logit_rows (or all rows) @ lm_head[V, H]^T.
Tensor lm_head_rows(Backend& backend, const Tensor& lm_head, const Tensor& normed, const DeviceBatch& batch,
                    DType logits_dtype);

// A K/V pool for a stack of `num_layers` layers of geometry g.
KVPool kv_pool_create(Backend& backend, int64_t num_layers, const LayerGeometry& g, int64_t num_blocks,
                      int64_t block_size);

}  // namespace dflash
