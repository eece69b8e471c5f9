// The op interface that model code is written against. One implementation per device:
// cpu/ (the fp32 reference ops) and cuda/ (bf16 kernels, cuBLASLt, AOT Triton). Tensors passed
// in are contiguous and live on the backend's device. Ops never allocate except `empty` and the
// upload helpers, so a CUDA backend can capture steps into graphs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/sample_row.h"
#include "common/tensor.h"
#include "dflash/kernel_options.h"
#include "weights/safetensors.h"

namespace dflash {

// Metadata of one batch of paged attention. Sequence s owns query rows
// [query_start[s], query_start[s+1]); its queries sit at the LAST positions of its kv_len keys
// (kv_len[s] - num_queries + i), which is the causal query offset; with causal=false every
// query sees all kv_len[s] keys (the drafter's block attention).
struct AttentionMeta {
  int num_seqs = 0;
  int max_blocks_per_seq = 0;
  int max_query_len = 0;
  int max_kv_len = 0;
  bool causal = true;
  int64_t window = 0;  // > 0: causal, and a query at p sees keys p - window < j <= p (sliding)
  // With window > 0: a non-causal (symmetric) window instead, keys with |p - j| < window
  // (DFlash2's sliding layers with is_causal false). Both backends (CUDA: the Triton and CUDA
  // decode attention kernels).
  bool symmetric_window = false;
  Tensor query_start;  // [num_seqs + 1] int32
  Tensor kv_len;       // [num_seqs] int32
  Tensor block_table;  // [num_seqs, max_blocks_per_seq] int32 block ids
};

// A paged K/V pool for all layers of one model.
struct KVPool {
  int64_t num_layers = 0, num_blocks = 0, block_size = 0, num_kv_heads = 0, head_dim = 0;
  Tensor k;  // [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
  Tensor v;  // same
};

// An FP8 (e4m3) copy of a weight w [V, H] with one fp32 scale per row (DFlash2's candidate
// head): scale[v] = max_k |w[v, k]| / 448 (1 for an all-zero row), q[v, k] = e4m3(w[v, k] /
// scale[v]) rounded to nearest even and saturated at +-448; w[v, k] ~ scale[v] * q[v, k].
struct Fp8Weight {
  Tensor q;      // [V, H] kU8, e4m3 bytes
  Tensor scale;  // [V] fp32
  bool empty() const { return q.empty(); }
  size_t nbytes() const { return q.nbytes() + scale.nbytes(); }
};

// A pipelined speculative step's inputs and the outputs of the step before it, all device int32
// tensors (Backend::feed_spec_inputs). b requests of q = n + 1 rows each.
struct SpecStepFeed {
  Tensor feed;          // [b] the row of the step before that each request continues, or -1
  Tensor num_accepted;  // the step before's outputs: [>= feed rows] accepted drafts
  Tensor next_token;    // [>= feed rows] its bonus / correction token
  Tensor block_table;   // [b, width] block ids
  Tensor ids, verify_ids, positions, slots;  // [b * q]
  Tensor kv_len, anchors;                    // [b]
  Tensor params;                             // [b] SampleRow (kU8, b * sizeof(SampleRow) bytes)
  int64_t rows_per_request = 1, block_size = 1;
};

// The linear layers of a decoder layer, named in weight prefetch hints (Backend::prefetch_weight).
enum class LayerLinear { kQkv, kO, kGateUp, kDown };

// A captured sequence of backend ops (a CUDA graph), replayed with `Backend::graph_launch`.
class CapturedGraph {
 public:
  virtual ~CapturedGraph() = default;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual DeviceKind kind() const = 0;
  virtual std::string name() const = 0;
  virtual DType compute_dtype() const = 0;

  // Memory. `empty` contents are unspecified.
  virtual Tensor empty(const std::vector<int64_t>& shape, DType dtype) = 0;
  virtual Tensor zeros(const std::vector<int64_t>& shape, DType dtype) = 0;
  // A weight uploaded once in the compute dtype; several stored tensors are stacked along
  // dim 0 (fused QKV, fused gate/up).
  virtual Tensor weight(const std::vector<const StoredTensor*>& parts) = 0;
  virtual Tensor upload_f32(const float* host, const std::vector<int64_t>& shape) = 0;
  virtual Tensor upload_i32(const int32_t* host, const std::vector<int64_t>& shape) = 0;
  virtual void download_f32(const Tensor& t, float* host) = 0;
  virtual void synchronize() = 0;
  // Starts a step: per-step scratch memory is reused from here (CUDA arena).
  virtual void begin_step() {}
  // Free and total device memory; false for the host.
  virtual bool device_memory(size_t* free_bytes, size_t* total_bytes) const { return false; }
  // Bytes of workspaces allocated up front (scratch arena, GEMM workspace).
  virtual size_t workspace_bytes() const { return 0; }

