// CUDA backend: memory (persistent allocations + per-step scratch arena) and op dispatch to
// cuBLASLt, the Triton attention kernels and the kernels of cuda/kernels.h.
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "cuda_driver/driver_api.h"
#include "cuda/kernels.h"
#include "triton_kernels/lattice_walk.h"
#include "triton_kernels/triton_attention.h"

namespace dflash {

namespace {

__nv_bfloat16* bf(const Tensor& t) { return static_cast<__nv_bfloat16*>(t.data); }
const int32_t* i32(const Tensor& t) { return static_cast<const int32_t*>(t.data); }

void check_bf16(const Tensor& t, const char* what) {
  DFLASH_CHECK(t.dtype == DType::kBF16 && t.device == DeviceKind::kCUDA, what, ": expected a bf16 CUDA tensor");
}

// kernels.gemm: "cublaslt" sends every linear layer to cuBLASLt; "skinny" every one the skinny
// kernel supports (up to kSkinnyGemmRows rows); "stream" every one of up to 16 rows that the
// streaming kernel supports (cuda/stream_gemm.cu, with its fused forms); "auto": the skinny
// kernel only for small weights (N x K <= 4096 x 4096) up to 16 rows, where it measured faster
// than cuBLASLt on the H200 (bench/results/gpu_h200_skinny_gemm.json: O projection 10.9 vs
// 13.2 us), cuBLASLt for the rest. The streaming kernel leads cuBLASLt on QKV, O and down at up
// to 8 rows in isolation (bench/results/gpu_h200_gemv_stream.json, M = 1: 86.6 / 73.8 / 86.0 %
// of the copy bandwidth vs 74.6 / 58.7 / 77.1 %) but routing those layers to it (fused forms
// included) left the Qwen3-8B-geometry AR step at batch 1 unchanged on the H200 (4.962 vs
// 4.966 ms with cuBLASLt for all), so auto keeps the rule above. A fixed rule, not timing, so
// results are reproducible run to run.
// Why that step did not move: from the isolated figures, "stream" at M = 1 saved 2.2 / 1.0 /
// 3.1 us per layer on QKV / O / down and lost 6.4 us on gate/up (83.7 % against cuBLASLt's
// 94.6 %), net zero; and all 145 GEMMs of the step in one graph took what the isolated figures
// add up to (4.213 ms streamed, 4.225 ms cuBLASLt: bench_gpu_gemv.py step_m1). "routed" keeps
// the streaming kernel to the shapes where it led (up to 8 rows, K >= 2048, N x K <= 8192^2:
// QKV, O, down; its launcher's 16-warp shape led every one of them, 80.5-90.7 % at M = 1) and
// cuBLASLt for gate/up and the LM head: 9 us per layer less than auto by the same arithmetic.
// Opt-in until an A/B of the whole step confirms it.
CudaBackend::GemmMode gemm_mode_of(const std::string& s) {
  DFLASH_ARG_CHECK(s == "auto" || s == "cublaslt" || s == "skinny" || s == "stream" || s == "routed",
                   "kernels.gemm (DFLASH_GEMM) must be auto, cublaslt, skinny, stream or routed, got '", s, "'");
  return s == "cublaslt" ? CudaBackend::GemmMode::kCublasLt
         : s == "skinny" ? CudaBackend::GemmMode::kSkinny
         : s == "stream" ? CudaBackend::GemmMode::kStream
         : s == "routed" ? CudaBackend::GemmMode::kRouted
                         : CudaBackend::GemmMode::kAuto;
}

// kernels.l2_prefetch: "off", "all" or a comma-separated list of qkv, o, gate_up, down.
unsigned l2_prefetch_mask_of(const std::string& s) {
  if (s == "off" || s.empty()) return 0;
  if (s == "all") return 0xF;
  unsigned mask = 0;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = std::min(s.find(',', start), s.size());
    const std::string item = s.substr(start, end - start);
    const int bit = item == "qkv" ? static_cast<int>(LayerLinear::kQkv)
                    : item == "o" ? static_cast<int>(LayerLinear::kO)
                    : item == "gate_up" ? static_cast<int>(LayerLinear::kGateUp)
                    : item == "down" ? static_cast<int>(LayerLinear::kDown)
                                     : -1;
    DFLASH_ARG_CHECK(bit >= 0, "kernels.l2_prefetch (DFLASH_L2_PREFETCH) must be off, all or a comma-separated "
                     "list of qkv, o, gate_up, down, got '", s, "'");
    mask |= 1u << bit;
    start = end + 1;
  }
  return mask;
}

}  // namespace

CudaBackend::CudaBackend(int device, size_t scratch_bytes, const KernelOptions& kernels)
    : device_(device), scratch_bytes_(scratch_bytes) {
  gemm_mode_ = gemm_mode_of(kernels.gemm);  // first: it may throw, before anything is allocated
  fused_layers_ = kernels.fused_layers;     // false: unfused layer ops, for A/B timing
  batch_invariant_ = kernels.batch_invariant;
  DFLASH_ARG_CHECK(kernels.attention == "auto" || kernels.attention == "triton" || kernels.attention == "tensor_cores" ||
                       kernels.attention == "staged",
                   "kernels.attention (DFLASH_ATTENTION) must be auto, triton, tensor_cores or staged, got '",
                   kernels.attention, "'");
  cuda_decode_attention_ = kernels.attention != "triton";
  rope_attention_ = kernels.rope_attention;
  attention_tensor_cores_ = kernels.attention == "tensor_cores";
  attention_staged_ = kernels.attention == "staged";
  l2_prefetch_mask_ = l2_prefetch_mask_of(kernels.l2_prefetch);
  cuda_driver::set_pdl_enabled(kernels.programmatic_launch);
  cublaslt_path_ = kernels.cublaslt_path;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    throw InvalidArgument(std::string("device='cuda' was asked for, but no usable GPU was found (") +
                          (err != cudaSuccess ? cudaGetErrorString(err) : "no CUDA devices") + ")");
  }
  DFLASH_ARG_CHECK(device >= 0 && device < count, "CUDA device ", device, " does not exist (", count, " found)");
  DFLASH_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop;
  DFLASH_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  DFLASH_CHECK(prop.major == 9, "the CUDA backend is built for Hopper (sm_90a); device ", device, " is sm_",
               prop.major, prop.minor);
  num_sms_ = prop.multiProcessorCount;
  DFLASH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  for (cudaEvent_t& e : step_events_) DFLASH_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  DFLASH_CUDA_CHECK(cudaMalloc(&scratch_, scratch_bytes_));
  DFLASH_CUDA_CHECK(cudaMalloc(&gemm_workspace_, gemm_workspace_bytes_));
  DFLASH_CUDA_CHECK(cudaMalloc(&attention_workspace_, attention_workspace_bytes_));
  DFLASH_CUDA_CHECK(cudaMalloc(&attention_counters_, kAttentionCounterSlots * sizeof(int32_t)));
  DFLASH_CUDA_CHECK(cudaMemset(attention_counters_, 0, kAttentionCounterSlots * sizeof(int32_t)));
  DFLASH_CUDA_CHECK(cudaMalloc(&topk_counters_, kTopkCounterSlots * sizeof(int32_t)));
  DFLASH_CUDA_CHECK(cudaMemset(topk_counters_, 0, kTopkCounterSlots * sizeof(int32_t)));
  gemm_ = std::make_unique<CublasLtGemm>(gemm_workspace_, gemm_workspace_bytes_, cublaslt_path_);
  triton_ = std::make_unique<triton_aot::Modules>();  // every Triton module, loaded once
}

