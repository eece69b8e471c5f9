// Test-only bindings of the CUDA kernels of cuda/kernels.h, added to dflash._core.testing as
// cuda_<op>. They take torch CUDA tensors (contiguous; outputs are passed in, nothing is
// allocated here except the SampleRow array of the sampling / acceptance ops and the cuBLASLt
// workspace of cublaslt_gemm), launch on the default stream, synchronise, and turn a CUDA error
// into dflash::Error. The GEMMs (skinny_gemm, cublaslt_gemm) may instead launch on a given
// stream without synchronising, for benchmarks and CUDA-graph capture.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "backend/cuda/cublaslt_gemm.h"
#include "bindings/cuda_testing_util.h"
#include "common/error.h"
#include "cuda/kernels.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace dflash {
namespace {

using namespace testing_bindings;

int64_t numel(const Any& a) { return static_cast<int64_t>(a.size()); }

// The SampleRow of R rows on the device, freed with the object.
class DeviceParams {
 public:
  DeviceParams(const std::vector<float>& temperature, const std::vector<int32_t>& top_k,
               const std::vector<float>& top_p, const std::vector<uint64_t>& seed,
               const std::vector<int64_t>& position, size_t rows) {
    DFLASH_ARG_CHECK(temperature.size() == rows && top_k.size() == rows && top_p.size() == rows &&
                         seed.size() == rows && position.size() == rows,
                     "temperature, top_k, top_p, seed and position need one entry per row (", rows,
                     ")");
    std::vector<SampleRow> host(rows);
    for (size_t r = 0; r < rows; ++r) host[r] = SampleRow(temperature[r], top_k[r], top_p[r], seed[r], position[r]);
    if (rows == 0) return;
    cudaError_t e = cudaMalloc(&ptr_, rows * sizeof(SampleRow));
    DFLASH_CHECK(e == cudaSuccess, "cudaMalloc: ", cudaGetErrorString(e));
    e = cudaMemcpy(ptr_, host.data(), rows * sizeof(SampleRow), cudaMemcpyHostToDevice);
    if (e != cudaSuccess) cudaFree(ptr_);
    DFLASH_CHECK(e == cudaSuccess, "cudaMemcpy: ", cudaGetErrorString(e));
  }
  ~DeviceParams() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceParams(const DeviceParams&) = delete;
  DeviceParams& operator=(const DeviceParams&) = delete;
  const SampleRow* get() const { return ptr_; }

