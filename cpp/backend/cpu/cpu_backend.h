// The CPU backend: fp32 reference ops. GEMMs go to OpenBLAS (PyPI scipy-openblas32); the
// rest are plain loops parallelised with an own fork-join pool. It is the numerical reference for the CUDA
// backend and what CI runs end to end.
#pragma once

#include <functional>
#include <memory>

#include "backend/backend.h"
#include "common/thread_pool.h"

namespace dflash {

class CpuBackend final : public Backend {
 public:
  CpuBackend(int num_threads, const KernelOptions& kernels = KernelOptions());

  DeviceKind kind() const override { return DeviceKind::kCPU; }
  std::string name() const override { return "cpu"; }
  DType compute_dtype() const override { return DType::kF32; }
  int num_threads() const override { return num_threads_; }

  Tensor empty(const std::vector<int64_t>& shape, DType dtype) override;
  Tensor zeros(const std::vector<int64_t>& shape, DType dtype) override;
  Tensor weight(const std::vector<const StoredTensor*>& parts) override;
  Tensor upload_f32(const float* host, const std::vector<int64_t>& shape) override;
  Tensor upload_i32(const int32_t* host, const std::vector<int64_t>& shape) override;
  void download_f32(const Tensor& t, float* host) override;
  void synchronize() override {}

  void embedding(const Tensor& table, const Tensor& ids, Tensor& out) override;
  void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override;
  void add_rms_norm(Tensor& residual, const Tensor& x, const Tensor& w, float eps,
                    Tensor& out) override;
  void linear(const Tensor& x, const Tensor& w, Tensor& out) override;
  void silu_mul(const Tensor& gate_up, Tensor& out) override;
  void add(const Tensor& a, const Tensor& b, Tensor& out) override;
  void qkv_norm_rope(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, float eps,
                     const Tensor& positions, const Tensor& inv_freq, float rope_scale,
                     Tensor& q, Tensor& k, Tensor& v) override;
  void kv_write(KVPool& pool, int64_t layer, const Tensor& k, const Tensor& v,
                const Tensor& slots) override;
  void paged_attention(const Tensor& q, const KVPool& pool, int64_t layer,
                       const AttentionMeta& meta, Tensor& out) override;
  void copy_columns(const Tensor& src, Tensor& dst, int64_t col) override;
  void gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) override;
  void sample(const Tensor& logits, const std::vector<SampleRow>& rows,
              int32_t* tokens_out) override;

  // Device-side step ops and staging (cpu_device_steps.cpp).
  void argmax(const Tensor& logits, Tensor& out) override;
  void nonfinite_rows(const Tensor& logits, Tensor& flags) override;
  void sample_rows(const Tensor& logits, const Tensor& params, Tensor& tokens) override;
  void accept(const Tensor& drafts, const Tensor& logits, const Tensor& params, Tensor& num_accepted,
              Tensor& next_token) override;
  void feed_tokens(Tensor& ids, const Tensor& feed, const Tensor& prev) override;
  void feed_spec_inputs(SpecStepFeed& f) override;
  void clear(Tensor& t) override;
  void assemble_drafts(const Tensor& proposed, const Tensor& override_drafts, const Tensor& use_override,
                       Tensor& drafts, Tensor& verify_ids) override;
  void kv_norm_rope_write_layers(const Tensor& kv, const Tensor& k_norm, float eps, const Tensor& positions,
                                 const Tensor& inv_freq, const Tensor& slots, KVPool& pool) override;
  void scale(Tensor& x, float factor) override;
  void grouped_conv(const Tensor& x, const Tensor& base, const Tensor& deltas, int64_t side, int64_t block,
                    int64_t group, bool accumulate, Tensor& out) override;
  void topk_candidates(const Tensor& logits, int64_t k, float multiplier, float softcap, Tensor& ids,
                       Tensor& unary) override;
  // FP8 candidate head (cpu_fp8_head.cpp).
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

 private:
  // Runs fn over [0, n) items on the pool when n * work_per_item is worth the wake-up.
  void parallel(int64_t n, int64_t work_per_item, const std::function<void(int64_t, int64_t)>& fn);

  int num_threads_;
  enum class SkinnyKernel { kNone, kAvx2, kAvx512 };
  SkinnyKernel skinny_ = SkinnyKernel::kNone;  // linear() of few rows (cpu_skinny_gemm.h)
  bool blas_threads_ = false;  // cpu_gemm "blas": OpenBLAS runs its GEMMs on its own threads
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace dflash