CudaBackend::~CudaBackend() {
  triton_.reset();
  gemm_.reset();
  if (stream_) cudaStreamSynchronize(stream_);
  for (cudaEvent_t e : step_events_) {
    if (e) cudaEventDestroy(e);
  }
  if (gemm_workspace_) cudaFree(gemm_workspace_);
  if (attention_workspace_) cudaFree(attention_workspace_);
  if (attention_counters_) cudaFree(attention_counters_);
  if (topk_counters_) cudaFree(topk_counters_);
  if (scratch_) cudaFree(scratch_);
  if (stream_) cudaStreamDestroy(stream_);
}

bool CudaBackend::usable() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return false;
  }
  cudaDeviceProp prop;
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9;
}

bool CudaBackend::device_memory(size_t* free_bytes, size_t* total_bytes) const {
  return cudaMemGetInfo(free_bytes, total_bytes) == cudaSuccess;
}

Tensor CudaBackend::persistent(const std::vector<int64_t>& shape, DType dtype) {
  Tensor t;
  t.shape = shape;
  t.dtype = dtype;
  t.device = DeviceKind::kCUDA;
  void* p = nullptr;
  const size_t bytes = std::max<size_t>(t.nbytes(), 256);
  cudaError_t err = cudaMalloc(&p, bytes);
  DFLASH_CHECK(err == cudaSuccess, "out of GPU memory allocating ", bytes, " bytes (", cudaGetErrorString(err), ")");
  t.storage = std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
  t.data = p;
  return t;
}

Tensor CudaBackend::empty(const std::vector<int64_t>& shape, DType dtype) {
  Tensor t;
  t.shape = shape;
  t.dtype = dtype;
  t.device = DeviceKind::kCUDA;
  const size_t bytes = (t.nbytes() + 255) / 256 * 256;
  DFLASH_CHECK(scratch_used_ + bytes <= scratch_bytes_, "the CUDA scratch arena (", scratch_bytes_,
               " bytes) is too small for this step; lower max_num_batched_tokens / max_num_seqs");
  t.data = static_cast<char*>(scratch_) + scratch_used_;
  scratch_used_ += bytes;
  return t;
}

Tensor CudaBackend::zeros(const std::vector<int64_t>& shape, DType dtype) {
  Tensor t = persistent(shape, dtype);
  DFLASH_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.nbytes(), stream_));
  return t;
}

Tensor CudaBackend::weight(const std::vector<const StoredTensor*>& parts) {
  std::vector<int64_t> shape = parts.at(0)->shape;
  for (size_t i = 1; i < parts.size(); ++i) shape[0] += parts[i]->shape[0];
  Tensor t = persistent(shape, DType::kBF16);
  std::vector<uint16_t> host(t.numel());
  uint16_t* dst = host.data();
  for (const StoredTensor* p : parts) {
    p->to_bf16(dst);
    dst += p->numel();
  }
  DFLASH_CUDA_CHECK(cudaMemcpy(t.data, host.data(), t.nbytes(), cudaMemcpyHostToDevice));
  return t;
}

Tensor CudaBackend::upload_f32(const float* host, const std::vector<int64_t>& shape) {
  Tensor t = persistent(shape, DType::kF32);
  DFLASH_CUDA_CHECK(cudaMemcpy(t.data, host, t.nbytes(), cudaMemcpyHostToDevice));
  return t;
}

Tensor CudaBackend::upload_i32(const int32_t* host, const std::vector<int64_t>& shape) {
  Tensor t = empty(shape, DType::kI32);
  if (t.nbytes()) DFLASH_CUDA_CHECK(cudaMemcpyAsync(t.data, host, t.nbytes(), cudaMemcpyHostToDevice, stream_));
  return t;
}

void CudaBackend::download_f32(const Tensor& t, float* host) {
  if (t.dtype == DType::kF32) {
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(host, t.data, t.nbytes(), cudaMemcpyDeviceToHost, stream_));
  } else {
    check_bf16(t, "download_f32");
    Tensor f = empty(t.shape, DType::kF32);
    DFLASH_CUDA_CHECK(cuda::bf16_to_f32(bf(t), t.numel(), f.ptr<float>(), stream_));
    DFLASH_CUDA_CHECK(cudaMemcpyAsync(host, f.data, f.nbytes(), cudaMemcpyDeviceToHost, stream_));
  }
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::synchronize() { DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

void CudaBackend::embedding(const Tensor& table, const Tensor& ids, Tensor& out) {
  DFLASH_CUDA_CHECK(cuda::embedding(bf(table), i32(ids), ids.numel(), table.dim(1), table.dim(0), bf(out), nullptr,
                                    stream_));
}

void CudaBackend::rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  const int64_t h = w.numel();
  DFLASH_CUDA_CHECK(cuda::rms_norm(bf(x), bf(w), x.numel() / h, h, eps, bf(out), stream_));
}

void CudaBackend::add_rms_norm(Tensor& residual, const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  const int64_t h = w.numel();
  DFLASH_CUDA_CHECK(cuda::add_rms_norm(bf(residual), bf(x), bf(w), residual.numel() / h, h, eps, bf(out), stream_));
}