 private:
  SampleRow* ptr_ = nullptr;
};

void cuda_embedding(const Any& table, const I32& ids, const Any& out, const I32& bad_id) {
  DFLASH_ARG_CHECK(table.ndim() == 2 && out.ndim() == 2 && out.shape(0) == ids.size() &&
                       out.shape(1) == table.shape(1) && bad_id.size() >= 1,
                   "embedding: table [V, H], ids [T], out [T, H], bad_id [1]");
  use_device(table.device_id());
  finish("embedding", cuda::embedding(bf16(table, "table"), ids.data(), ids.size(),
                                      table.shape(1), table.shape(0), bf16(out, "out"),
                                      bad_id.data(), nullptr));
}

void cuda_rms_norm(const Any& x, const Any& w, float eps, const Any& out) {
  const int64_t h = numel(w);
  DFLASH_ARG_CHECK(h > 0 && numel(x) % h == 0 && numel(out) == numel(x),
                   "rms_norm: x [R, H], w [H], out [R, H]");
  use_device(x.device_id());
  finish("rms_norm", cuda::rms_norm(bf16(x, "x"), bf16(w, "w"), numel(x) / h, h, eps,
                                    bf16(out, "out"), nullptr));
}

void cuda_add_rms_norm(const Any& residual, const Any& x, const Any& w, float eps,
                       const Any& out) {
  const int64_t h = numel(w);
  DFLASH_ARG_CHECK(h > 0 && numel(x) % h == 0 && numel(residual) == numel(x) &&
                       numel(out) == numel(x),
                   "add_rms_norm: residual [R, H], x [R, H], w [H], out [R, H]");
  use_device(x.device_id());
  finish("add_rms_norm",
         cuda::add_rms_norm(bf16(residual, "residual"), bf16(x, "x"), bf16(w, "w"),
                            numel(x) / h, h, eps, bf16(out, "out"), nullptr));
}

void cuda_silu_mul(const Any& gate_up, const Any& out) {
  DFLASH_ARG_CHECK(out.ndim() == 2 && gate_up.ndim() == 2 && gate_up.shape(0) == out.shape(0) &&
                       gate_up.shape(1) == 2 * out.shape(1),
                   "silu_mul: gate_up [R, 2I], out [R, I]");
  use_device(out.device_id());
  finish("silu_mul", cuda::silu_mul(bf16(gate_up, "gate_up"), out.shape(0), out.shape(1),
                                    bf16(out, "out"), nullptr));
}

void cuda_add(const Any& a, const Any& b, const Any& out) {
  DFLASH_ARG_CHECK(numel(a) == numel(b) && numel(a) == numel(out), "add: a, b, out of one size");
  use_device(out.device_id());
  finish("add", cuda::add(bf16(a, "a"), bf16(b, "b"), numel(a), bf16(out, "out"),
                          nullptr));
}

// L2 prefetch of the first `bytes` bytes of w (any dtype) over at most max_blocks CTAs.
void cuda_l2_prefetch(const Any& w, int64_t bytes, int max_blocks) {
  use_device(w.device_id());
  DFLASH_ARG_CHECK(bytes <= static_cast<int64_t>(w.nbytes()), "l2_prefetch: bytes (", bytes, ") past the end of w (",
                   w.nbytes(), " bytes)");
  finish("l2_prefetch", cuda::l2_prefetch(w.data(), bytes, max_blocks, nullptr));
}

// Rows `rows` of src copied into dst (both [R, ...], one dtype and shape) late: cuda::late_copy_rows,
// launched on stream (a kernel launched next on it starts before the copy lands).
void cuda_late_copy_rows(const Any& dst, const Any& src, const I32& rows, uint32_t delay_ns, uintptr_t stream) {
  DFLASH_ARG_CHECK(dst.ndim() >= 1 && dst.shape(0) > 0 && dst.nbytes() == src.nbytes() &&
                       dst.shape(0) == src.shape(0) && dst.dtype() == src.dtype() &&
                       dst.device_id() == src.device_id() && rows.device_id() == dst.device_id(),
                   "late_copy_rows: dst and src of one dtype and shape, rows on their device");
  use_device(dst.device_id());
  const int64_t total_rows = static_cast<int64_t>(dst.shape(0));
  const int64_t row_bytes = static_cast<int64_t>(dst.nbytes()) / total_rows;
  DFLASH_ARG_CHECK(row_bytes % 16 == 0, "late_copy_rows: rows of a multiple of 16 bytes");
  if (rows.size() == 0) return;
  run("late_copy_rows", stream,
      cuda::late_copy_rows(dst.data(), src.data(), total_rows, rows.data(), static_cast<int64_t>(rows.size()),
                           row_bytes, delay_ns, reinterpret_cast<cudaStream_t>(stream)));
}

void cuda_bf16_to_f32(const Any& x, const F32& out) {
  DFLASH_ARG_CHECK(numel(x) == static_cast<int64_t>(out.size()), "bf16_to_f32: x, out of one size");
  use_device(x.device_id());
  finish("bf16_to_f32", cuda::bf16_to_f32(bf16(x, "x"), numel(x), out.data(), nullptr));
}

void cuda_f32_to_bf16(const F32& x, const Any& out) {
  DFLASH_ARG_CHECK(numel(out) == static_cast<int64_t>(x.size()), "f32_to_bf16: x, out of one size");
  use_device(out.device_id());
  finish("f32_to_bf16", cuda::f32_to_bf16(x.data(), x.size(), bf16(out, "out"), nullptr));
}

void cuda_qkv_norm_rope(const Any& qkv, const std::optional<Any>& q_norm,
                        const std::optional<Any>& k_norm, float eps, const I32& positions,
                        const F32& inv_freq, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, const std::optional<Any>& q, const Any& k, const Any& v) {
  const int64_t t = static_cast<int64_t>(positions.size());
  DFLASH_ARG_CHECK(numel(qkv) == t * (num_heads + 2 * num_kv_heads) * head_dim &&
                       static_cast<int64_t>(inv_freq.size()) * 2 == head_dim &&
                       numel(k) == t * num_kv_heads * head_dim && numel(v) == numel(k) &&
                       (num_heads == 0 || (q && numel(*q) == t * num_heads * head_dim)),
                   "qkv_norm_rope: qkv [T, (nh + 2 nkv) hd], positions [T], inv_freq [hd/2], "
                   "q [T, nh, hd], k, v [T, nkv, hd]");
  use_device(qkv.device_id());
  finish("qkv_norm_rope",
         cuda::qkv_norm_rope(bf16(qkv, "qkv"), bf16(q_norm, "q_norm"),
                             bf16(k_norm, "k_norm"), eps, positions.data(), inv_freq.data(), t,
                             num_heads, num_kv_heads, head_dim, bf16(q, "q"), bf16(k, "k"),
                             bf16(v, "v"), nullptr));
}

// stream: launch there and return (benchmarks, graph capture); None: default stream, synchronised.
void cuda_qkv_norm_rope_write(const Any& qkv, const std::optional<Any>& q_norm, const std::optional<Any>& k_norm,
                              float eps, const I32& positions, const F32& inv_freq, const I32& slots,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const Any& q,
                              const Any& k_pool, const Any& v_pool, std::optional<uintptr_t> stream) {
  const int64_t t = static_cast<int64_t>(positions.size());
  DFLASH_ARG_CHECK(numel(qkv) == t * (num_heads + 2 * num_kv_heads) * head_dim &&
                       static_cast<int64_t>(inv_freq.size()) * 2 == head_dim &&
                       static_cast<int64_t>(slots.size()) == t && numel(q) == t * num_heads * head_dim &&
                       numel(k_pool) == numel(v_pool) && numel(k_pool) % (num_kv_heads * head_dim) == 0,
                   "qkv_norm_rope_write: qkv [T, (nh + 2 nkv) hd], positions, slots [T], inv_freq [hd/2], "
                   "q [T, nh, hd], pools [S, nkv hd]");
  use_device(qkv.device_id());
  run("qkv_norm_rope_write", stream,
      cuda::qkv_norm_rope_write(bf16(qkv, "qkv"), bf16(q_norm, "q_norm"), bf16(k_norm, "k_norm"), eps,
                                positions.data(), inv_freq.data(), slots.data(), t, num_heads, num_kv_heads, head_dim,
                                bf16(q, "q"), bf16(k_pool, "k_pool"), bf16(v_pool, "v_pool"), as_stream(stream)));
}

void cuda_kv_write(const Any& k, const Any& v, const I32& slots, const Any& k_pool,
                   const Any& v_pool) {
  const int64_t t = static_cast<int64_t>(slots.size());
  DFLASH_ARG_CHECK(t > 0 && numel(k) % t == 0 && numel(v) == numel(k) &&
                       numel(k_pool) == numel(v_pool) && numel(k_pool) % (numel(k) / t) == 0,
                   "kv_write: k, v [T, row], slots [T], pools [S, row]");
  use_device(k.device_id());
  finish("kv_write", cuda::kv_write(bf16(k, "k"), bf16(v, "v"), slots.data(), t,
                                    numel(k) / t, bf16(k_pool, "k_pool"),
                                    bf16(v_pool, "v_pool"), nullptr));
}

void cuda_kv_norm_rope_write(const Any& kv, const std::optional<Any>& k_norm, float eps,
                             const I32& positions, const F32& inv_freq, const I32& slots,
                             int64_t num_kv_heads, int64_t head_dim, const Any& k_pool,
                             const Any& v_pool) {
  const int64_t t = static_cast<int64_t>(positions.size());
  DFLASH_ARG_CHECK(numel(kv) == t * 2 * num_kv_heads * head_dim &&
                       static_cast<int64_t>(slots.size()) == t &&
                       static_cast<int64_t>(inv_freq.size()) * 2 == head_dim &&
                       numel(k_pool) == numel(v_pool) && numel(k_pool) % (num_kv_heads * head_dim) == 0,
                   "kv_norm_rope_write: kv [C, 2 nkv hd], positions, slots [C], inv_freq [hd/2], "
                   "pools [S, nkv hd]");
  use_device(kv.device_id());
  finish("kv_norm_rope_write",
         cuda::kv_norm_rope_write(bf16(kv, "kv"), bf16(k_norm, "k_norm"), eps,
                                  positions.data(), inv_freq.data(), slots.data(), t, num_kv_heads,
                                  head_dim, bf16(k_pool, "k_pool"), bf16(v_pool, "v_pool"),
                                  nullptr));
}

void cuda_kv_norm_rope_write_layers(const Any& kv, const std::optional<Any>& k_norm, float eps, const I32& positions,
                                    const F32& inv_freq, const I32& slots, int64_t num_layers,
                                    int64_t num_kv_heads, int64_t head_dim, const Any& k_pool, const Any& v_pool) {
  const int64_t t = static_cast<int64_t>(positions.size());
  DFLASH_ARG_CHECK(num_layers >= 1 && numel(kv) == t * num_layers * 2 * num_kv_heads * head_dim &&
                       static_cast<int64_t>(slots.size()) == t &&
                       static_cast<int64_t>(inv_freq.size()) * 2 == head_dim &&
                       (!k_norm || numel(*k_norm) == num_layers * head_dim) && numel(k_pool) == numel(v_pool) &&
                       numel(k_pool) % (num_layers * num_kv_heads * head_dim) == 0,
                   "kv_norm_rope_write_layers: kv [C, L, 2 nkv hd], k_norm [L, hd], positions, slots [C], "
                   "inv_freq [hd/2], pools [L, S, nkv hd]");
  use_device(kv.device_id());
  finish("kv_norm_rope_write_layers",
         cuda::kv_norm_rope_write_layers(bf16(kv, "kv"), bf16(k_norm, "k_norm"), eps, positions.data(),
                                         inv_freq.data(), slots.data(), t, num_layers, num_kv_heads, head_dim,
                                         numel(k_pool) / num_layers, bf16(k_pool, "k_pool"),
                                         bf16(v_pool, "v_pool"), nullptr));
}

void cuda_argmax_rows(const Any& logits, const I32& out) {
  DFLASH_ARG_CHECK(logits.ndim() == 2 && static_cast<int64_t>(out.size()) == static_cast<int64_t>(logits.shape(0)),
                   "argmax_rows: logits [R, V], out [R]");
  use_device(logits.device_id());
  const int64_t rows = logits.shape(0), vocab = logits.shape(1);
  if (logits.dtype() == nb::dtype<float>()) {
    finish("argmax_rows", cuda::argmax_rows(static_cast<const float*>(logits.data()), rows, vocab, out.data(), nullptr));
  } else {
    finish("argmax_rows", cuda::argmax_rows(bf16(logits, "logits"), rows, vocab, out.data(), nullptr));
  }
}

void cuda_nonfinite_rows(const F32& logits, const I32& flags) {
  DFLASH_ARG_CHECK(logits.ndim() == 2 && static_cast<int64_t>(flags.size()) == static_cast<int64_t>(logits.shape(0)),
                   "nonfinite_rows: logits [R, V], flags [R]");
  use_device(logits.device_id());
  finish("nonfinite_rows", cuda::nonfinite_rows(logits.data(), logits.shape(0), logits.shape(1), flags.data(), nullptr));
}

void cuda_assemble_drafts(const I32& proposed, const I32& override_drafts, const I32& use_override, const I32& drafts,
                          const I32& verify_ids) {
  DFLASH_ARG_CHECK(drafts.ndim() == 2 && verify_ids.ndim() == 2 && verify_ids.shape(0) == drafts.shape(0) &&
                       verify_ids.shape(1) == drafts.shape(1) + 1 && proposed.size() == drafts.size() &&
                       override_drafts.size() == drafts.size() && use_override.size() == drafts.shape(0),
                   "assemble_drafts: proposed, override, drafts [R, n], use_override [R], verify_ids [R, n + 1]");
  use_device(drafts.device_id());
  finish("assemble_drafts", cuda::assemble_drafts(proposed.data(), override_drafts.data(), use_override.data(),
                                                  drafts.shape(0), drafts.shape(1), drafts.data(), verify_ids.data(),
                                                  nullptr));
}

// cuda::feed_spec_inputs over b = feed.size() requests of q = ids.size() / b rows: block_table
// [b, width]; params uint8 [b * sizeof(SampleRow)] (the packed SampleRows, position moved on).
void cuda_feed_spec_inputs(const I32& feed, const I32& num_accepted, const I32& next_token, const I32& block_table,
                           int64_t block_size, const I32& ids, const I32& verify_ids, const I32& positions,
                           const I32& slots, const I32& kv_len, const I32& anchors, const U8& params) {
  const int64_t b = static_cast<int64_t>(feed.size());
  DFLASH_ARG_CHECK(b > 0 && block_table.ndim() == 2 && block_table.shape(0) == b && ids.size() % b == 0 &&
                       verify_ids.size() == ids.size() && positions.size() == ids.size() &&
                       slots.size() == ids.size() && kv_len.size() == b && anchors.size() == b &&
                       params.size() == b * sizeof(SampleRow) && num_accepted.size() == next_token.size(),
                   "feed_spec_inputs: feed, kv_len, anchors [b], block_table [b, width], ids, verify_ids, positions, "
                   "slots [b * q], params [b * 32] bytes, num_accepted and next_token of one size");
  use_device(feed.device_id());
  finish("feed_spec_inputs",
         cuda::feed_spec_inputs(feed.data(), num_accepted.data(), next_token.data(), block_table.data(),
                                block_table.shape(1), b, static_cast<int64_t>(ids.size()) / b, block_size, ids.data(),
                                verify_ids.data(), positions.data(), slots.data(), kv_len.data(), anchors.data(),
                                reinterpret_cast<SampleRow*>(params.data()), nullptr));
}

void cuda_gather_rows(const Any& x, const I32& rows, const Any& out) {
  const int64_t elem_bytes = x.dtype().bits / 8;
  DFLASH_ARG_CHECK(x.ndim() == 2 && out.ndim() == 2 && out.shape(0) == rows.size() &&
                       out.shape(1) == x.shape(1) && x.dtype() == out.dtype() &&
                       (elem_bytes == 2 || elem_bytes == 4),
                   "gather_rows: x [N, W], rows [R], out [R, W] of one 2- or 4-byte dtype");
  use_device(x.device_id());
  finish("gather_rows", cuda::gather_rows(x.data(), rows.data(), rows.size(), x.shape(1),
                                          elem_bytes, out.data(), nullptr));
}

void cuda_copy_columns(const Any& src, const Any& dst, int64_t col) {
  DFLASH_ARG_CHECK(src.ndim() == 2 && dst.ndim() == 2 && src.shape(0) == dst.shape(0) &&
                       col >= 0 && col + static_cast<int64_t>(src.shape(1)) <= static_cast<int64_t>(dst.shape(1)),
                   "copy_columns: src [R, C], dst [R, W], col + C <= W");
  use_device(src.device_id());
  finish("copy_columns", cuda::copy_columns(bf16(src, "src"), src.shape(0), src.shape(1),
                                            bf16(dst, "dst"), dst.shape(1), col, nullptr));
}

void cuda_sample(const F32& logits, const std::vector<float>& temperature,
                 const std::vector<int32_t>& top_k, const std::vector<float>& top_p,
                 const std::vector<uint64_t>& seed, const std::vector<int64_t>& position,
                 const I32& tokens) {
  DFLASH_ARG_CHECK(logits.ndim() == 2 && tokens.size() == logits.shape(0),
                   "sample: logits [R, V], tokens [R]");
  use_device(logits.device_id());
  DeviceParams params(temperature, top_k, top_p, seed, position, logits.shape(0));
  finish("sample", cuda::sample(logits.data(), logits.shape(0), logits.shape(1), params.get(),
                                tokens.data(), nullptr));
}

void cuda_accept_drafts(const I32& drafts, const F32& logits, const std::vector<float>& temperature,
                        const std::vector<int32_t>& top_k, const std::vector<float>& top_p,
                        const std::vector<uint64_t>& seed, const std::vector<int64_t>& position,
                        const I32& num_accepted, const I32& next_token) {
  DFLASH_ARG_CHECK(drafts.ndim() == 2 && logits.ndim() == 3 && logits.shape(0) == drafts.shape(0) &&
                       logits.shape(1) == drafts.shape(1) + 1 &&
                       num_accepted.size() == drafts.shape(0) && next_token.size() == drafts.shape(0),
                   "accept_drafts: drafts [R, n], logits [R, n + 1, V], num_accepted, next_token [R]");
  use_device(logits.device_id());
  DeviceParams params(temperature, top_k, top_p, seed, position, drafts.shape(0));
  finish("accept_drafts",
         cuda::accept_drafts(drafts.data(), logits.data(), drafts.shape(0), drafts.shape(1),
                             logits.shape(2), params.get(), num_accepted.data(), next_token.data(),
                             nullptr));
}

// drafts [R, n], cand_ids [R, n, K] (None: dense proposals, K == V), realized [R, n, K],
// logits [R, n + 1, V], num_accepted [R], next_token [R].
void cuda_accept_candidates(const I32& drafts, const std::optional<I32>& cand_ids, const F32& realized,
                            const F32& logits, const std::vector<float>& temperature,
                            const std::vector<int32_t>& top_k, const std::vector<float>& top_p,
                            const std::vector<uint64_t>& seed, const std::vector<int64_t>& position,
                            const I32& num_accepted, const I32& next_token) {
  DFLASH_ARG_CHECK(drafts.ndim() == 2 && logits.ndim() == 3 && realized.ndim() == 3 &&
                       logits.shape(0) == drafts.shape(0) && logits.shape(1) == drafts.shape(1) + 1 &&
                       realized.shape(0) == drafts.shape(0) && realized.shape(1) == drafts.shape(1) &&
                       num_accepted.size() == drafts.shape(0) && next_token.size() == drafts.shape(0),
                   "accept_candidates: drafts [R, n], realized [R, n, K], logits [R, n + 1, V], "
                   "num_accepted, next_token [R]");
  const size_t k = realized.shape(2);
  if (cand_ids) {
    DFLASH_ARG_CHECK(cand_ids->ndim() == 3 && cand_ids->shape(0) == drafts.shape(0) &&
                         cand_ids->shape(1) == drafts.shape(1) && cand_ids->shape(2) == k,
                     "accept_candidates: cand_ids [R, n, K] like realized");
  } else {
    DFLASH_ARG_CHECK(k == logits.shape(2), "accept_candidates: dense proposals need realized [R, n, V]");
  }
  use_device(logits.device_id());
  DeviceParams params(temperature, top_k, top_p, seed, position, drafts.shape(0));
  finish("accept_candidates",
         cuda::accept_candidates(drafts.data(), cand_ids ? cand_ids->data() : nullptr, realized.data(),
                                 static_cast<int64_t>(k),
                                 logits.data(), drafts.shape(0), drafts.shape(1), logits.shape(2),
                                 params.get(), num_accepted.data(), next_token.data(), nullptr));
}

// logits [rows, V], n drafts per request (params per request: rows / n entries), drafts [rows].
void cuda_sample_drafts(const F32& logits, int64_t n, const std::vector<float>& temperature,
                        const std::vector<uint64_t>& seed, const std::vector<int64_t>& position,
                        const I32& drafts) {
  const int64_t rows = static_cast<int64_t>(logits.shape(0));
  DFLASH_ARG_CHECK(logits.ndim() == 2 && n > 0 && rows % n == 0 && drafts.size() == logits.shape(0),
                   "sample_drafts: logits [R * n, V], drafts [R * n], n > 0");
  const size_t requests = static_cast<size_t>(rows / n);
  use_device(logits.device_id());
  DeviceParams params(temperature, std::vector<int32_t>(requests, 0), std::vector<float>(requests, 1.0f), seed,
                      position, requests);
  finish("sample_drafts", cuda::sample_drafts(logits.data(), rows, n, logits.shape(1), params.get(), drafts.data(),
                                              nullptr));
}

// x [M, K] bf16, w [N, K] bf16, out [M, N] bf16 or fp32. Returns out_f32.
bool check_gemm(const Any& x, const Any& w, const Any& out, const char* op) {
  DFLASH_ARG_CHECK(x.ndim() == 2 && w.ndim() == 2 && out.ndim() == 2 && x.shape(1) == w.shape(1) &&
                       out.shape(0) == x.shape(0) && out.shape(1) == w.shape(0),
                   op, ": x [M, K], w [N, K], out [M, N]");
  const bool f32 = out.dtype() == nb::dtype<float>();
  DFLASH_ARG_CHECK(f32 || (out.dtype().code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) &&
                           out.dtype().bits == 16),
                   op, ": out must be bfloat16 or float32");
  return f32;
}

