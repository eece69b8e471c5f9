// The CUDA backend: bf16 weights and activations, fp32 accumulation and logits, one stream.
// GEMMs through cuBLASLt, paged attention through AOT-compiled Triton kernels, everything
// else through the hand-written kernels of cuda/. Weights and KV pools are allocated once;
// per-step tensors come from a scratch arena allocated up front and reset at each step, so
// no allocation happens inside a step (the next issue captures steps into CUDA graphs).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "backend/backend.h"
#include "backend/cuda/cublaslt_gemm.h"
#include "cuda/paged_attention_args.h"

namespace dflash::cuda {
struct SkinnyFusion;
}

namespace dflash {

namespace triton_aot {
class Modules;
}

class CudaBackend final : public Backend {
 public:
  enum class GemmMode { kAuto, kCublasLt, kSkinny, kStream, kRouted };
  // scratch_bytes: the per-step arena (activations, logits, metadata).
  CudaBackend(int device, size_t scratch_bytes, const KernelOptions& kernels = KernelOptions());
  ~CudaBackend() override;
  // A GPU of compute capability 9.x is visible and the driver works.
  static bool usable();

  DeviceKind kind() const override { return DeviceKind::kCUDA; }
  std::string name() const override { return "cuda"; }
  DType compute_dtype() const override { return DType::kBF16; }
  int num_threads() const override { return 1; }
  void begin_step() override { scratch_used_ = 0; }
  bool device_memory(size_t* free_bytes, size_t* total_bytes) const override;
  size_t workspace_bytes() const override {
    return scratch_bytes_ + gemm_workspace_bytes_ + attention_workspace_bytes_ + kAttentionCounterSlots * sizeof(int32_t);
  }

  Tensor empty(const std::vector<int64_t>& shape, DType dtype) override;
  Tensor zeros(const std::vector<int64_t>& shape, DType dtype) override;
  Tensor weight(const std::vector<const StoredTensor*>& parts) override;
  Tensor upload_f32(const float* host, const std::vector<int64_t>& shape) override;
  Tensor upload_i32(const int32_t* host, const std::vector<int64_t>& shape) override;
  void download_f32(const Tensor& t, float* host) override;
  void synchronize() override;

  void embedding(const Tensor& table, const Tensor& ids, Tensor& out) override;
  void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override;
  void add_rms_norm(Tensor& residual, const Tensor& x, const Tensor& w, float eps, Tensor& out) override;
  void linear(const Tensor& x, const Tensor& w, Tensor& out) override;
  void rms_norm_linear(const Tensor& x, const Tensor& norm_w, float eps, const Tensor& w, Tensor& out,
                       Tensor& normed) override;
  void linear_add(const Tensor& x, const Tensor& w, Tensor& residual, Tensor& proj) override;
  void silu_mul_linear_add(const Tensor& gate_up, const Tensor& w, Tensor& residual, Tensor& act,
                           Tensor& proj) override;
  void silu_mul(const Tensor& gate_up, Tensor& out) override;
  void prefetch_weight(const Tensor& w, int64_t bytes, LayerLinear which) override;
  void add(const Tensor& a, const Tensor& b, Tensor& out) override;
  void qkv_norm_rope(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, float eps,
                     const Tensor& positions, const Tensor& inv_freq, float rope_scale, Tensor& q, Tensor& k,
                     Tensor& v) override;
  void qkv_norm_rope_write(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, float eps,
                           const Tensor& positions, const Tensor& inv_freq, const Tensor& slots, Tensor& q, Tensor& k,
                           Tensor& v, KVPool& pool, int64_t layer) override;
  void kv_write(KVPool& pool, int64_t layer, const Tensor& k, const Tensor& v, const Tensor& slots) override;
  void paged_attention(const Tensor& q, const KVPool& pool, int64_t layer, const AttentionMeta& meta,
                       Tensor& out) override;
  void rope_write_attention(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, float eps,
                            const Tensor& positions, const Tensor& inv_freq, const Tensor& slots, KVPool& pool,
                            int64_t layer, const AttentionMeta& meta, Tensor& q, Tensor& k, Tensor& v,
                            Tensor& out) override;
  void copy_columns(const Tensor& src, Tensor& dst, int64_t col) override;
  void gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) override;
  void sample(const Tensor& logits, const std::vector<SampleRow>& rows, int32_t* tokens_out) override;

  void argmax(const Tensor& logits, Tensor& out) override;
  void nonfinite_rows(const Tensor& logits, Tensor& flags) override;
  void sample_rows(const Tensor& logits, const Tensor& params, Tensor& tokens) override;
  void accept(const Tensor& drafts, const Tensor& logits, const Tensor& params, Tensor& num_accepted,
              Tensor& next_token) override;
  void feed_tokens(Tensor& ids, const Tensor& feed, const Tensor& prev) override;
  void feed_spec_inputs(SpecStepFeed& f) override;
  void clear(Tensor& t) override;
  void record_step(int slot) override;
  void wait_step(int slot) override;
  void assemble_drafts(const Tensor& proposed, const Tensor& override_drafts, const Tensor& use_override,
                       Tensor& drafts, Tensor& verify_ids) override;
  void kv_norm_rope_write_layers(const Tensor& kv, const Tensor& k_norm, float eps, const Tensor& positions,
                                 const Tensor& inv_freq, const Tensor& slots, KVPool& pool) override;