bool CudaBackend::skinny_for(int64_t m, const Tensor& w) const {
  if (batch_invariant_) return true;  // every m, in slices (invariant_linear, try_fused)
  const int64_t n = w.dim(0), k = w.dim(1);
  const bool by_size = gemm_mode_ == GemmMode::kAuto || gemm_mode_ == GemmMode::kRouted;
  const bool skinny = gemm_mode_ == GemmMode::kSkinny || (by_size && n * k <= kSkinnyGemmMaxWeight);
  return skinny && m <= kSkinnyGemmRows;
}

bool CudaBackend::stream_for(int64_t m, const Tensor& w) const {
  if (batch_invariant_ || m > cuda::kStreamGemmMaxRows) return false;
  if (gemm_mode_ == GemmMode::kStream) return true;
  const int64_t n = w.dim(0), k = w.dim(1);
  return gemm_mode_ == GemmMode::kRouted && m <= kRoutedStreamRows && k >= kRoutedStreamMinK &&
         n * k <= kRoutedStreamMaxWeight;
}

bool CudaBackend::invariant_stream(const void* in, const Tensor& w, int64_t m, const cuda::SkinnyFusion& fusion,
                                   bool f32, void* out) {
  const int64_t n = w.dim(0), k = w.dim(1);
  if (m > cuda::kStreamGemmMaxRows) return false;
  cuda::SkinnyFusion f = fusion;
  f.batch_invariant = true;
  cuda::StreamGemmConfig config;
  config.batch_invariant = true;
  config.warps = cuda::batch_invariant_warps(n);  // the skinny kernel's shape: the same bits
  if (!cuda::stream_gemm_supports(in, w.data, m, k, f, f32, &config)) return false;
  DFLASH_CUDA_CHECK(cuda::stream_gemm(static_cast<const __nv_bfloat16*>(in), bf(w), m, n, k, f, f32, out, stream_,
                                      &config));
  return true;
}

bool CudaBackend::try_fused(const Tensor& in, const Tensor& w, int64_t m, const cuda::SkinnyFusion& fusion,
                            Tensor& out) {
  const int64_t n = w.dim(0), k = w.dim(1);
  if (batch_invariant_) {
    // Fused only where a full slice fits (a choice by K, never by m), then slice by slice; up to 16
    // rows on the streaming kernel where its shared memory holds the form (same bits).
    cuda::SkinnyFusion f = fusion;
    f.batch_invariant = true;
    if (!fused_layers_ || !cuda::skinny_gemm_fused_supports(in.data, w.data, cuda::kBatchInvariantRows, k, f)) {
      return false;
    }
    check_bf16(in, "fused linear input");
    check_bf16(out, "fused linear output");
    if (invariant_stream(in.data, w, m, f, false, out.data)) return true;
    // One launch; the kernel runs the rows in slices of kBatchInvariantRows.
    DFLASH_CUDA_CHECK(cuda::skinny_gemm_fused(bf(in), bf(w), m, n, k, f, bf(out), stream_));
    return true;
  }
  // kRouted: a fused form whose staged input leaves the launcher fewer than 8 warps (silu * up of
  // the down projection past a few rows) runs unfused instead.
  cuda::StreamGemmConfig config;
  config.min_warps = gemm_mode_ == GemmMode::kRouted ? 8 : 0;
  if (fused_layers_ && stream_for(m, w) && cuda::stream_gemm_supports(in.data, w.data, m, k, fusion, false, &config)) {
    check_bf16(in, "fused linear input");
    check_bf16(out, "fused linear output");
    DFLASH_CUDA_CHECK(cuda::stream_gemm(bf(in), bf(w), m, n, k, fusion, false, out.data, stream_, &config));
    return true;
  }
  if (!fused_layers_ || !skinny_for(m, w) || !cuda::skinny_gemm_fused_supports(in.data, w.data, m, k, fusion)) return false;
  check_bf16(in, "fused linear input");
  check_bf16(out, "fused linear output");
  DFLASH_CUDA_CHECK(cuda::skinny_gemm_fused(bf(in), bf(w), m, n, k, fusion, bf(out), stream_));
  return true;
}

void CudaBackend::invariant_linear(const Tensor& x, const Tensor& w, int64_t m, Tensor& out) {
  const int64_t n = w.dim(0), k = w.dim(1);
  DFLASH_CHECK(cuda::skinny_gemm_supports(x.data, w.data, 1, k), "batch-invariant linear: the skinny kernel does not "
               "support x ", shape_str(x.shape), " w ", shape_str(w.shape), " (K % 8 == 0 and 16-byte aligned rows)");
  check_bf16(x, "batch-invariant linear input");
  // Up to 16 rows on the streaming kernel where it fits: the bits of the skinny kernel's launch.
  if (invariant_stream(x.data, w, m, cuda::SkinnyFusion{}, out.dtype == DType::kF32, out.data)) return;
  cuda::SkinnyGemmConfig config;
  config.batch_invariant = true;
  // One launch; the kernel runs the rows in slices of kBatchInvariantRows.
  DFLASH_CUDA_CHECK(cuda::skinny_gemm(bf(x), bf(w), m, n, k, out.dtype == DType::kF32, out.data, stream_, &config));
}

void CudaBackend::rms_norm_linear(const Tensor& x, const Tensor& norm_w, float eps, const Tensor& w, Tensor& out,
                                  Tensor& normed) {
  const int64_t k = w.dim(1), m = x.numel() / k;
  DFLASH_CHECK(x.numel() == m * k && norm_w.numel() == k && out.numel() == m * w.dim(0),
               "rms_norm_linear: shape mismatch x ", shape_str(x.shape), " w ", shape_str(w.shape));
  cuda::SkinnyFusion f;
  f.input = cuda::SkinnyInput::kRmsNorm;
  f.gamma = bf(norm_w);
  f.eps = eps;
  if (out.dtype == DType::kBF16 && try_fused(x, w, m, f, out)) return;
  Backend::rms_norm_linear(x, norm_w, eps, w, out, normed);
}

void CudaBackend::linear_add(const Tensor& x, const Tensor& w, Tensor& residual, Tensor& proj) {
  const int64_t n = w.dim(0), k = w.dim(1), m = x.numel() / k;
  DFLASH_CHECK(x.numel() == m * k && residual.numel() == m * n, "linear_add: shape mismatch x ", shape_str(x.shape),
               " w ", shape_str(w.shape), " residual ", shape_str(residual.shape));
  check_bf16(residual, "linear_add residual");
  cuda::SkinnyFusion f;
  f.add = true;
  if (try_fused(x, w, m, f, residual)) return;
  if (!skinny_for(m, w)) {  // cuBLASLt accumulates in place (beta = 1)
    gemm_->linear(x.data, w.data, residual.data, m, n, k, false, stream_, /*accumulate=*/true);
    return;
  }
  Backend::linear_add(x, w, residual, proj);
}

