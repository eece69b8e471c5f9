// Decoder layer weights, scratch and forward (see decoder_layer.h).
#include "model/decoder_layer.h"

#include <algorithm>

namespace dflash {

LayerGeometry layer_geometry(const ModelConfig& c) {
  LayerGeometry g;
  g.hidden = c.hidden_size;
  g.num_heads = c.num_heads;
  g.num_kv_heads = c.num_kv_heads;
  g.head_dim = c.head_dim;
  g.intermediate = c.intermediate_size;
  g.eps = static_cast<float>(c.rms_norm_eps);
  g.qk_norm = c.qk_norm;
  return g;
}

void layer_tensor_shapes(const std::string& p, const LayerGeometry& g, TensorShapes* out) {
  const int64_t h = g.hidden, hd = g.head_dim, nh = g.num_heads, nkv = g.num_kv_heads, inter = g.intermediate;
  TensorShapes& t = *out;
  t[p + "input_layernorm.weight"] = {h};
  t[p + "self_attn.q_proj.weight"] = {nh * hd, h};
  t[p + "self_attn.k_proj.weight"] = {nkv * hd, h};
  t[p + "self_attn.v_proj.weight"] = {nkv * hd, h};
  t[p + "self_attn.o_proj.weight"] = {h, nh * hd};
  if (g.qk_norm) {
    t[p + "self_attn.q_norm.weight"] = {hd};
    t[p + "self_attn.k_norm.weight"] = {hd};
  }
  t[p + "post_attention_layernorm.weight"] = {h};
  t[p + "mlp.gate_proj.weight"] = {inter, h};
  t[p + "mlp.up_proj.weight"] = {inter, h};
  t[p + "mlp.down_proj.weight"] = {h, inter};
}

Tensor weight_load(Backend& backend, const Checkpoint& ckpt, const std::string& name,
                   const std::vector<int64_t>& shape, size_t* bytes) {
  Tensor t = backend.weight({&ckpt.get(name, shape)});
  *bytes += t.nbytes();
  return t;
}

LayerWeights layer_weights_load(Backend& backend, const Checkpoint& ckpt, const std::string& p,
                                const LayerGeometry& g, size_t* bytes) {
  const int64_t h = g.hidden, hd = g.head_dim, nh = g.num_heads, nkv = g.num_kv_heads, inter = g.intermediate;
  auto load = [&](const std::vector<std::string>& names, const std::vector<std::vector<int64_t>>& shapes) {
    std::vector<const StoredTensor*> parts;
    for (size_t i = 0; i < names.size(); ++i) parts.push_back(&ckpt.get(p + names[i], shapes[i]));
    Tensor t = backend.weight(parts);
    *bytes += t.nbytes();
    return t;
  };
  LayerWeights w;
  w.input_norm = load({"input_layernorm.weight"}, {{h}});
  w.qkv = load({"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"},
               {{nh * hd, h}, {nkv * hd, h}, {nkv * hd, h}});
  if (g.qk_norm) {
    w.q_norm = load({"self_attn.q_norm.weight"}, {{hd}});
    w.k_norm = load({"self_attn.k_norm.weight"}, {{hd}});
  }
  w.o = load({"self_attn.o_proj.weight"}, {{h, nh * hd}});
  w.post_norm = load({"post_attention_layernorm.weight"}, {{h}});
  w.gate_up = load({"mlp.gate_proj.weight", "mlp.up_proj.weight"}, {{inter, h}, {inter, h}});
  w.down = load({"mlp.down_proj.weight"}, {{h, inter}});
  return w;
}

LayerScratch::LayerScratch(Backend& b, const LayerGeometry& g, int64_t t) {
  const DType dt = b.compute_dtype();
  normed = b.empty({t, g.hidden}, dt);
  qkv = b.empty({t, (g.num_heads + 2 * g.num_kv_heads) * g.head_dim}, dt);
  q = b.empty({t, g.num_heads, g.head_dim}, dt);
  k = b.empty({t, g.num_kv_heads, g.head_dim}, dt);
  v = b.empty({t, g.num_kv_heads, g.head_dim}, dt);
  attn = b.empty({t, g.num_heads, g.head_dim}, dt);
  proj = b.empty({t, g.hidden}, dt);
  gate_up = b.empty({t, 2 * g.intermediate}, dt);
  act = b.empty({t, g.intermediate}, dt);
}

// Weight prefetch hints (Backend::prefetch_weight), given before the latency-bound ops that
// precede each linear layer, sized by the memory time those ops leave idle on the H200 at
// batch 1 (bench/results/gpu_h200_step_profile*.json, launches timed without programmatic
// launch): the O projection's whole weight during RoPE + attention (~15 us, ~60 MB of
// bandwidth), a prefix for the layers behind a norm (~3 us: 12 MiB) or behind SiLU (~2 us: 8 MiB).
constexpr int64_t kPrefetchBehindNorm = int64_t{12} << 20;
constexpr int64_t kPrefetchBehindSilu = int64_t{8} << 20;

void decoder_layer_forward(Backend& b, const LayerWeights& w, const LayerGeometry& g, const Tensor& positions,
                           const Tensor& inv_freq, const Tensor& slots, const AttentionMeta& meta, KVPool& pool,
                           int64_t layer, Tensor& residual, LayerScratch& s) {
  const int64_t t = residual.dim(0);
  b.prefetch_weight(w.qkv, kPrefetchBehindNorm, LayerLinear::kQkv);
  b.rms_norm_linear(residual, w.input_norm, g.eps, w.qkv, s.qkv, s.normed);
  b.prefetch_weight(w.o, static_cast<int64_t>(w.o.nbytes()), LayerLinear::kO);
  b.rope_write_attention(s.qkv, w.q_norm, w.k_norm, g.eps, positions, inv_freq, slots, pool, layer, meta, s.q, s.k,
                         s.v, s.attn);
  b.linear_add(s.attn.reshape({t, g.num_heads * g.head_dim}), w.o, residual, s.proj);
  b.prefetch_weight(w.gate_up, kPrefetchBehindNorm, LayerLinear::kGateUp);
  b.rms_norm_linear(residual, w.post_norm, g.eps, w.gate_up, s.gate_up, s.normed);
  b.prefetch_weight(w.down, kPrefetchBehindSilu, LayerLinear::kDown);
  b.silu_mul_linear_add(s.gate_up, w.down, residual, s.act, s.proj);
}

AttentionMeta attention_meta_build(Backend& backend, const ForwardBatch& batch, bool causal) {
  AttentionMeta meta;
  meta.num_seqs = batch.num_seqs();
  meta.max_blocks_per_seq = batch.max_blocks_per_seq;
  meta.causal = causal;
  meta.query_start = backend.upload_i32(batch.query_start.data(), {meta.num_seqs + 1});
  meta.kv_len = backend.upload_i32(batch.kv_len.data(), {meta.num_seqs});
  meta.block_table = backend.upload_i32(batch.block_table.data(), {meta.num_seqs, batch.max_blocks_per_seq});
  for (int s = 0; s < meta.num_seqs; ++s) {
    meta.max_query_len = std::max(meta.max_query_len, batch.query_start[s + 1] - batch.query_start[s]);
    meta.max_kv_len = std::max(meta.max_kv_len, batch.kv_len[s]);
  }
  return meta;
}

DeviceBatch device_batch_upload(Backend& backend, const ForwardBatch& batch, bool causal) {
  DeviceBatch d;
  d.num_tokens = batch.num_tokens();
  d.token_ids = backend.upload_i32(batch.token_ids.data(), {d.num_tokens});
  d.positions = backend.upload_i32(batch.positions.data(), {d.num_tokens});
  d.slots = backend.upload_i32(batch.slots.data(), {d.num_tokens});
  d.meta = attention_meta_build(backend, batch, causal);
  const int64_t n = static_cast<int64_t>(batch.logit_rows.size());
  d.logit_rows = backend.upload_i32(batch.logit_rows.data(), {n});
  d.want_taps = batch.want_taps;
  return d;
}

}  // namespace dflash