  void dflash2_check_limits(int64_t top_k, int64_t rank, int64_t taps, int64_t vocab) const override;
  void scale(Tensor& x, float factor) override;
  void grouped_conv(const Tensor& x, const Tensor& base, const Tensor& deltas, int64_t side, int64_t block,
                    int64_t group, bool accumulate, Tensor& out) override;
  void topk_candidates(const Tensor& logits, int64_t k, float multiplier, float softcap, Tensor& ids,
                       Tensor& unary) override;
  Fp8Weight fp8_rows(const Tensor& w) override;
  void linear_fp8(const Tensor& x, const Fp8Weight& w, Tensor& out) override;
  void rescore_candidates(const Tensor& h, const Tensor& head, float multiplier, float softcap, Tensor& ids,
                          Tensor& unary) override;
  void edge_scores(const Tensor& ids, const Tensor& unary, const Tensor& gate, const Tensor& anchors,
                   const Tensor& pred_codebook, const Tensor& succ_codebook, Tensor& edges) override;
  void lattice_walk(const Tensor& edges, const Tensor& ids, const Tensor& params, bool greedy_walk, Tensor& drafts,
                    Tensor& realized) override;
  void accept_candidates(const Tensor& drafts, const Tensor& ids, const Tensor& realized, const Tensor& logits,
                         const Tensor& params, Tensor& num_accepted, Tensor& next_token) override;
  void sample_drafts(const Tensor& logits, const Tensor& params, int64_t n, Tensor& drafts) override;

  std::shared_ptr<void> host_alloc(size_t bytes) override;
  void copy_to_device(Tensor& dst, const void* host, size_t bytes) override;
  void copy_to_host(void* host, const Tensor& src, size_t bytes) override;

  bool graphs_supported() const override { return true; }
  void capture_begin() override;
  std::unique_ptr<CapturedGraph> capture_end() override;
  void graph_launch(const CapturedGraph& graph) override;

 private:
  Tensor persistent(const std::vector<int64_t>& shape, DType dtype);
  // Whether linear() would run the skinny kernel for m rows of w [N, K].
  bool skinny_for(int64_t m, const Tensor& w) const;
  // Whether linear layers of m rows of w [N, K] run the streaming skinny kernel
  // (cuda/stream_gemm.cu) where it supports the shape: GemmMode::kStream up to 16 rows, kRouted
  // the shapes of kRoutedStream* (the batch-invariant mode goes through invariant_stream instead).
  bool stream_for(int64_t m, const Tensor& w) const;
  // Batch-invariant mode: out[m, N] = (fused) in @ w^T on the streaming kernel with the skinny
  // kernel's batch-invariant warps (the same bits as invariant_linear / the fused skinny launch),
  // for m <= 16 where its shared memory holds the form; false: not run.
  bool invariant_stream(const void* in, const Tensor& w, int64_t m, const cuda::SkinnyFusion& fusion, bool f32,
                        void* out);
  // The fused skinny kernel when skinny_for() and the kernel supports the shape; false: not run.
  bool try_fused(const Tensor& in, const Tensor& w, int64_t m, const cuda::SkinnyFusion& fusion, Tensor& out);
  // out[m, N] = x[m, K] @ w^T on the batch-invariant skinny shape (one launch, slices of
  // kBatchInvariantRows rows; up to 16 rows through invariant_stream where it fits).
  void invariant_linear(const Tensor& x, const Tensor& w, int64_t m, Tensor& out);
  // The arguments of one attention call over pool layer `layer` (q gives the token and head counts).
  PagedAttentionArgs attention_args(const Tensor& q, const KVPool& pool, int64_t layer, const AttentionMeta& meta,
                                    Tensor& out) const;
  // Whether an attention call of meta with num_heads query heads runs the CUDA-core decode kernel
  // (the routing rule below: few rows and pairs, auto attention, not batch-invariant).
  bool cuda_core_attention(const AttentionMeta& meta, int64_t num_heads, const KVPool& pool) const;