void CudaBackend::silu_mul_linear_add(const Tensor& gate_up, const Tensor& w, Tensor& residual, Tensor& act,
                                      Tensor& proj) {
  const int64_t n = w.dim(0), k = w.dim(1), m = gate_up.numel() / (2 * k);
  DFLASH_CHECK(gate_up.numel() == 2 * m * k && residual.numel() == m * n, "silu_mul_linear_add: shape mismatch "
               "gate_up ", shape_str(gate_up.shape), " w ", shape_str(w.shape), " residual ", shape_str(residual.shape));
  check_bf16(residual, "silu_mul_linear_add residual");
  cuda::SkinnyFusion f;
  f.input = cuda::SkinnyInput::kSiluMul;
  f.add = true;
  if (try_fused(gate_up, w, m, f, residual)) return;
  Backend::silu_mul_linear_add(gate_up, w, residual, act, proj);
}

void CudaBackend::linear(const Tensor& x, const Tensor& w, Tensor& out) {
  const int64_t n = w.dim(0), k = w.dim(1), m = x.numel() / k;
  DFLASH_CHECK(x.numel() == m * k && out.numel() == m * n, "linear: shape mismatch x ", shape_str(x.shape), " w ",
               shape_str(w.shape), " out ", shape_str(out.shape));
  if (batch_invariant_) {
    invariant_linear(x, w, m, out);
    return;
  }
  const bool f32 = out.dtype == DType::kF32;
  if (stream_for(m, w) && x.dtype == DType::kBF16 &&
      cuda::stream_gemm_supports(x.data, w.data, m, k, cuda::SkinnyFusion{}, f32)) {
    DFLASH_CUDA_CHECK(cuda::stream_gemm(bf(x), bf(w), m, n, k, cuda::SkinnyFusion{}, f32, out.data, stream_));
    return;
  }
  if (skinny_for(m, w) && cuda::skinny_gemm_supports(x.data, w.data, m, k)) {
    DFLASH_CUDA_CHECK(cuda::skinny_gemm(bf(x), bf(w), m, n, k, f32, out.data, stream_));
    return;
  }
  gemm_->linear(x.data, w.data, out.data, m, n, k, out.dtype == DType::kF32, stream_);
}

void CudaBackend::prefetch_weight(const Tensor& w, int64_t bytes, LayerLinear which) {
  if ((l2_prefetch_mask_ & (1u << static_cast<int>(which))) == 0) return;
  const int64_t total = static_cast<int64_t>(w.nbytes());
  if (total < kMinPrefetchBytes || bytes <= 0) return;
  DFLASH_CUDA_CHECK(cuda::l2_prefetch(w.data, std::min(bytes, total), num_sms_, stream_));
}

void CudaBackend::silu_mul(const Tensor& gate_up, Tensor& out) {
  const int64_t inter = out.dim(-1);
  DFLASH_CUDA_CHECK(cuda::silu_mul(bf(gate_up), out.numel() / inter, inter, bf(out), stream_));
}

void CudaBackend::add(const Tensor& a, const Tensor& b, Tensor& out) {
  DFLASH_CUDA_CHECK(cuda::add(bf(a), bf(b), a.numel(), bf(out), stream_));
}

void CudaBackend::qkv_norm_rope(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, float eps,
                                const Tensor& positions, const Tensor& inv_freq, float rope_scale, Tensor& q,
                                Tensor& k, Tensor& v) {
  DFLASH_CHECK(rope_scale == 1.0f, "the CUDA backend supports RoPE attention scaling 1.0 only");
  DFLASH_CUDA_CHECK(cuda::qkv_norm_rope(bf(qkv), q_norm.empty() ? nullptr : bf(q_norm),
                                        k_norm.empty() ? nullptr : bf(k_norm), eps, i32(positions),
                                        inv_freq.ptr<float>(), k.dim(0), q.dim(1), k.dim(1), k.dim(2),
                                        q.dim(1) ? bf(q) : nullptr, bf(k), bf(v), stream_));
}

void CudaBackend::qkv_norm_rope_write(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, float eps,
                                      const Tensor& positions, const Tensor& inv_freq, const Tensor& slots, Tensor& q,
                                      Tensor& k, Tensor& v, KVPool& pool, int64_t layer) {
  const int64_t layer_elems = pool.num_blocks * pool.block_size * pool.num_kv_heads * pool.head_dim;
  DFLASH_CUDA_CHECK(cuda::qkv_norm_rope_write(bf(qkv), q_norm.empty() ? nullptr : bf(q_norm),
                                              k_norm.empty() ? nullptr : bf(k_norm), eps, i32(positions),
                                              inv_freq.ptr<float>(), i32(slots), k.dim(0), q.dim(1), k.dim(1),
                                              k.dim(2), q.dim(1) ? bf(q) : nullptr, bf(pool.k) + layer * layer_elems,
                                              bf(pool.v) + layer * layer_elems, stream_));
}

void CudaBackend::kv_write(KVPool& pool, int64_t layer, const Tensor& k, const Tensor& v, const Tensor& slots) {
  const int64_t row = pool.num_kv_heads * pool.head_dim;
  const int64_t layer_elems = pool.num_blocks * pool.block_size * row;
  DFLASH_CUDA_CHECK(cuda::kv_write(bf(k), bf(v), i32(slots), slots.numel(), row, bf(pool.k) + layer * layer_elems,
                                   bf(pool.v) + layer * layer_elems, stream_));
}