// stream: a cudaStream_t as an integer (torch.cuda.current_stream().cuda_stream): launch there and
// return; None: launch on the default stream and synchronise.
void cuda_skinny_gemm(const Any& x, const Any& w, const Any& out, std::optional<uintptr_t> stream, int warps,
                      int row_tiles, int unroll, bool batch_invariant) {
  const bool f32 = check_gemm(x, w, out, "skinny_gemm");
  use_device(x.device_id());
  cuda::SkinnyGemmConfig config;
  config.warps = warps;
  config.row_tiles = row_tiles;
  config.unroll = unroll;
  config.batch_invariant = batch_invariant;
  const cudaStream_t s = stream ? reinterpret_cast<cudaStream_t>(*stream) : nullptr;
  run("skinny_gemm", stream,
      cuda::skinny_gemm(bf16(x, "x"), bf16(w, "w"), x.shape(0), w.shape(0), x.shape(1), f32, out.data(), s, &config));
}

// The fused skinny GEMM: mode "rms_norm" (inp [M, K] normalised with gamma [K]), "silu_mul" (inp
// [M, 2K] = [gate | up]) or "plain" (inp [M, K]); add: out (bf16 [M, N]) += the product.
void cuda_skinny_gemm_fused(const Any& inp, const Any& w, const Any& out, const std::string& mode,
                            std::optional<Any> gamma, float eps, bool add, bool batch_invariant) {
  DFLASH_ARG_CHECK(inp.ndim() == 2 && w.ndim() == 2 && out.ndim() == 2 && out.shape(0) == inp.shape(0) &&
                       out.shape(1) == w.shape(0),
                   "skinny_gemm_fused: inp [M, K or 2K], w [N, K], out [M, N]");
  cuda::SkinnyFusion f;
  f.add = add;
  f.eps = eps;
  f.batch_invariant = batch_invariant;
  int64_t in_cols = w.shape(1);
  if (mode == "rms_norm") {
    f.input = cuda::SkinnyInput::kRmsNorm;
    DFLASH_ARG_CHECK(gamma.has_value() && gamma->ndim() == 1 && gamma->shape(0) == w.shape(1),
                     "skinny_gemm_fused: rms_norm needs gamma [K]");
    f.gamma = bf16(*gamma, "gamma");
  } else if (mode == "silu_mul") {
    f.input = cuda::SkinnyInput::kSiluMul;
    in_cols = 2 * w.shape(1);
  } else {
    DFLASH_ARG_CHECK(mode == "plain", "skinny_gemm_fused: mode is rms_norm, silu_mul or plain, not ", mode);
  }
  DFLASH_ARG_CHECK(inp.shape(1) == in_cols, "skinny_gemm_fused: inp has ", inp.shape(1), " columns, expected ",
                   in_cols);
  use_device(inp.device_id());
  const __nv_bfloat16* in = bf16(inp, "inp");
  const __nv_bfloat16* wp = bf16(w, "w");
  DFLASH_ARG_CHECK(cuda::skinny_gemm_fused_supports(in, wp, inp.shape(0), w.shape(1), f),
                   "skinny_gemm_fused: unsupported (M <= 16 unless batch_invariant, K % 8 == 0, 16-byte aligned, shared memory)");
  finish("skinny_gemm_fused", cuda::skinny_gemm_fused(in, wp, inp.shape(0), w.shape(0), w.shape(1), f,
                                                      bf16(out, "out"), nullptr));
}

