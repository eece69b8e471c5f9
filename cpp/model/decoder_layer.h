// One pre-norm Llama/Qwen3 decoder layer (attention with optional QK-norm and rotate-half
// RoPE over the paged KV cache, then a SwiGLU MLP), shared by the target and the DFlash
// drafter. Weights are stored fused: QKV stacked [(nh + 2 nkv) hd, H], gate/up stacked [2 I, H].
#pragma once

#include <string>

#include "backend/backend.h"
#include "config/model_config.h"
#include "model/forward_batch.h"
#include "weights/safetensors.h"

namespace dflash {

struct LayerGeometry {
  int64_t hidden = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, intermediate = 0;
  float eps = 1e-6f;
  bool qk_norm = false;
};

LayerGeometry layer_geometry(const ModelConfig& c);

struct LayerWeights {
  Tensor input_norm;  // [H]
  Tensor qkv;         // [(nh + 2 nkv) hd, H]
  Tensor q_norm;      // [hd] or empty
  Tensor k_norm;      // [hd] or empty
  Tensor o;           // [H, nh hd]
  Tensor post_norm;   // [H]
  Tensor gate_up;     // [2 I, H]
  Tensor down;        // [H, I]

  // The K/V rows of the fused QKV weight: [2 nkv hd, H] (a view, no copy).
  Tensor kv_weight(const LayerGeometry& g) const { return qkv.rows(g.num_heads * g.head_dim, qkv.dim(0)); }
};

// Adds the tensors of one layer, `prefix` + {input_layernorm, self_attn.{q,k,v,o}_proj,
// self_attn.{q,k}_norm (QK-norm only), post_attention_layernorm, mlp.*}.weight, with their shapes.
void layer_tensor_shapes(const std::string& prefix, const LayerGeometry& g, TensorShapes* out);

// Uploads one stored tensor (shape-checked) in the compute dtype; adds its bytes to *bytes.
Tensor weight_load(Backend& backend, const Checkpoint& ckpt, const std::string& name,
                   const std::vector<int64_t>& shape, size_t* bytes);

// Loads `prefix` + {input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}.weight with
// shape checks; adds the bytes uploaded to *bytes.
LayerWeights layer_weights_load(Backend& backend, const Checkpoint& ckpt, const std::string& prefix,
                                const LayerGeometry& g, size_t* bytes);

// Scratch activations of a forward over `tokens` rows.
struct LayerScratch {
  Tensor normed, qkv, q, k, v, attn, proj, gate_up, act;
  LayerScratch(Backend& backend, const LayerGeometry& g, int64_t tokens);
};

// Runs one layer on the residual stream [T, H], updated in place: on return it is the layer's
// output. The attention and MLP outputs are added by the linear layers themselves
// (Backend::linear_add / silu_mul_linear_add), the norms run with the linear layers they feed
// (Backend::rms_norm_linear), so a backend can fuse each group into one kernel.
void decoder_layer_forward(Backend& backend, const LayerWeights& w, const LayerGeometry& g, const Tensor& positions,
                           const Tensor& inv_freq, const Tensor& slots, const AttentionMeta& meta, KVPool& pool,
                           int64_t layer, Tensor& residual, LayerScratch& s);

// AttentionMeta of a ForwardBatch, uploaded to the backend.
AttentionMeta attention_meta_build(Backend& backend, const ForwardBatch& batch, bool causal);

// A ForwardBatch uploaded to the backend (per-step scratch).
DeviceBatch device_batch_upload(Backend& backend, const ForwardBatch& batch, bool causal);

}  // namespace dflash