PagedAttentionArgs CudaBackend::attention_args(const Tensor& q, const KVPool& pool, int64_t layer,
                                               const AttentionMeta& meta, Tensor& out) const {
  const int64_t row = pool.num_kv_heads * pool.head_dim;
  const int64_t layer_elems = pool.num_blocks * pool.block_size * row;
  PagedAttentionArgs a{};
  a.q = q.data;
  a.k_pool = bf(pool.k) + layer * layer_elems;
  a.v_pool = bf(pool.v) + layer * layer_elems;
  a.out = out.data;
  a.query_start = i32(meta.query_start);
  a.kv_len = i32(meta.kv_len);
  a.block_table = i32(meta.block_table);
  a.num_seqs = meta.num_seqs;
  a.num_tokens = static_cast<int32_t>(q.dim(0));
  a.num_heads = static_cast<int32_t>(q.dim(1));
  a.num_kv_heads = static_cast<int32_t>(pool.num_kv_heads);
  a.head_dim = static_cast<int32_t>(pool.head_dim);
  a.block_size = static_cast<int32_t>(pool.block_size);
  a.max_blocks_per_seq = meta.max_blocks_per_seq;
  a.max_query_len = meta.max_query_len;
  a.max_kv_len = meta.max_kv_len;
  a.causal = meta.causal;
  a.window = static_cast<int32_t>(meta.window);
  a.symmetric_window = meta.symmetric_window;
  a.scale = 1.0f / std::sqrt(static_cast<float>(pool.head_dim));
  // Split-KV: one persistent workspace, reused by every call (the calls run in order on one
  // stream); the split count follows max_kv_len and what fits in it.
  a.workspace = attention_workspace_;
  a.workspace_bytes = attention_workspace_bytes_;
  a.counters = attention_counters_;  // the CUDA decode kernel's split-KV counters
  a.counter_slots = kAttentionCounterSlots;
  return a;
}

bool CudaBackend::cuda_core_attention(const AttentionMeta& meta, int64_t num_heads, const KVPool& pool) const {
  const int64_t pairs = int64_t{meta.num_seqs} * pool.num_kv_heads;
  const int64_t rows = int64_t{meta.max_query_len} * (num_heads / pool.num_kv_heads);
  return !batch_invariant_ && cuda_decode_attention_ && !attention_tensor_cores_ && rows <= kCudaCoreRows &&
         pairs <= kCudaDecodeMaxPairs;
}

void CudaBackend::paged_attention(const Tensor& q, const KVPool& pool, int64_t layer, const AttentionMeta& meta,
                                  Tensor& out) {
  PagedAttentionArgs a = attention_args(q, pool, layer, meta, out);
  if (batch_invariant_) {
    // One kernel for every query count (a row's keys in the same BLOCK_N tiles within key chunks
    // at fixed positions, folded in order; split over the chunks or not by the launch's shape):
    // decode, verify and prefill rows of a position get the same bits.
    a.force_variant = PagedAttentionVariant::kChunked;
  } else if (cuda_decode_attention_) {
    // few rows per (sequence, KV head): the CUDA decode kernels where routed (cuda_backend.h)
    a.force_tensor_cores = attention_tensor_cores_;
    a.staged_kv = attention_staged_;
    const bool routed = attention_tensor_cores_ || cuda_core_attention(meta, q.dim(1), pool);
    if (routed && cuda::decode_attention_check(a) == nullptr) {
      DFLASH_CUDA_CHECK(cuda::decode_attention(a, stream_));
      return;
    }
  }
  CUresult r = triton_aot::paged_attention(*triton_, stream_, a);
  DFLASH_CHECK(r == CUDA_SUCCESS, "Triton paged attention failed (CUresult ", static_cast<int>(r), ")");
}

void CudaBackend::rope_write_attention(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm, float eps,
                                       const Tensor& positions, const Tensor& inv_freq, const Tensor& slots,
                                       KVPool& pool, int64_t layer, const AttentionMeta& meta, Tensor& q, Tensor& k,
                                       Tensor& v, Tensor& out) {
  if (rope_attention_ && cuda_core_attention(meta, q.dim(1), pool)) {
    const int64_t t = q.dim(0);
    DFLASH_CHECK(qkv.numel() == t * (q.dim(1) + 2 * pool.num_kv_heads) * pool.head_dim && positions.numel() == t &&
                     slots.numel() == t,
                 "rope_write_attention: qkv ", shape_str(qkv.shape), " for q ", shape_str(q.shape), ", positions ",
                 shape_str(positions.shape), ", slots ", shape_str(slots.shape));
    check_bf16(qkv, "rope_write_attention qkv");
    PagedAttentionArgs a = attention_args(q, pool, layer, meta, out);
    a.staged_kv = attention_staged_;  // both switches: the staged kernel with the fused prologue
    cuda::DecodeRopeArgs r;
    r.qkv = bf(qkv);
    r.q_norm = q_norm.empty() ? nullptr : bf(q_norm);
    r.k_norm = k_norm.empty() ? nullptr : bf(k_norm);
    r.eps = eps;
    r.positions = i32(positions);
    r.inv_freq = inv_freq.ptr<float>();
    r.slots = i32(slots);
    if (cuda::decode_attention_rope_check(a, r) == nullptr) {
      DFLASH_CUDA_CHECK(cuda::decode_attention_rope(a, r, stream_));
      return;
    }
  }
  Backend::rope_write_attention(qkv, q_norm, k_norm, eps, positions, inv_freq, slots, pool, layer, meta, q, k, v, out);
}

void CudaBackend::copy_columns(const Tensor& src, Tensor& dst, int64_t col) {
  const int64_t rows = src.dim(0);
  if (src.dtype == DType::kF32) {
    DFLASH_CHECK(dst.dtype == DType::kF32, "copy_columns: fp32 source into a ", dtype_name(dst.dtype), " tensor");
    const int64_t cols = src.numel() / rows, width = dst.numel() / rows;
    DFLASH_CHECK(col >= 0 && col + cols <= width, "copy_columns: columns [", col, ", ", col + cols, ") of ", width);
    if (rows == 0 || cols == 0) return;
    DFLASH_CUDA_CHECK(cudaMemcpy2DAsync(dst.ptr<float>() + col, width * sizeof(float), src.data, cols * sizeof(float),
                                        cols * sizeof(float), rows, cudaMemcpyDeviceToDevice, stream_));
    return;
  }
  DFLASH_CUDA_CHECK(cuda::copy_columns(bf(src), rows, src.numel() / rows, bf(dst), dst.numel() / rows, col, stream_));
}

void CudaBackend::gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) {
  const int64_t width = x.numel() / x.dim(0);
  DFLASH_CUDA_CHECK(cuda::gather_rows(x.data, i32(rows), rows.numel(), width, dtype_size(x.dtype), out.data, stream_));
}