// The streaming skinny GEMM: mode "plain" (inp [M, K]; out bf16 or fp32), "rms_norm" or "silu_mul"
// as cuda_skinny_gemm_fused; add: out (bf16) += the product; the launch shape as StreamGemmConfig
// (min_warps: refused where the launcher's shape keeps fewer warps).
void cuda_stream_gemm(const Any& inp, const Any& w, const Any& out, const std::string& mode, std::optional<Any> gamma,
                      float eps, bool add, int warps, int stages, int unroll, int ctas_per_sm, bool batch_invariant,
                      int min_warps, std::optional<uintptr_t> stream) {
  DFLASH_ARG_CHECK(inp.ndim() == 2 && w.ndim() == 2 && out.ndim() == 2 && out.shape(0) == inp.shape(0) &&
                       out.shape(1) == w.shape(0),
                   "stream_gemm: inp [M, K or 2K], w [N, K], out [M, N]");
  const bool f32 = out.dtype() == nb::dtype<float>();
  cuda::SkinnyFusion f;
  f.add = add;
  f.eps = eps;
  int64_t in_cols = w.shape(1);
  if (mode == "rms_norm") {
    f.input = cuda::SkinnyInput::kRmsNorm;
    DFLASH_ARG_CHECK(gamma.has_value() && gamma->ndim() == 1 && gamma->shape(0) == w.shape(1),
                     "stream_gemm: rms_norm needs gamma [K]");
    f.gamma = bf16(*gamma, "gamma");
  } else if (mode == "silu_mul") {
    f.input = cuda::SkinnyInput::kSiluMul;
    in_cols = 2 * w.shape(1);
  } else {
    DFLASH_ARG_CHECK(mode == "plain", "stream_gemm: mode is rms_norm, silu_mul or plain, not ", mode);
  }
  DFLASH_ARG_CHECK(inp.shape(1) == in_cols, "stream_gemm: inp has ", inp.shape(1), " columns, expected ", in_cols);
  DFLASH_ARG_CHECK(!f32 || (f.input == cuda::SkinnyInput::kPlain && !add), "stream_gemm: fp32 out is plain only");
  use_device(inp.device_id());
  cuda::StreamGemmConfig config;
  config.warps = warps;
  config.stages = stages;
  config.unroll = unroll;
  config.ctas_per_sm = ctas_per_sm;
  config.batch_invariant = batch_invariant;
  config.min_warps = min_warps;
  const __nv_bfloat16* in = bf16(inp, "inp");
  const __nv_bfloat16* wp = bf16(w, "w");
  DFLASH_ARG_CHECK(cuda::stream_gemm_supports(in, wp, inp.shape(0), w.shape(1), f, f32, &config),
                   "stream_gemm: unsupported (M <= 16, K % 8 == 0, 16-byte aligned, shape, shared memory)");
  const cudaStream_t s = stream ? reinterpret_cast<cudaStream_t>(*stream) : nullptr;
  run("stream_gemm", stream,
      cuda::stream_gemm(in, wp, inp.shape(0), w.shape(0), w.shape(1), f, f32, out.data(), s, &config));
}