  // out[T, H] = table[ids[T], :]
  virtual void embedding(const Tensor& table, const Tensor& ids, Tensor& out) = 0;
  // out[T, H] = rmsnorm(x[T, H]) * w[H]
  virtual void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) = 0;
  // residual[T, H] += x[T, H]; out = rmsnorm(residual) * w
  virtual void add_rms_norm(Tensor& residual, const Tensor& x, const Tensor& w, float eps,
                            Tensor& out) = 0;
  // out[T, N] = x[T, K] @ w[N, K]^T
  virtual void linear(const Tensor& x, const Tensor& w, Tensor& out) = 0;
  // out[T, I] = silu(gate_up[T, :I]) * gate_up[T, I:]
  virtual void silu_mul(const Tensor& gate_up, Tensor& out) = 0;
  // out[T, H] = a[T, H] + b[T, H]  (out may be a)
  virtual void add(const Tensor& a, const Tensor& b, Tensor& out) = 0;

  // A hint that the first `bytes` of weight w are read soon, by the decoder layer's linear layer
  // `which`: a backend with a cache between memory and the cores may start loading them now,
  // while the latency-bound ops before that layer leave memory idle. Changes no result; the
  // default ignores it.
  virtual void prefetch_weight(const Tensor& w, int64_t bytes, LayerLinear which) {}