void CudaBackend::sample(const Tensor& logits, const std::vector<SampleRow>& rows, int32_t* tokens_out) {
  const int64_t n = static_cast<int64_t>(rows.size());
  if (n == 0) return;
  Tensor dev_params = empty({static_cast<int64_t>(n * sizeof(SampleRow))}, DType::kU8);
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(dev_params.data, rows.data(), n * sizeof(SampleRow),
                                    cudaMemcpyHostToDevice, stream_));
  Tensor tokens = empty({n}, DType::kI32);
  DFLASH_CUDA_CHECK(cuda::sample(logits.ptr<float>(), n, logits.dim(1),
                                 static_cast<const SampleRow*>(dev_params.data), tokens.ptr<int32_t>(),
                                 stream_));
  DFLASH_CUDA_CHECK(cudaMemcpyAsync(tokens_out, tokens.data, n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::argmax(const Tensor& logits, Tensor& out) {
  const int64_t rows = logits.dim(0), vocab = logits.dim(1);
  if (logits.dtype == DType::kF32) {
    DFLASH_CUDA_CHECK(cuda::argmax_rows(logits.ptr<float>(), rows, vocab, out.ptr<int32_t>(), stream_));
  } else {
    check_bf16(logits, "argmax");
    DFLASH_CUDA_CHECK(cuda::argmax_rows(bf(logits), rows, vocab, out.ptr<int32_t>(), stream_));
  }
}

void CudaBackend::nonfinite_rows(const Tensor& logits, Tensor& flags) {
  DFLASH_CHECK(logits.dtype == DType::kF32, "nonfinite_rows: logits must be float32");
  DFLASH_CHECK(flags.numel() >= logits.dim(0), "nonfinite_rows: flags hold ", flags.numel(), " rows, logits ",
               logits.dim(0));
  DFLASH_CUDA_CHECK(cuda::nonfinite_rows(logits.ptr<float>(), logits.dim(0), logits.dim(1), flags.ptr<int32_t>(),
                                         stream_));
}

void CudaBackend::sample_rows(const Tensor& logits, const Tensor& params, Tensor& tokens) {
  DFLASH_CHECK(logits.dtype == DType::kF32, "sample_rows: logits must be float32");
  DFLASH_CUDA_CHECK(cuda::sample(logits.ptr<float>(), logits.dim(0), logits.dim(1),
                                 static_cast<const SampleRow*>(params.data), tokens.ptr<int32_t>(), stream_));
}

void CudaBackend::accept(const Tensor& drafts, const Tensor& logits, const Tensor& params, Tensor& num_accepted,
                         Tensor& next_token) {
  DFLASH_CHECK(logits.dtype == DType::kF32, "accept: logits must be float32");
  const int64_t rows = drafts.dim(0), n = drafts.dim(1);
  DFLASH_CUDA_CHECK(cuda::accept_drafts(drafts.ptr<int32_t>(), logits.ptr<float>(), rows, n, logits.dim(-1),
                                        static_cast<const SampleRow*>(params.data),
                                        num_accepted.ptr<int32_t>(), next_token.ptr<int32_t>(), stream_));
}

void CudaBackend::feed_tokens(Tensor& ids, const Tensor& feed, const Tensor& prev) {
  DFLASH_CUDA_CHECK(cuda::feed_tokens(ids.ptr<int32_t>(), feed.ptr<int32_t>(), prev.ptr<int32_t>(), ids.numel(),
                                      stream_));
}

void CudaBackend::feed_spec_inputs(SpecStepFeed& f) {
  const int64_t b = f.feed.numel();
  if (b == 0) return;
  DFLASH_CUDA_CHECK(cuda::feed_spec_inputs(f.feed.ptr<int32_t>(), f.num_accepted.ptr<int32_t>(),
                                           f.next_token.ptr<int32_t>(), f.block_table.ptr<int32_t>(),
                                           f.block_table.numel() / b, b, f.rows_per_request, f.block_size,
                                           f.ids.ptr<int32_t>(), f.verify_ids.ptr<int32_t>(),
                                           f.positions.ptr<int32_t>(), f.slots.ptr<int32_t>(),
                                           f.kv_len.ptr<int32_t>(), f.anchors.ptr<int32_t>(),
                                           static_cast<SampleRow*>(f.params.data), stream_));
}

void CudaBackend::clear(Tensor& t) {
  if (t.nbytes() > 0) DFLASH_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.nbytes(), stream_));
}

void CudaBackend::record_step(int slot) {
  DFLASH_CHECK(slot == 0 || slot == 1, "record_step: slot ", slot);
  DFLASH_CUDA_CHECK(cudaEventRecord(step_events_[slot], stream_));
}

void CudaBackend::wait_step(int slot) {
  DFLASH_CHECK(slot == 0 || slot == 1, "wait_step: slot ", slot);
  DFLASH_CUDA_CHECK(cudaEventSynchronize(step_events_[slot]));
}

void CudaBackend::assemble_drafts(const Tensor& proposed, const Tensor& override_drafts, const Tensor& use_override,
                                  Tensor& drafts, Tensor& verify_ids) {
  DFLASH_CUDA_CHECK(cuda::assemble_drafts(proposed.ptr<int32_t>(), override_drafts.ptr<int32_t>(),
                                          use_override.ptr<int32_t>(), drafts.dim(0), drafts.dim(1),
                                          drafts.ptr<int32_t>(), verify_ids.ptr<int32_t>(), stream_));
}

void CudaBackend::kv_norm_rope_write_layers(const Tensor& kv, const Tensor& k_norm, float eps,
                                            const Tensor& positions, const Tensor& inv_freq, const Tensor& slots,
                                            KVPool& pool) {
  const int64_t layer_elems = pool.num_blocks * pool.block_size * pool.num_kv_heads * pool.head_dim;
  DFLASH_CHECK(kv.numel() == kv.dim(0) * pool.num_layers * 2 * pool.num_kv_heads * pool.head_dim,
               "kv_norm_rope_write_layers: kv ", shape_str(kv.shape), " does not hold ", pool.num_layers,
               " layers of K/V");
  DFLASH_CUDA_CHECK(cuda::kv_norm_rope_write_layers(bf(kv), k_norm.empty() ? nullptr : bf(k_norm), eps,
                                                    i32(positions), inv_freq.ptr<float>(), i32(slots), kv.dim(0),
                                                    pool.num_layers, pool.num_kv_heads, pool.head_dim, layer_elems,
                                                    bf(pool.k), bf(pool.v), stream_));
}