// The CUDA backend's cuBLASLt path (one handle and a 32 MiB workspace for the process, kept
// until exit), as the reference of the skinny GEMM benchmarks.
void cuda_cublaslt_gemm(const Any& x, const Any& w, const Any& out, std::optional<uintptr_t> stream) {
  const bool f32 = check_gemm(x, w, out, "cublaslt_gemm");
  bf16(x, "x");
  bf16(w, "w");
  use_device(x.device_id());
  static CublasLtGemm* gemm = nullptr;
  if (gemm == nullptr) {
    constexpr size_t kWorkspace = 32u << 20;
    void* ws = nullptr;
    const cudaError_t e = cudaMalloc(&ws, kWorkspace);
    DFLASH_CHECK(e == cudaSuccess, "cudaMalloc: ", cudaGetErrorString(e));
    gemm = new CublasLtGemm(ws, kWorkspace);  // never freed: test-only, lives until exit
  }
  const cudaStream_t s = stream ? reinterpret_cast<cudaStream_t>(*stream) : nullptr;
  gemm->linear(x.data(), w.data(), out.data(), x.shape(0), w.shape(0), x.shape(1), f32, s);
  run("cublaslt_gemm", stream, cudaGetLastError());
}

// The CUDA decode attention (cuda/decode_attention.cu, and decode_attention_mma.cu above 16 rows
// per (sequence, KV head) or with tensor_cores) with the argument names of
// triton_paged_attention; workspace (any dtype) and counters (int32 [>= num_seqs * nkv], zero)
// enable split-KV. stream: launch there and return; None: default stream, synchronised.
// symmetric_window: with window > 0, keys |q_pos - j| < window (causal ignored). staged: the
// CUDA-core kernel with K/V staged in shared memory (PagedAttentionArgs::staged_kv).
// Returns the split count launched.
int cuda_decode_attention(const Any& q, const Any& k_pool, const Any& v_pool, const Any& out, const I32& query_start,
                          const I32& kv_len, const I32& block_table, bool causal, int32_t window,
                          int32_t max_query_len, int32_t max_kv_len, std::optional<Any> workspace,
                          std::optional<I32> counters, int32_t force_splits, std::optional<uintptr_t> stream,
                          bool symmetric_window, bool tensor_cores, bool staged) {
  PagedAttentionArgs a = paged_attention_args(q, k_pool, v_pool, out, query_start, kv_len, block_table, causal,
                                              window, symmetric_window, max_query_len, max_kv_len, workspace,
                                              force_splits);
  if (counters) {
    a.counters = counters->data();
    a.counter_slots = static_cast<int64_t>(counters->size());
  }
  a.force_tensor_cores = tensor_cores;
  a.staged_kv = staged;
  const char* why = cuda::decode_attention_check(a);
  DFLASH_ARG_CHECK(why == nullptr, "decode_attention: ", why ? why : "");
  DFLASH_ARG_CHECK(force_splits >= 0 && force_splits <= cuda::decode_attention_max_splits(),
                   "decode_attention: force_splits out of range");
  const int splits = cuda::decode_attention_splits(a);
  run("decode_attention", stream, cuda::decode_attention(a, as_stream(stream)));
  return splits;
}

