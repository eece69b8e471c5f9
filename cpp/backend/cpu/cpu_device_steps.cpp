// The CPU backend's device-side step ops (argmax, non-finite row flags, sampling and acceptance
// into tensors, draft assembly, the drafter's all-layer context write) and its host staging.
// "Device" memory is host memory here, so copies are memcpy and everything runs at once; the
// results equal what the host-side paths (host_sampling.h, host_acceptance.h) give.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/host_acceptance.h"
#include "backend/cpu/host_sampling.h"

namespace dflash {

namespace {

const SampleRow* params_of(const Tensor& t, int64_t rows) {
  DFLASH_CHECK(static_cast<int64_t>(t.nbytes()) >= rows * static_cast<int64_t>(sizeof(SampleRow)),
               "sampling params tensor too small for ", rows, " rows");
  return static_cast<const SampleRow*>(t.data);
}

}  // namespace

void CpuBackend::argmax(const Tensor& logits, Tensor& out) {
  DFLASH_CHECK(logits.dtype == DType::kF32, "argmax: the CPU backend's logits are float32");
  const int64_t rows = logits.dim(0), vocab = logits.dim(1);
  parallel(rows, vocab, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = logits.ptr<float>() + r * vocab;
      int64_t best = 0;
      for (int64_t i = 1; i < vocab; ++i) {
        if (row[i] > row[best]) best = i;
      }
      out.ptr<int32_t>()[r] = static_cast<int32_t>(best);
    }
  });
}

void CpuBackend::nonfinite_rows(const Tensor& logits, Tensor& flags) {
  DFLASH_CHECK(logits.dtype == DType::kF32, "nonfinite_rows: logits must be float32");
  const int64_t rows = logits.dim(0), vocab = logits.dim(1);
  DFLASH_CHECK(flags.numel() >= rows, "nonfinite_rows: flags hold ", flags.numel(), " rows, logits ", rows);
  parallel(rows, vocab, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = logits.ptr<float>() + r * vocab;
      bool bad = false;
      for (int64_t i = 0; i < vocab; ++i) bad |= !std::isfinite(row[i]);
      flags.ptr<int32_t>()[r] = bad ? 1 : 0;
    }
  });
}

void CpuBackend::sample_rows(const Tensor& logits, const Tensor& params, Tensor& tokens) {
  const int64_t rows = logits.dim(0);
  const SampleRow* p = params_of(params, rows);
  sample(logits, std::vector<SampleRow>(p, p + rows), tokens.ptr<int32_t>());
}

void CpuBackend::accept(const Tensor& drafts, const Tensor& logits, const Tensor& params, Tensor& num_accepted,
                        Tensor& next_token) {
  const int64_t rows = drafts.dim(0), n = drafts.dim(1), vocab = logits.dim(-1);
  DFLASH_CHECK(logits.numel() == rows * (n + 1) * vocab, "accept: logits ", shape_str(logits.shape),
               " do not hold ", rows, " x ", n + 1, " rows");
  const SampleRow* p = params_of(params, rows);
  for (int64_t r = 0; r < rows; ++r) {
    const SampleRow& row = p[r];
    const AcceptResult a = accept_drafts(drafts.ptr<int32_t>() + r * n, n,
                                         logits.ptr<float>() + r * (n + 1) * vocab, vocab, row, row.position);
    num_accepted.ptr<int32_t>()[r] = static_cast<int32_t>(a.num_accepted);
    next_token.ptr<int32_t>()[r] = a.next_token;
  }
}

void CpuBackend::feed_tokens(Tensor& ids, const Tensor& feed, const Tensor& prev) {
  for (int64_t i = 0; i < ids.numel(); ++i) {
    const int32_t f = feed.ptr<int32_t>()[i];
    if (f >= 0) ids.ptr<int32_t>()[i] = prev.ptr<int32_t>()[f];
  }
}