  int device_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t step_events_[2] = {nullptr, nullptr};  // record_step / wait_step
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  size_t scratch_used_ = 0;
  void* attention_workspace_ = nullptr;  // split-KV partials, reused by every attention call
  size_t attention_workspace_bytes_ = 64u << 20;
  // The CUDA decode attention's split counters (one per sequence x KV head, zero between calls).
  int32_t* attention_counters_ = nullptr;
  static constexpr int64_t kAttentionCounterSlots = 1 << 16;
  // Attention launches of at most kCudaCoreRows rows per (sequence, KV head) and at most
  // kCudaDecodeMaxPairs (sequence, KV head) pairs run the CUDA-core decode kernel (cuda/
  // decode_attention.cu), the rest the Triton kernels. CUDA-core kernel, measured on the H200
  // (Qwen3-8B geometry, AR step in CUDA graphs; bench/results/gpu_h200_decode_attention_routing.json):
  // batch 1 context 512 5.12 -> 4.83 ms, batch 1 context 4096 5.32 -> 5.45 ms (its split CTAs take
  // 2 passes there), batch 4 context 512 5.14 -> 5.19 ms, batch 4 context 4096 5.80 -> 6.87 ms: so
  // batch <= 2 of 8 KV heads. kernels.attention (DFLASH_ATTENTION, read at construction): "triton"
  // sends every launch to Triton; "tensor_cores" every launch of <= kDecodeAttentionMaxRows rows to
  // the tensor-core kernel (cuda/decode_attention_mma.cu), whatever the pair count. That kernel is
  // opt-in: faster than both others per call in isolation at query length 1, but not in the step,
  // and slower than Triton for the verify step's 64 rows past one pass per CTA
  // (bench/results/gpu_h200_attention_tensor_cores.json, 2026-12-04).
  bool cuda_decode_attention_ = true;
  bool attention_tensor_cores_ = false;
  // KernelOptions::attention "staged": the CUDA-core kernel's launches (same routing as "auto") with
  // K/V staged in shared memory by cp.async instead of registers (same bits; opt-in until measured).
  bool attention_staged_ = false;
  // KernelOptions::rope_attention: rope_write_attention runs the CUDA-core decode kernel with the
  // QKV norm / RoPE / K/V write fused in (cuda::decode_attention_rope) where that kernel is routed
  // (above) and supports the pointers; elsewhere the two unfused launches.
  bool rope_attention_ = false;
  // KernelOptions::l2_prefetch: bit (1 << LayerLinear) set for the linear layers whose weight
  // hints (prefetch_weight) launch an L2 prefetch (cuda/l2_prefetch.cu) over num_sms_ CTAs at
  // most; weights under kMinPrefetchBytes are left alone (they load in a few microseconds).
  unsigned l2_prefetch_mask_ = 0;
  int num_sms_ = 1;
  static constexpr int64_t kMinPrefetchBytes = int64_t{8} << 20;
  static constexpr int64_t kCudaCoreRows = 16;
  static constexpr int64_t kCudaDecodeMaxPairs = 16;
  // The radix top-K's per-row completion counters (zero between launches; its partials come
  // from the step arena).
  int32_t* topk_counters_ = nullptr;
  static constexpr int64_t kTopkCounterSlots = 1 << 16;
  void* gemm_workspace_ = nullptr;
  size_t gemm_workspace_bytes_ = 32u << 20;
  std::unique_ptr<CublasLtGemm> gemm_;
  // linear() runs the skinny GEMM kernel (cuda/skinny_gemm.cu) for x of up to kSkinnyGemmRows
  // rows and (kAuto) weights of at most kSkinnyGemmMaxWeight elements, cuBLASLt otherwise
  // (DFLASH_GEMM, read at construction: auto, cublaslt, skinny, stream). Where it runs the skinny kernel,
  // the fused layer ops run its fused variants (norm / activation staged in the kernel, residual
  // add in its epilogue); elsewhere they compose the unfused ops (cuBLASLt adds in place).
  // kStream: every linear layer and fused layer op of up to kStreamGemmMaxRows rows that the
  // streaming kernel supports runs it (cuda/stream_gemm.cu), the rest as kAuto (why auto does
  // not use it: gemm_mode_of in cuda_backend.cpp). kRouted: the streaming kernel only where it led
  // cuBLASLt in the H200 sweep (gemm_mode_of): up to kRoutedStreamRows rows, K >= kRoutedStreamMinK
  // and weights of at most kRoutedStreamMaxWeight elements (QKV, O, down of Qwen3-8B; not gate/up
  // or the LM head), its fused forms only with at least 8 warps; the rest as kAuto.
  static constexpr int64_t kSkinnyGemmRows = 16;
  static constexpr int64_t kSkinnyGemmMaxWeight = int64_t{4096} * 4096;
  static constexpr int64_t kRoutedStreamRows = 8;
  static constexpr int64_t kRoutedStreamMinK = 2048;
  static constexpr int64_t kRoutedStreamMaxWeight = int64_t{8192} * 8192;
  GemmMode gemm_mode_ = GemmMode::kAuto;
  bool fused_layers_ = true;  // KernelOptions::fused_layers false: the layer ops compose the unfused kernels
  // KernelOptions::batch_invariant: every linear layer on the skinny kernel's batch-invariant
  // shape in slices of cuda::kBatchInvariantRows rows (no cuBLASLt; up to 16 rows on the
  // streaming kernel with that shape's warps where it fits, the same bits), the fused forms only where
  // a full slice fits, every attention on the Triton chunked kernel (one kernel for every query
  // count; key chunks at fixed positions folded in order, split over them or not): a row's bits
  // do not depend on the other rows of the step.
  bool batch_invariant_ = false;
  std::string cublaslt_path_;  // KernelOptions::cublaslt_path
  std::unique_ptr<triton_aot::Modules> triton_;
};

}  // namespace dflash