// The CUDA decode attention with the QKV norm / RoPE / K/V write fused in (cuda::decode_attention_rope):
// qkv [T, (nh + 2 nkv) hd], q_norm / k_norm [hd] or None, positions and slots [T] int32,
// inv_freq [hd/2] fp32; the pools get the new K/V, out [T, nh, hd] the attention (out also gives
// nh). The other arguments, stream and staged included, as cuda_decode_attention. Returns the split
// count launched.
int cuda_decode_attention_rope(const Any& qkv, const std::optional<Any>& q_norm, const std::optional<Any>& k_norm,
                               float eps, const I32& positions, const F32& inv_freq, const I32& slots,
                               const Any& k_pool, const Any& v_pool, const Any& out, const I32& query_start,
                               const I32& kv_len, const I32& block_table, bool causal, int32_t window,
                               int32_t max_query_len, int32_t max_kv_len, std::optional<Any> workspace,
                               std::optional<I32> counters, int32_t force_splits, bool symmetric_window,
                               std::optional<uintptr_t> stream, bool staged) {
  PagedAttentionArgs a = paged_attention_args(out, k_pool, v_pool, out, query_start, kv_len, block_table, causal,
                                              window, symmetric_window, max_query_len, max_kv_len, workspace,
                                              force_splits);
  a.q = nullptr;
  if (counters) {
    a.counters = counters->data();
    a.counter_slots = static_cast<int64_t>(counters->size());
  }
  a.staged_kv = staged;
  const int64_t t = a.num_tokens, hd = a.head_dim;
  DFLASH_ARG_CHECK(numel(qkv) == t * (a.num_heads + 2 * a.num_kv_heads) * hd &&
                       static_cast<int64_t>(positions.size()) == t && static_cast<int64_t>(slots.size()) == t &&
                       static_cast<int64_t>(inv_freq.size()) * 2 == hd,
                   "decode_attention_rope: qkv [T, (nh + 2 nkv) hd], positions and slots [T], inv_freq [hd/2]");
  cuda::DecodeRopeArgs r;
  r.qkv = bf16(qkv, "qkv");
  r.q_norm = bf16(q_norm, "q_norm");
  r.k_norm = bf16(k_norm, "k_norm");
  r.eps = eps;
  r.positions = positions.data();
  r.inv_freq = inv_freq.data();
  r.slots = slots.data();
  const char* why = cuda::decode_attention_rope_check(a, r);
  DFLASH_ARG_CHECK(why == nullptr, "decode_attention_rope: ", why ? why : "");
  DFLASH_ARG_CHECK(force_splits >= 0 && force_splits <= cuda::decode_attention_max_splits(),
                   "decode_attention_rope: force_splits out of range");
  const int splits = cuda::decode_attention_splits(a);
  run("decode_attention_rope", stream, cuda::decode_attention_rope(a, r, as_stream(stream)));
  return splits;
}