void CudaBackend::dflash2_check_limits(int64_t top_k, int64_t rank, int64_t taps, int64_t vocab) const {
  DFLASH_CHECK(top_k >= 1 && top_k <= cuda::kTopkMaxK, "selector_top_k ", top_k, " is above the CUDA top-K and walk "
               "kernels' limit of ", cuda::kTopkMaxK);
  DFLASH_CHECK(rank >= 1 && rank <= cuda::kEdgeMaxRank, "selector_rank ", rank, " is above the CUDA edge kernel's "
               "limit of ", cuda::kEdgeMaxRank);
  DFLASH_CHECK(taps >= 1 && taps <= cuda::kConvMaxTaps, "conv_kernel_size ", taps, " is above the CUDA conv "
               "kernel's limit of ", cuda::kConvMaxTaps);
  DFLASH_CHECK(vocab <= cuda::kTopkMaxVocab, "the vocabulary of ", vocab, " tokens is above the CUDA top-K "
               "kernel's limit of ", cuda::kTopkMaxVocab);
}

void CudaBackend::scale(Tensor& x, float factor) {
  check_bf16(x, "scale");
  DFLASH_CUDA_CHECK(cuda::scale_bf16(bf(x), x.numel(), factor, stream_));
}

void CudaBackend::grouped_conv(const Tensor& x, const Tensor& base, const Tensor& deltas, int64_t side,
                               int64_t block, int64_t group, bool accumulate, Tensor& out) {
  const int64_t n = x.dim(0), h = x.dim(1), taps = base.dim(1);
  DFLASH_CHECK(base.dim(0) == 2 && base.dim(2) == h && group >= 1 && h % group == 0 && deltas.dim(0) == n &&
                   deltas.dim(1) == 2 * taps * (h / group) && out.numel() == n * h,
               "grouped_conv: x ", shape_str(x.shape), " base ", shape_str(base.shape), " deltas ",
               shape_str(deltas.shape), " group ", group);
  check_bf16(x, "grouped_conv x");
  check_bf16(deltas, "grouped_conv deltas");
  check_bf16(out, "grouped_conv out");
  DFLASH_CUDA_CHECK(cuda::grouped_conv(bf(x), bf(base), bf(deltas), n, h, taps, group, side, block, accumulate,
                                       bf(out), stream_));
}

void CudaBackend::topk_candidates(const Tensor& logits, int64_t k, float multiplier, float softcap, Tensor& ids,
                                  Tensor& unary) {
  const int64_t rows = logits.dim(0), vocab = logits.dim(1);
  DFLASH_CHECK(logits.dtype == DType::kF32 && ids.numel() == rows * k && unary.numel() == rows * k &&
                   rows <= kTopkCounterSlots,
               "topk_candidates: logits ", shape_str(logits.shape), " k ", k, " ids ", shape_str(ids.shape));
  const size_t ws_bytes = cuda::topk_workspace_bytes(rows, vocab, k);
  Tensor ws = empty({static_cast<int64_t>(ws_bytes)}, DType::kU8);
  DFLASH_CUDA_CHECK(cuda::topk_candidates(logits.ptr<float>(), rows, vocab, k, multiplier, softcap,
                                          ids.ptr<int32_t>(), unary.ptr<float>(), ws.data, ws_bytes, topk_counters_,
                                          stream_));
}

Fp8Weight CudaBackend::fp8_rows(const Tensor& w) {
  check_bf16(w, "fp8_rows");
  DFLASH_CHECK(w.shape.size() == 2, "fp8_rows: w ", shape_str(w.shape), " is not [V, H]");
  const int64_t v = w.dim(0), h = w.dim(1);
  // The FP8 GEMM's limits, checked here (at load) so that a head it cannot run is refused.
  DFLASH_CHECK(h >= 16 && h % 16 == 0 && h <= (int64_t{1} << 30), "the CUDA FP8 head needs a hidden size that is a "
               "multiple of 16, got ", h);
  DFLASH_CHECK(v >= 1 && v <= (int64_t{1} << 30), "the CUDA FP8 head supports up to 2^30 rows, got ", v);
  Fp8Weight f;
  f.q = persistent({v, h}, DType::kU8);
  f.scale = persistent({v}, DType::kF32);
  DFLASH_CUDA_CHECK(cuda::fp8_quantize_rows(bf(w), v, h, f.q.ptr<uint8_t>(), f.scale.ptr<float>(), stream_));
  DFLASH_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return f;
}

void CudaBackend::linear_fp8(const Tensor& x, const Fp8Weight& w, Tensor& out) {
  const int64_t v = w.q.dim(0), h = w.q.dim(1), m = x.numel() / h;
  DFLASH_CHECK(w.q.dtype == DType::kU8 && w.scale.numel() == v && x.numel() == m * h && out.dtype == DType::kF32 &&
                   out.numel() == m * v,
               "linear_fp8: x ", shape_str(x.shape), " q ", shape_str(w.q.shape), " out ", shape_str(out.shape));
  check_bf16(x, "linear_fp8 x");
  // The kernel reads the weights once per launch of up to kFp8GemvMaxRows rows.
  for (int64_t m0 = 0; m0 < m; m0 += cuda::kFp8GemvMaxRows) {
    const int64_t rows = std::min<int64_t>(cuda::kFp8GemvMaxRows, m - m0);
    DFLASH_CUDA_CHECK(cuda::linear_fp8(bf(x) + m0 * h, w.q.ptr<uint8_t>(), w.scale.ptr<float>(), rows, v, h,
                                       out.ptr<float>() + m0 * v, stream_));
  }
}

void CudaBackend::rescore_candidates(const Tensor& h, const Tensor& head, float multiplier, float softcap,
                                     Tensor& ids, Tensor& unary) {
  const int64_t rows = ids.dim(0), k = ids.dim(1), hidden = head.dim(1);
  DFLASH_CHECK(ids.dtype == DType::kI32 && h.numel() == rows * hidden && unary.dtype == DType::kF32 &&
                   unary.numel() == rows * k && k <= cuda::kTopkMaxK,
               "rescore_candidates: h ", shape_str(h.shape), " head ", shape_str(head.shape), " ids ",
               shape_str(ids.shape), " unary ", shape_str(unary.shape));
  check_bf16(h, "rescore_candidates h");
  check_bf16(head, "rescore_candidates head");
  DFLASH_CUDA_CHECK(cuda::rescore_candidates(bf(h), bf(head), rows, k, hidden, head.dim(0), multiplier, softcap,
                                             ids.ptr<int32_t>(), unary.ptr<float>(), stream_));
}

