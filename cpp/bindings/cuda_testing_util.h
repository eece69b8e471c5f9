// Shared pieces of the test-only CUDA kernel bindings (cuda_testing_*.cpp): the torch-tensor
// types they take, the bf16 pointer check, the device switch, and the launch convention (launch
// on the default stream and synchronise, raising CUDA errors as dflash::Error; with `stream`, a
// cudaStream_t as an int, launch there without synchronising, for benchmarks and graph capture).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>

#include "common/error.h"
#include "cuda/paged_attention_args.h"

namespace dflash {
namespace testing_bindings {

namespace nb = nanobind;

using Any = nb::ndarray<nb::device::cuda, nb::c_contig>;
using F32 = nb::ndarray<float, nb::device::cuda, nb::c_contig>;
using I32 = nb::ndarray<int32_t, nb::device::cuda, nb::c_contig>;
using U8 = nb::ndarray<uint8_t, nb::device::cuda, nb::c_contig>;
using Stream = std::optional<uintptr_t>;

inline __nv_bfloat16* bf16(const Any& a, const char* name) {
  DFLASH_ARG_CHECK(a.dtype().code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && a.dtype().bits == 16 &&
                       a.dtype().lanes == 1,
                   name, " must be a bfloat16 tensor");
  return static_cast<__nv_bfloat16*>(a.data());
}
inline __nv_bfloat16* bf16(const std::optional<Any>& a, const char* name) { return a ? bf16(*a, name) : nullptr; }

inline cudaStream_t as_stream(const Stream& s) { return s ? reinterpret_cast<cudaStream_t>(*s) : nullptr; }

// Checks the launch; without a stream also waits for the kernel and checks its completion.
inline void run(const char* op, const Stream& stream, cudaError_t launched) {
  DFLASH_CHECK(launched == cudaSuccess, op, ": launch failed: ", cudaGetErrorString(launched));
  if (stream) return;
  const cudaError_t done = cudaDeviceSynchronize();
  DFLASH_CHECK(done == cudaSuccess, op, ": kernel failed: ", cudaGetErrorString(done));
}

// run() on the default stream: launch, synchronise, check.
inline void finish(const char* op, cudaError_t launched) { run(op, std::nullopt, launched); }

inline void use_device(int device) {
  const cudaError_t e = cudaSetDevice(device);
  DFLASH_CHECK(e == cudaSuccess, "cudaSetDevice(", device, "): ", cudaGetErrorString(e));
}

// The PagedAttentionArgs of torch tensors (the one filler of the CUDA decode and Triton attention
// bindings): q / out bf16 [T, num_heads, head_dim], pools bf16 [num_blocks, block_size,
// num_kv_heads, head_dim], query_start [S + 1], kv_len [S], block_table [S, max_blocks], all on
// one device (made current); workspace (any dtype, optional) enables split-KV.
inline PagedAttentionArgs paged_attention_args(const Any& q, const Any& k_pool, const Any& v_pool, const Any& out,
                                               const I32& query_start, const I32& kv_len, const I32& block_table,
                                               bool causal, int32_t window, bool symmetric_window,
                                               int32_t max_query_len, int32_t max_kv_len,
                                               const std::optional<Any>& workspace, int32_t force_splits) {
  DFLASH_ARG_CHECK(q.ndim() == 3 && out.ndim() == 3 && k_pool.ndim() == 4 && v_pool.ndim() == 4,
                   "q/out [T, num_heads, head_dim], pools [num_blocks, block_size, num_kv_heads, head_dim]");
  for (int d = 0; d < 3; ++d) DFLASH_ARG_CHECK(out.shape(d) == q.shape(d), "out must have q's shape");
  for (int d = 0; d < 4; ++d) DFLASH_ARG_CHECK(k_pool.shape(d) == v_pool.shape(d), "k_pool and v_pool shapes differ");
  DFLASH_ARG_CHECK(k_pool.shape(3) == q.shape(2), "pool head_dim differs from q's");
  DFLASH_ARG_CHECK(query_start.ndim() == 1 && kv_len.ndim() == 1 && block_table.ndim() == 2 &&
                       query_start.shape(0) == kv_len.shape(0) + 1 && block_table.shape(0) == kv_len.shape(0),
                   "query_start [num_seqs + 1], kv_len [num_seqs], block_table [num_seqs, max_blocks_per_seq]");
  const int32_t device = q.device_id();
  DFLASH_ARG_CHECK(k_pool.device_id() == device && v_pool.device_id() == device && out.device_id() == device &&
                       query_start.device_id() == device && kv_len.device_id() == device &&
                       block_table.device_id() == device && (!workspace || workspace->device_id() == device),
                   "all tensors must be on one device");
  use_device(device);
  PagedAttentionArgs a;
  a.q = bf16(q, "q");
  a.k_pool = bf16(k_pool, "k_pool");
  a.v_pool = bf16(v_pool, "v_pool");
  a.out = bf16(out, "out");
  a.query_start = query_start.data();
  a.kv_len = kv_len.data();
  a.block_table = block_table.data();
  a.num_seqs = static_cast<int32_t>(kv_len.shape(0));
  a.num_tokens = static_cast<int32_t>(q.shape(0));
  a.num_heads = static_cast<int32_t>(q.shape(1));
  a.head_dim = static_cast<int32_t>(q.shape(2));
  a.num_kv_heads = static_cast<int32_t>(k_pool.shape(2));
  a.block_size = static_cast<int32_t>(k_pool.shape(1));
  a.max_blocks_per_seq = static_cast<int32_t>(block_table.shape(1));
  a.max_query_len = max_query_len;
  a.max_kv_len = max_kv_len;
  a.causal = causal;
  a.window = window;
  a.symmetric_window = symmetric_window;
  if (workspace) {
    a.workspace = workspace->data();
    a.workspace_bytes = workspace->nbytes();
  }
  a.force_splits = force_splits;
  return a;
}

}  // namespace testing_bindings
}  // namespace dflash