// The exact top-K of cuda/topk_candidates.cu: logits [R, V] fp32 (a contiguous view may start at
// any element), ids [R, k] int32, unary [R, k] fp32; workspace (any dtype) of at least
// cuda_topk_workspace_bytes(R, V, k) bytes, counters int32 [R] (zero; left zero). None passes a
// null pointer (refused where one is needed). stream: launch there and return; None: default
// stream, synchronised.
void cuda_topk_candidates(const F32& logits, int64_t k, float multiplier, float softcap, const I32& ids,
                          const F32& unary, std::optional<Any> workspace, std::optional<I32> counters,
                          std::optional<uintptr_t> stream) {
  DFLASH_ARG_CHECK(logits.ndim() == 2 && ids.ndim() == 2 && unary.ndim() == 2 && ids.shape(0) == logits.shape(0) &&
                       unary.shape(0) == logits.shape(0) && static_cast<int64_t>(ids.shape(1)) == k &&
                       static_cast<int64_t>(unary.shape(1)) == k &&
                       (!counters || counters->size() >= logits.shape(0)),
                   "topk_candidates: logits [R, V], ids and unary [R, k], counters [R]");
  use_device(logits.device_id());
  run("topk_candidates", stream,
      cuda::topk_candidates(logits.data(), logits.shape(0), logits.shape(1), k, multiplier, softcap, ids.data(),
                            unary.data(), workspace ? workspace->data() : nullptr, workspace ? workspace->nbytes() : 0,
                            counters ? counters->data() : nullptr, as_stream(stream)));
}

}  // namespace
}  // namespace dflash