void CudaBackend::edge_scores(const Tensor& ids, const Tensor& unary, const Tensor& gate, const Tensor& anchors,
                              const Tensor& pred_codebook, const Tensor& succ_codebook, Tensor& edges) {
  const int64_t b = ids.dim(0), slots = ids.dim(1), k = ids.dim(2), rank = gate.dim(-1);
  DFLASH_CHECK(unary.numel() == b * slots * k && gate.numel() == b * slots * rank && anchors.numel() == b &&
                   gate.dtype == DType::kF32 && pred_codebook.dim(1) == rank &&
                   succ_codebook.dim(0) == pred_codebook.dim(0) && succ_codebook.dim(1) == rank &&
                   edges.numel() == b * slots * k * k,
               "edge_scores: ids ", shape_str(ids.shape), " gate ", shape_str(gate.shape), " codebooks ",
               shape_str(pred_codebook.shape));
  DFLASH_CUDA_CHECK(cuda::edge_scores(ids.ptr<int32_t>(), unary.ptr<float>(), gate.ptr<float>(),
                                      anchors.ptr<int32_t>(), bf(pred_codebook), bf(succ_codebook), b, slots, k, rank,
                                      pred_codebook.dim(0), edges.ptr<float>(), stream_));
}

void CudaBackend::lattice_walk(const Tensor& edges, const Tensor& ids, const Tensor& params, bool greedy_walk,
                               Tensor& drafts, Tensor& realized) {
  const int64_t b = ids.dim(0), slots = ids.dim(1), k = ids.dim(2);
  DFLASH_CHECK(edges.numel() == b * slots * k * k && drafts.numel() == b * slots && realized.numel() == b * slots * k,
               "lattice_walk: edges ", shape_str(edges.shape), " ids ", shape_str(ids.shape));
  triton_aot::LatticeWalkArgs a;
  a.edges = edges.ptr<float>();
  a.ids = ids.ptr<int32_t>();
  a.params = params.data;
  a.drafts = drafts.ptr<int32_t>();
  a.realized = realized.ptr<float>();
  a.num_reqs = static_cast<int32_t>(b);
  a.slots = static_cast<int32_t>(slots);
  a.k = static_cast<int32_t>(k);
  a.greedy_walk = greedy_walk;
  const CUresult r = triton_aot::lattice_walk(*triton_, stream_, a);
  DFLASH_CHECK(r == CUDA_SUCCESS, "Triton lattice walk failed (CUresult ", static_cast<int>(r), ")");
}

void CudaBackend::accept_candidates(const Tensor& drafts, const Tensor& ids, const Tensor& realized,
                                    const Tensor& logits, const Tensor& params, Tensor& num_accepted,
                                    Tensor& next_token) {
  const bool dense = ids.shape.empty();  // no candidate ids: dense rows over the vocabulary
  const int64_t rows = drafts.dim(0), n = drafts.dim(1), vocab = logits.dim(-1);
  const int64_t k = dense ? realized.dim(-1) : ids.dim(-1);
  DFLASH_CHECK(logits.dtype == DType::kF32 && realized.dtype == DType::kF32 &&
                   (dense ? k == vocab : ids.numel() == rows * n * k) && realized.numel() == rows * n * k &&
                   logits.numel() == rows * (n + 1) * vocab,
               "accept_candidates: drafts ", shape_str(drafts.shape), " ids ", shape_str(ids.shape), " realized ",
               shape_str(realized.shape), " logits ", shape_str(logits.shape));
  DFLASH_CUDA_CHECK(cuda::accept_candidates(drafts.ptr<int32_t>(), dense ? nullptr : ids.ptr<int32_t>(),
                                            realized.ptr<float>(), k, logits.ptr<float>(), rows, n, vocab,
                                            static_cast<const SampleRow*>(params.data),
                                            num_accepted.ptr<int32_t>(), next_token.ptr<int32_t>(), stream_));
}

void CudaBackend::sample_drafts(const Tensor& logits, const Tensor& params, int64_t n, Tensor& drafts) {
  const int64_t rows = logits.dim(0), vocab = logits.dim(1);
  DFLASH_CHECK(logits.dtype == DType::kF32 && n >= 1 && rows % n == 0 && drafts.numel() == rows,
               "sample_drafts: logits ", shape_str(logits.shape), " n ", n, " drafts ", shape_str(drafts.shape));
  DFLASH_CUDA_CHECK(cuda::sample_drafts(logits.ptr<float>(), rows, n, vocab,
                                        static_cast<const SampleRow*>(params.data), drafts.ptr<int32_t>(),
                                        stream_));
}

std::shared_ptr<void> CudaBackend::host_alloc(size_t bytes) {
  void* p = nullptr;
  DFLASH_CUDA_CHECK(cudaMallocHost(&p, std::max<size_t>(bytes, 1)));
  return std::shared_ptr<void>(p, [](void* q) { cudaFreeHost(q); });
}

void CudaBackend::copy_to_device(Tensor& dst, const void* host, size_t bytes) {
  DFLASH_CHECK(bytes <= dst.nbytes(), "copy_to_device: ", bytes, " bytes into a tensor of ", dst.nbytes());
  if (bytes) DFLASH_CUDA_CHECK(cudaMemcpyAsync(dst.data, host, bytes, cudaMemcpyHostToDevice, stream_));
}

void CudaBackend::copy_to_host(void* host, const Tensor& src, size_t bytes) {
  DFLASH_CHECK(bytes <= src.nbytes(), "copy_to_host: ", bytes, " bytes from a tensor of ", src.nbytes());
  if (bytes) DFLASH_CUDA_CHECK(cudaMemcpyAsync(host, src.data, bytes, cudaMemcpyDeviceToHost, stream_));
}

namespace {
class CudaGraph final : public CapturedGraph {
 public:
  CudaGraph(cudaGraph_t g, cudaGraphExec_t e) : graph_(g), exec_(e) {}
  ~CudaGraph() override {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  cudaGraphExec_t exec() const { return exec_; }

 private:
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
};
}  // namespace

void CudaBackend::capture_begin() {
  DFLASH_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
}

std::unique_ptr<CapturedGraph> CudaBackend::capture_end() {
  cudaGraph_t graph = nullptr;
  DFLASH_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  if (err != cudaSuccess) {
    cudaGraphDestroy(graph);
    DFLASH_CUDA_CHECK(err);
  }
  auto captured = std::make_unique<CudaGraph>(graph, exec);
  // Its device-side setup now, on the stream, rather than in the first replay (a decode step).
  DFLASH_CUDA_CHECK(cudaGraphUpload(exec, stream_));
  return captured;
}

void CudaBackend::graph_launch(const CapturedGraph& graph) {
  DFLASH_CUDA_CHECK(cudaGraphLaunch(static_cast<const CudaGraph&>(graph).exec(), stream_));
}

}  // namespace dflash