void CpuBackend::feed_spec_inputs(SpecStepFeed& f) {
  const int64_t b = f.feed.numel(), q = f.rows_per_request, bs = f.block_size;
  const int64_t width = b > 0 ? f.block_table.numel() / b : 0;
  SampleRow* params = reinterpret_cast<SampleRow*>(f.params.data);
  for (int64_t r = 0; r < b; ++r) {
    const int32_t src = f.feed.ptr<int32_t>()[r];
    if (src < 0) continue;
    const int32_t shift = f.num_accepted.ptr<int32_t>()[src] + 1, token = f.next_token.ptr<int32_t>()[src];
    const int32_t* table = f.block_table.ptr<int32_t>() + r * width;
    for (int64_t j = 0; j < q; ++j) {
      const int32_t pos = f.positions.ptr<int32_t>()[r * q + j] + shift;
      f.positions.ptr<int32_t>()[r * q + j] = pos;
      f.slots.ptr<int32_t>()[r * q + j] = static_cast<int32_t>(table[pos / bs] * bs + pos % bs);
    }
    f.kv_len.ptr<int32_t>()[r] += shift;
    params[r].position += shift;
    f.anchors.ptr<int32_t>()[r] = f.ids.ptr<int32_t>()[r * q] = f.verify_ids.ptr<int32_t>()[r * q] = token;
  }
}

void CpuBackend::clear(Tensor& t) {
  if (t.nbytes() > 0) std::memset(t.data, 0, t.nbytes());
}

void CpuBackend::assemble_drafts(const Tensor& proposed, const Tensor& override_drafts, const Tensor& use_override,
                                 Tensor& drafts, Tensor& verify_ids) {
  const int64_t rows = drafts.dim(0), n = drafts.dim(1);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* src = (use_override.ptr<int32_t>()[r] ? override_drafts : proposed).ptr<int32_t>() + r * n;
    for (int64_t j = 0; j < n; ++j) {
      drafts.ptr<int32_t>()[r * n + j] = src[j];
      verify_ids.ptr<int32_t>()[r * (n + 1) + 1 + j] = src[j];
    }
  }
}

void CpuBackend::kv_norm_rope_write_layers(const Tensor& kv, const Tensor& k_norm, float eps,
                                           const Tensor& positions, const Tensor& inv_freq, const Tensor& slots,
                                           KVPool& pool) {
  const int64_t c = kv.dim(0), nkv = pool.num_kv_heads, hd = pool.head_dim, layer_width = 2 * nkv * hd;
  DFLASH_CHECK(kv.numel() == c * pool.num_layers * layer_width, "kv_norm_rope_write_layers: kv ",
               shape_str(kv.shape), " does not hold ", pool.num_layers, " layers of K/V");
  Tensor one = empty({c, layer_width}, DType::kF32);
  Tensor no_q = empty({c, 0, hd}, DType::kF32);
  Tensor k = empty({c, nkv, hd}, DType::kF32);
  Tensor v = empty({c, nkv, hd}, DType::kF32);
  for (int64_t l = 0; l < pool.num_layers; ++l) {
    for (int64_t t = 0; t < c; ++t) {
      std::memcpy(one.ptr<float>() + t * layer_width, kv.ptr<float>() + (t * pool.num_layers + l) * layer_width,
                  layer_width * sizeof(float));
    }
    Tensor norm = k_norm.empty() ? Tensor() : k_norm.reshape({pool.num_layers, hd}).rows(l, l + 1).reshape({hd});
    qkv_norm_rope(one, Tensor(), norm, eps, positions, inv_freq, 1.0f, no_q, k, v);
    kv_write(pool, l, k, v, slots);
  }
}

std::shared_ptr<void> CpuBackend::host_alloc(size_t bytes) {
  return std::shared_ptr<void>(::operator new(std::max<size_t>(bytes, 1)), [](void* p) { ::operator delete(p); });
}

void CpuBackend::copy_to_device(Tensor& dst, const void* host, size_t bytes) {
  DFLASH_CHECK(bytes <= dst.nbytes(), "copy_to_device: ", bytes, " bytes into a tensor of ", dst.nbytes());
  if (bytes) std::memcpy(dst.data, host, bytes);
}

void CpuBackend::copy_to_host(void* host, const Tensor& src, size_t bytes) {
  DFLASH_CHECK(bytes <= src.nbytes(), "copy_to_host: ", bytes, " bytes from a tensor of ", src.nbytes());
  if (bytes) std::memcpy(host, src.data, bytes);
}

}  // namespace dflash