void bind_cuda_testing(nb::module_& m) {
  using namespace dflash;
  m.def("cuda_embedding", &cuda_embedding, "table"_a, "ids"_a, "out"_a, "bad_id"_a);
  m.def("cuda_rms_norm", &cuda_rms_norm, "x"_a, "w"_a, "eps"_a, "out"_a);
  m.def("cuda_add_rms_norm", &cuda_add_rms_norm, "residual"_a, "x"_a, "w"_a, "eps"_a, "out"_a);
  m.def("cuda_silu_mul", &cuda_silu_mul, "gate_up"_a, "out"_a);
  m.def("cuda_add", &cuda_add, "a"_a, "b"_a, "out"_a);
  m.def("cuda_l2_prefetch", &cuda_l2_prefetch, "w"_a, "bytes"_a, "max_blocks"_a);
  m.def("cuda_late_copy_rows", &cuda_late_copy_rows, "dst"_a, "src"_a, "rows"_a, "delay_ns"_a, "stream"_a);
  m.def("cuda_bf16_to_f32", &cuda_bf16_to_f32, "x"_a, "out"_a);
  m.def("cuda_f32_to_bf16", &cuda_f32_to_bf16, "x"_a, "out"_a);
  m.def("cuda_qkv_norm_rope", &cuda_qkv_norm_rope, "qkv"_a, "q_norm"_a.none(), "k_norm"_a.none(),
        "eps"_a, "positions"_a, "inv_freq"_a, "num_heads"_a, "num_kv_heads"_a, "head_dim"_a,
        "q"_a.none(), "k"_a, "v"_a);
  m.def("cuda_feed_spec_inputs", &cuda_feed_spec_inputs, "feed"_a, "num_accepted"_a, "next_token"_a, "block_table"_a,
        "block_size"_a, "ids"_a, "verify_ids"_a, "positions"_a, "slots"_a, "kv_len"_a, "anchors"_a, "params"_a);
  m.def("cuda_kv_write", &cuda_kv_write, "k"_a, "v"_a, "slots"_a, "k_pool"_a, "v_pool"_a);
  m.def("cuda_decode_attention", &cuda_decode_attention, "q"_a, "k_pool"_a, "v_pool"_a, "out"_a, "query_start"_a,
        "kv_len"_a, "block_table"_a, "causal"_a, "window"_a, "max_query_len"_a, "max_kv_len"_a,
        "workspace"_a = nb::none(), "counters"_a = nb::none(), "force_splits"_a = 0, "stream"_a = nb::none(),
        "symmetric_window"_a = false, "tensor_cores"_a = false, "staged"_a = false);
  m.def("cuda_decode_attention_rope", &cuda_decode_attention_rope, "qkv"_a, "q_norm"_a.none(), "k_norm"_a.none(),
        "eps"_a, "positions"_a, "inv_freq"_a, "slots"_a, "k_pool"_a, "v_pool"_a, "out"_a, "query_start"_a, "kv_len"_a,
        "block_table"_a, "causal"_a, "window"_a, "max_query_len"_a, "max_kv_len"_a, "workspace"_a = nb::none(),
        "counters"_a = nb::none(), "force_splits"_a = 0, "symmetric_window"_a = false, "stream"_a = nb::none(),
        "staged"_a = false);
  m.def("cuda_decode_attention_workspace_bytes",
        [](int64_t num_tokens, int64_t num_heads, int64_t head_dim, int splits) {
          return cuda::decode_attention_workspace_bytes(num_tokens, num_heads, head_dim, splits);
        },
        "num_tokens"_a, "num_heads"_a, "head_dim"_a, "splits"_a);
  m.def("cuda_decode_attention_max_splits", &cuda::decode_attention_max_splits);
  m.def("cuda_kv_norm_rope_write", &cuda_kv_norm_rope_write, "kv"_a, "k_norm"_a.none(), "eps"_a,
        "positions"_a, "inv_freq"_a, "slots"_a, "num_kv_heads"_a, "head_dim"_a, "k_pool"_a,
        "v_pool"_a);
  m.def("cuda_kv_norm_rope_write_layers", &cuda_kv_norm_rope_write_layers, "kv"_a, "k_norm"_a.none(), "eps"_a,
        "positions"_a, "inv_freq"_a, "slots"_a, "num_layers"_a, "num_kv_heads"_a, "head_dim"_a, "k_pool"_a,
        "v_pool"_a);
  m.def("cuda_qkv_norm_rope_write", &cuda_qkv_norm_rope_write, "qkv"_a, "q_norm"_a.none(), "k_norm"_a.none(),
        "eps"_a, "positions"_a, "inv_freq"_a, "slots"_a, "num_heads"_a, "num_kv_heads"_a, "head_dim"_a, "q"_a,
        "k_pool"_a, "v_pool"_a, "stream"_a = nb::none());
  m.def("cuda_argmax_rows", &cuda_argmax_rows, "logits"_a, "out"_a);
  m.def("cuda_nonfinite_rows", &cuda_nonfinite_rows, "logits"_a, "flags"_a);
  m.def("cuda_assemble_drafts", &cuda_assemble_drafts, "proposed"_a, "override_drafts"_a, "use_override"_a,
        "drafts"_a, "verify_ids"_a);
  m.def("cuda_gather_rows", &cuda_gather_rows, "x"_a, "rows"_a, "out"_a);
  m.def("cuda_copy_columns", &cuda_copy_columns, "src"_a, "dst"_a, "col"_a);
  m.def("cuda_sample", &cuda_sample, "logits"_a, "temperature"_a, "top_k"_a, "top_p"_a, "seed"_a,
        "position"_a, "tokens"_a);
  m.def("cuda_skinny_gemm", &cuda_skinny_gemm, "x"_a, "w"_a, "out"_a, "stream"_a.none() = nb::none(),
        "warps"_a = 0, "row_tiles"_a = 0, "unroll"_a = 0, "batch_invariant"_a = false);
  m.def("cuda_batch_invariant_warps", [](int64_t n) { return cuda::batch_invariant_warps(n); }, "n"_a,
        "warps per CTA of the batch-invariant skinny shape for N output columns (the streaming kernel launched "
        "batch-invariant with them has the skinny kernel's bits)");
  m.def("cuda_stream_gemm", &cuda_stream_gemm, "inp"_a, "w"_a, "out"_a, "mode"_a = "plain", "gamma"_a.none() = nb::none(),
        "eps"_a = 1e-6f, "add"_a = false, "warps"_a = 0, "stages"_a = 0, "unroll"_a = 0, "ctas_per_sm"_a = 0,
        "batch_invariant"_a = false, "min_warps"_a = 0, "stream"_a.none() = nb::none());
  m.def("cuda_cublaslt_gemm", &cuda_cublaslt_gemm, "x"_a, "w"_a, "out"_a, "stream"_a.none() = nb::none());
  m.def("cuda_skinny_gemm_fused", &cuda_skinny_gemm_fused, "inp"_a, "w"_a, "out"_a, "mode"_a,
        "gamma"_a.none() = nb::none(), "eps"_a = 1e-6f, "add"_a = false, "batch_invariant"_a = false);
  m.def("cuda_accept_drafts", &cuda_accept_drafts, "drafts"_a, "logits"_a, "temperature"_a,
        "top_k"_a, "top_p"_a, "seed"_a, "position"_a, "num_accepted"_a, "next_token"_a);
  m.def("cuda_accept_candidates", &cuda_accept_candidates, "drafts"_a, "cand_ids"_a.none(), "realized"_a,
        "logits"_a, "temperature"_a, "top_k"_a, "top_p"_a, "seed"_a, "position"_a, "num_accepted"_a,
        "next_token"_a);
  m.def("cuda_sample_drafts", &cuda_sample_drafts, "logits"_a, "n"_a, "temperature"_a, "seed"_a, "position"_a,
        "drafts"_a);
  m.def("cuda_topk_candidates", &cuda_topk_candidates, "logits"_a, "k"_a, "multiplier"_a, "softcap"_a, "ids"_a,
        "unary"_a, "workspace"_a.none(), "counters"_a.none(), "stream"_a.none() = nb::none());
  m.def("cuda_topk_workspace_bytes", &cuda::topk_workspace_bytes, "rows"_a, "vocab"_a, "k"_a);
}