  // The linear layers of a decoder layer with their neighbours, which a backend may fuse (the
  // defaults compose the ops above; `normed`, `act` and `proj` are scratch of the unfused form):
  // out[T, N] = (rmsnorm(x[T, K]) * norm_w[K]) @ w[N, K]^T
  virtual void rms_norm_linear(const Tensor& x, const Tensor& norm_w, float eps, const Tensor& w, Tensor& out,
                               Tensor& normed) {
    rms_norm(x, norm_w, eps, normed);
    linear(normed, w, out);
  }
  // residual[T, N] += x[T, K] @ w[N, K]^T
  virtual void linear_add(const Tensor& x, const Tensor& w, Tensor& residual, Tensor& proj) {
    linear(x, w, proj);
    add(residual, proj, residual);
  }
  // residual[T, N] += (silu(gate_up[T, :I]) * gate_up[T, I:]) @ w[N, I]^T
  virtual void silu_mul_linear_add(const Tensor& gate_up, const Tensor& w, Tensor& residual, Tensor& act,
                                   Tensor& proj) {
    silu_mul(gate_up, act);
    linear_add(act, w, residual, proj);
  }
  // Splits qkv[T, (nh + 2 nkv) hd] into q[T, nh, hd], k[T, nkv, hd], v[T, nkv, hd]; applies the
  // per-head RMSNorm to q and k when q_norm/k_norm [hd] are non-empty (Qwen3), then
  // rotate-half RoPE at positions[T] with inv_freq[hd/2] and the attention scaling factor.
  virtual void qkv_norm_rope(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm,
                             float eps, const Tensor& positions, const Tensor& inv_freq,
                             float rope_scale, Tensor& q, Tensor& k, Tensor& v) = 0;
  // qkv_norm_rope with K and V written straight into pool layer `layer` at slots[T] (k, v are
  // scratch the backend may use or not).
  virtual void qkv_norm_rope_write(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, float eps,
                                   const Tensor& positions, const Tensor& inv_freq, const Tensor& slots, Tensor& q,
                                   Tensor& k, Tensor& v, KVPool& pool, int64_t layer) {
    qkv_norm_rope(qkv, q_norm, k_norm, eps, positions, inv_freq, 1.0f, q, k, v);
    kv_write(pool, layer, k, v, slots);
  }
  // pool.{k,v}[layer] at slots[T] (block * block_size + offset) = k[T], v[T]
  virtual void kv_write(KVPool& pool, int64_t layer, const Tensor& k, const Tensor& v,
                        const Tensor& slots) = 0;
  // out[T, nh * hd] = softmax(q k^T / sqrt(hd)) v over the paged keys of each sequence.
  virtual void paged_attention(const Tensor& q, const KVPool& pool, int64_t layer,
                               const AttentionMeta& meta, Tensor& out) = 0;
  // qkv_norm_rope_write into pool layer `layer`, then paged_attention of that layer over q with
  // meta (q, k, v are the scratch of this unfused form): a backend may fuse the two (CUDA: the
  // decode kernel's prologue, KernelOptions::rope_attention). Token t of qkv must be the key at
  // position kv_len - num_q + i of its sequence (i its index among the sequence's queries), as
  // in every ragged batch.
  virtual void rope_write_attention(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, float eps,
                                    const Tensor& positions, const Tensor& inv_freq, const Tensor& slots,
                                    KVPool& pool, int64_t layer, const AttentionMeta& meta, Tensor& q, Tensor& k,
                                    Tensor& v, Tensor& out) {
    qkv_norm_rope_write(qkv, q_norm, k_norm, eps, positions, inv_freq, slots, q, k, v, pool, layer);
    paged_attention(q, pool, layer, meta, out);
  }
  // dst[T, col:col + C] = src[T, C]   (dst is [T, W], row-major)
  virtual void copy_columns(const Tensor& src, Tensor& dst, int64_t col) = 0;
  // out[R, H] = x[rows[R], :]
  virtual void gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) = 0;
  // Samples one token per row of logits[R, V] (fp32) into tokens_out (host, R entries).
  virtual void sample(const Tensor& logits, const std::vector<SampleRow>& rows,
                      int32_t* tokens_out) = 0;

  // --- Device-side steps (no host round trip; usable inside captured graphs) ---
  // out[R] = argmax of each row of logits[R, V] (fp32 or the compute dtype), lowest id on ties.
  virtual void argmax(const Tensor& logits, Tensor& out) = 0;
  // flags[R] (int32) = 1 where row r of logits[R, V] (fp32) holds a NaN or an infinity, else 0
  // (the engine ends such a row's request with finish_reason "error" instead of sampling it).
  virtual void nonfinite_rows(const Tensor& logits, Tensor& flags) = 0;
  // tokens[R] (device int32) = one token per row of logits[R, V] (fp32) with the packed
  // params[R] (SampleRow); the same draws as `sample`.
  virtual void sample_rows(const Tensor& logits, const Tensor& params, Tensor& tokens) = 0;
  // Acceptance of drafts[R, n] against logits[R, n + 1, V] (fp32) with params[R] (position =
  // the first draft's): num_accepted[R] and next_token[R] (backend/cpu/host_acceptance.h semantics).
  virtual void accept(const Tensor& drafts, const Tensor& logits, const Tensor& params, Tensor& num_accepted,
                      Tensor& next_token) = 0;
  // Per request r: drafts[r] = use_override[r] ? override[r] : proposed[r] (each [n]), and
  // verify_ids[r, 1 + j] = drafts[r, j] (verify_ids[r, 0], the anchor, is left as it is).
  virtual void assemble_drafts(const Tensor& proposed, const Tensor& override_drafts, const Tensor& use_override,
                               Tensor& drafts, Tensor& verify_ids) = 0;
  // The drafter's context path for all L layers at once: kv[C, L * 2 * nkv * hd] (per layer K
  // then V, as the stacked K/V GEMM writes it); K gets the per-head RMSNorm with
  // k_norm[L * hd] (empty: none) and RoPE at positions[C]; K and V go to pool layer l at
  // slots[C] (negative slots are skipped).
  virtual void kv_norm_rope_write_layers(const Tensor& kv, const Tensor& k_norm, float eps, const Tensor& positions,
                                         const Tensor& inv_freq, const Tensor& slots, KVPool& pool) = 0;

  // ids[R] (int32): ids[i] = feed[i] >= 0 ? prev[feed[i]] : ids[i]  (pipelined decode: the
  // anchors of a step launched before the host has read the previous step's tokens prev[])
  virtual void feed_tokens(Tensor& ids, const Tensor& feed, const Tensor& prev) = 0;
  // Pipelined speculative decode: a step launched before the host has read the acceptance of the
  // step before it was staged as if that step had accepted nothing and emitted no token (its
  // request's rows at positions q0 + j). Request r with f = feed[r] >= 0 moves on by shift =
  // num_accepted[f] + 1: positions[r q + j] += shift, kv_len[r] += shift, params[r].position +=
  // shift, slots[r q + j] = the slot of the new position in block_table[r] (block_size), and
  // anchors[r] = ids[r q] = verify_ids[r q] = next_token[f]. Requests with feed[r] < 0 are left
  // as staged.
  virtual void feed_spec_inputs(SpecStepFeed& f) = 0;
  // t = 0, every byte (an int32 output a program must leave at zero; usable in captured graphs).
  virtual void clear(Tensor& t) = 0;

  // --- DFlash2 candidate drafting and proposal-aware acceptance (CPU: fp32 host functions of
  // cpu/host_candidates.h; CUDA: the kernels of cuda/ and the Triton walk). Defaults throw,
  // naming the backend. ---
  // Throws Error (the message names what is over which limit) when this backend's DFlash2 kernels
  // cannot run a drafter of top_k candidates, selector rank `rank`, conv taps `taps` over a
  // vocabulary of `vocab`; a checkpoint is refused at load, never truncated.
  virtual void dflash2_check_limits(int64_t top_k, int64_t rank, int64_t taps, int64_t vocab) const {}
  // x[...] *= factor (in place)
  virtual void scale(Tensor& x, float factor) { unsupported("scale"); }
  // One side s (0 = prepare, 1 = finish) of the grouped dynamic depthwise conv over contiguous
  // blocks of `block` rows, G = H / group:
  //   out[i, c] = sum_t (base[s, t, c] + deltas[i, (s * T + t) * G + c / group]) * x[i - t, c]
  //               * [(i mod block) >= t]
  // x[N, H], base[2, T, H], deltas[N, 2 * T * G] (the sublayer input's kernel projection), out[N, H]
  // (out must not alias x); accumulate: out[i, c] += the sum instead (a residual stream).
  virtual void grouped_conv(const Tensor& x, const Tensor& base, const Tensor& deltas, int64_t side,
                            int64_t block, int64_t group, bool accumulate, Tensor& out) {
    unsupported("grouped_conv");
  }
  // Per row of logits[R, V]: the K largest values, sorted descending, lowest id first on ties;
  // NaN ranks below every number (a row with fewer than K numbers fills up with its NaN ids,
  // lowest first, valued -inf): ids[R, K] int32, unary[R, K] fp32 = v * multiplier, then
  // softcap * tanh(. / softcap) when softcap > 0.
  virtual void topk_candidates(const Tensor& logits, int64_t k, float multiplier, float softcap, Tensor& ids,
                               Tensor& unary) {
    unsupported("topk_candidates");
  }
  // The FP8 candidate head (draft_head="fp8"): fp8_rows makes the FP8 copy of a weight w [V, H]
  // (Fp8Weight above) once, at load, allocated like a weight; a shape this backend's FP8 kernel
  // cannot run is refused here with the reason (Error).
  virtual Fp8Weight fp8_rows(const Tensor& w) { unsupported("fp8_rows"); }
  // out[M, V] (fp32) = x[M, H] (compute dtype) @ (scale[v] * q[v, :])^T: the products accumulate
  // in fp32 over the exact e4m3 values, the row scale multiplies the sum.
  virtual void linear_fp8(const Tensor& x, const Fp8Weight& w, Tensor& out) { unsupported("linear_fp8"); }
  // Exact re-score of candidates picked on an approximate head: per row r of h [R, H] (compute
  // dtype) and each candidate j of ids [R, K] (int32, in/out), v = dot(h[r], head[ids[r, j]])
  // with head [V, H] the exact LM head (fp32 accumulation); the K candidates are re-sorted as
  // topk_candidates sorts (v descending, lowest id first on ties, NaN last) and unary [R, K] =
  // v * multiplier, then softcap * tanh(. / softcap) when softcap > 0 (NaN: -inf).
  virtual void rescore_candidates(const Tensor& h, const Tensor& head, float multiplier, float softcap, Tensor& ids,
                                  Tensor& unary) {
    unsupported("rescore_candidates");
  }
  // Edge scores of the candidate lattice, fp32: ids[R, S, K], unary[R, S, K], gate[R, S, r] (the
  // hidden projection of the drafter's state at each slot), anchors[R] int32, codebooks A, B [V, r]:
  //   edges[b, s, p, c] = unary[b, s, c] + sum_j A[pred(b, s, p), j] * gate[b, s, j] * B[ids[b, s, c], j]
  //   pred(b, 0, p) = anchors[b], pred(b, s, p) = ids[b, s - 1, p].
  virtual void edge_scores(const Tensor& ids, const Tensor& unary, const Tensor& gate, const Tensor& anchors,
                           const Tensor& pred_codebook, const Tensor& succ_codebook, Tensor& edges) {
    unsupported("edge_scores");
  }
  // The lattice walk, per request b with params[b] (position = the first draft's): prev = 0; for
  // each slot s, row = edges[b, s, prev, :]; at temperature 0 idx = argmax(row) (lowest index on
  // ties, NaN as -inf), else idx = argmax(row / T + Gumbel) with the noise keyed by (seed,
  // position + s, candidate id) on the draft stream; drafts[b, s] = ids[b, s, idx],
  // realized[b, s, :] = row (the proposal q = softmax(row / T)); prev = idx. greedy_walk: the
  // argmax walk at every temperature, realized[b, s, :] one-hot (0 at idx, -inf elsewhere: q puts
  // all its mass on the draft, so acceptance is the one-hot rule).
  virtual void lattice_walk(const Tensor& edges, const Tensor& ids, const Tensor& params, bool greedy_walk,
                            Tensor& drafts, Tensor& realized) {
    unsupported("lattice_walk");
  }
  // accept() with the drafter's proposal: q[b, j] = softmax(realized[b, j, :] / T) over ids[b, j, :]
  // (exact rejection sampling: accept x if u q(x) < p(x), else draw from norm(max(p - q, 0)); the
  // bonus from p after a full accept); greedy (T = 0) rows as accept(). Empty ids: dense rows,
  // realized[b, j, :] over the whole vocabulary (DFlash's probabilistic drafts).
  virtual void accept_candidates(const Tensor& drafts, const Tensor& ids, const Tensor& realized,
                                 const Tensor& logits, const Tensor& params, Tensor& num_accepted,
                                 Tensor& next_token) {
    unsupported("accept_candidates");
  }

  // Probabilistic DFlash drafts: drafts[b * n + j] from logits[b * n + j, :] (fp32) with
  // params[b] (position = the first draft's): a Gumbel-max draw from softmax(logits / T) keyed by
  // (seed, position + j, token id) on the draft stream; the argmax at T = 0.
  virtual void sample_drafts(const Tensor& logits, const Tensor& params, int64_t n, Tensor& drafts) {
    unsupported("sample_drafts");
  }

  // --- Host staging and copies on the backend's stream (plain memcpy on the CPU) ---
  // Host memory the device can copy from/to asynchronously (pinned on CUDA).
  virtual std::shared_ptr<void> host_alloc(size_t bytes) = 0;
  virtual void copy_to_device(Tensor& dst, const void* host, size_t bytes) = 0;
  virtual void copy_to_host(void* host, const Tensor& src, size_t bytes) = 0;
  // Step markers (slots 0 and 1): record_step(s) marks the work queued so far; wait_step(s)
  // returns when that work is done (later work may still run). The CPU runs ops as they are
  // issued, so both are no-ops there.
  virtual void record_step(int slot) {}
  virtual void wait_step(int slot) {}

  // --- Graphs (CUDA): the ops issued between capture_begin and capture_end are recorded, not
  // run; graph_launch replays them. Tensors they touch must outlive the graph. ---
  virtual bool graphs_supported() const { return false; }
  virtual void capture_begin() { DFLASH_CHECK(false, "graph capture is not supported by the ", name(), " backend"); }
  virtual std::unique_ptr<CapturedGraph> capture_end() { return nullptr; }
  virtual void graph_launch(const CapturedGraph& graph) {
    DFLASH_CHECK(false, "graph replay is not supported by the ", name(), " backend");
  }

  virtual int num_threads() const = 0;

 protected:
  [[noreturn]] void unsupported(const char* op) const {
    throw Error(detail::concat("the ", name(), " backend has no ", op, " op"));
  }
};

// device: "cpu" or "cuda" (when built with CUDA). Throws InvalidArgument otherwise.
// scratch_bytes sizes the CUDA per-step arena; `kernels` are the kernel choices (each backend validates its own).
std::unique_ptr<Backend> backend_create(const std::string& device, int num_threads, size_t scratch_bytes,
                                        const KernelOptions& kernels = KernelOptions());

// True when this build contains the CUDA backend.
bool backend_built_with_cuda();
// True when this build has the CUDA backend and a Hopper GPU is usable (driver and device).
bool backend_cuda_usable();

}  // namespace dflash
