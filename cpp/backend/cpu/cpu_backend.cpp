// CPU backend: memory, weights, element-wise ops, norms, RoPE, KV writes and GEMMs.
// Attention is in cpu_attention.cpp, sampling in cpu_sampling.cpp.
#include "backend/cpu/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "backend/cpu/cpu_skinny_gemm.h"

namespace dflash {

namespace {

std::shared_ptr<void> host_alloc(size_t bytes, bool zero) {
  // calloc hands out untouched zero pages for large sizes (the KV pool is touched lazily);
  // aligned_alloc gives 64-byte alignment for scratch buffers.
  size_t rounded = (bytes + 63) / 64 * 64;
  if (rounded == 0) rounded = 64;
  void* p = zero ? std::calloc(rounded, 1) : std::aligned_alloc(64, rounded);
  DFLASH_CHECK(p != nullptr, "out of host memory allocating ", bytes, " bytes");
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

Tensor make_tensor(const std::vector<int64_t>& shape, DType dtype, bool zero) {
  Tensor t;
  t.shape = shape;
  t.dtype = dtype;
  t.device = DeviceKind::kCPU;
  t.storage = host_alloc(t.nbytes(), zero);
  t.data = t.storage.get();
  return t;
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

}  // namespace

CpuBackend::CpuBackend(int num_threads, const KernelOptions& kernels) : num_threads_(num_threads) {
  // Each thread is an OS thread: an absurd count would exhaust the host's process ids first.
  const int max_threads = std::max(1024, static_cast<int>(std::thread::hardware_concurrency()));
  DFLASH_ARG_CHECK(num_threads >= 1 && num_threads <= max_threads,
                   "num_threads must be in [1, ", max_threads, "], got ", num_threads);
  pool_ = std::make_unique<ThreadPool>(num_threads);
  // cpu_gemm: "auto" takes the AVX-512 skinny kernel (every GEMM) where the CPU has AVX-512, else
  // the AVX2 one for its rows where it has AVX2/FMA; "avx512" / "avx2" ask for
  // one (an error where the CPU lacks it); "blas" sends every GEMM to OpenBLAS on its own threads
  // (the reference for comparisons).
  const std::string& mode = kernels.cpu_gemm;
  DFLASH_ARG_CHECK(mode == "auto" || mode == "avx512" || mode == "avx2" || mode == "blas",
                   "kernels.cpu_gemm (DFLASH_CPU_GEMM) must be auto, avx512, avx2 or blas, got '", mode, "'");
  DFLASH_ARG_CHECK(mode != "avx512" || cpu_skinny_gemm_avx512_supported(),
                   "kernels.cpu_gemm (DFLASH_CPU_GEMM) is avx512 but this CPU has no AVX-512F");
  DFLASH_ARG_CHECK(mode != "avx2" || cpu_skinny_gemm_supported(),
                   "kernels.cpu_gemm (DFLASH_CPU_GEMM) is avx2 but this CPU has no AVX2/FMA");
  if (mode == "avx512" || (mode == "auto" && cpu_skinny_gemm_avx512_supported())) {
    skinny_ = SkinnyKernel::kAvx512;
  } else if (mode == "avx2" || (mode == "auto" && cpu_skinny_gemm_supported())) {
    skinny_ = SkinnyKernel::kAvx2;
  }
  // Outside "blas" the backend splits BLAS GEMMs over its own pool, one OpenBLAS thread each:
  // OpenBLAS's own threads spin for a while after each call, and on a machine of few cores that
  // spinning took the cores from the pool's next loops (the skinny GEMMs of the following step).
  // OpenBLAS's thread count is process-wide: the last CPU backend created sets it.
  blas_threads_ = mode == "blas";
  scipy_openblas_set_num_threads(blas_threads_ ? num_threads : 1);
}

void CpuBackend::parallel(int64_t n, int64_t work_per_item,
                          const std::function<void(int64_t, int64_t)>& fn) {
  constexpr int64_t kMinParallelWork = 1 << 15;  // below this, waking threads costs more
  if (n * work_per_item < kMinParallelWork) {
    fn(0, n);
  } else {
    pool_->parallel_for(n, fn);
  }
}

Tensor CpuBackend::empty(const std::vector<int64_t>& shape, DType dtype) {
  return make_tensor(shape, dtype, false);
}

Tensor CpuBackend::zeros(const std::vector<int64_t>& shape, DType dtype) {
  return make_tensor(shape, dtype, true);
}

Tensor CpuBackend::weight(const std::vector<const StoredTensor*>& parts) {
  DFLASH_CHECK(!parts.empty(), "weight() needs at least one tensor");
  std::vector<int64_t> shape = parts[0]->shape;
  for (size_t i = 1; i < parts.size(); ++i) {
    DFLASH_CHECK(parts[i]->shape.size() == shape.size() && !shape.empty() &&
                     std::equal(shape.begin() + 1, shape.end(), parts[i]->shape.begin() + 1),
                 "cannot stack ", parts[i]->name, " ", shape_str(parts[i]->shape), " onto ",
                 parts[0]->name, " ", shape_str(parts[0]->shape));
    shape[0] += parts[i]->shape[0];
  }
  Tensor t = make_tensor(shape, DType::kF32, false);
  float* dst = t.ptr<float>();
  for (const StoredTensor* p : parts) {
    p->to_f32(dst);
    dst += p->numel();
  }
  return t;
}

Tensor CpuBackend::upload_f32(const float* host, const std::vector<int64_t>& shape) {
  Tensor t = make_tensor(shape, DType::kF32, false);
  std::memcpy(t.data, host, t.nbytes());
  return t;
}

Tensor CpuBackend::upload_i32(const int32_t* host, const std::vector<int64_t>& shape) {
  Tensor t = make_tensor(shape, DType::kI32, false);
  if (t.nbytes()) std::memcpy(t.data, host, t.nbytes());
  return t;
}

void CpuBackend::download_f32(const Tensor& t, float* host) {
  DFLASH_CHECK(t.dtype == DType::kF32, "download_f32 of a ", dtype_name(t.dtype), " tensor");
  std::memcpy(host, t.data, t.nbytes());
}

void CpuBackend::embedding(const Tensor& table, const Tensor& ids, Tensor& out) {
  const int64_t n = ids.numel(), h = table.dim(1), vocab = table.dim(0);
  const int32_t* id = ids.ptr<int32_t>();
  for (int64_t t = 0; t < n; ++t) {
    DFLASH_CHECK(id[t] >= 0 && id[t] < vocab, "token id ", id[t], " outside the vocabulary (",
                 vocab, ")");
    std::memcpy(out.ptr<float>() + t * h, table.ptr<float>() + id[t] * h, h * sizeof(float));
  }
}

void CpuBackend::rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  const int64_t h = w.numel(), rows = x.numel() / h;
  parallel(rows, h, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      rms_norm_row(x.ptr<float>() + r * h, w.ptr<float>(), eps, h, out.ptr<float>() + r * h);
    }
  });
}

void CpuBackend::add_rms_norm(Tensor& residual, const Tensor& x, const Tensor& w, float eps,
                              Tensor& out) {
  const int64_t h = w.numel(), rows = residual.numel() / h;
  parallel(rows, h, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* res = residual.ptr<float>() + r * h;
      const float* xr = x.ptr<float>() + r * h;
      for (int64_t i = 0; i < h; ++i) res[i] += xr[i];
      rms_norm_row(res, w.ptr<float>(), eps, h, out.ptr<float>() + r * h);
    }
  });
}

void CpuBackend::linear(const Tensor& x, const Tensor& w, Tensor& out) {
  const int64_t n = w.dim(0), k = w.dim(1), m = x.numel() / k;
  DFLASH_CHECK(x.numel() == m * k && out.numel() == m * n, "linear: shape mismatch x ",
               shape_str(x.shape), " w ", shape_str(w.shape), " out ", shape_str(out.shape));
  if (m == 0) return;
  const float* xp = x.ptr<float>();
  const float* wp = w.ptr<float>();
  float* op = out.ptr<float>();
  const bool avx512 = skinny_ == SkinnyKernel::kAvx512;
  const bool avx2 = skinny_ == SkinnyKernel::kAvx2 && m >= kCpuSkinnyMinRows && m <= kCpuSkinnyAvx2MaxRows;
  if (avx512 || avx2) {
    // Weights read once for all rows (per column block), batch-invariant results.
    constexpr int64_t kColumnsPerItem = kCpuSkinnyColumnBlock;
    const int64_t items = (n + kColumnsPerItem - 1) / kColumnsPerItem;
    parallel(items, kColumnsPerItem * k * m, [&](int64_t i0, int64_t i1) {
      const int64_t n0 = i0 * kColumnsPerItem, n1 = std::min(n, i1 * kColumnsPerItem);
      if (avx512) {
        cpu_skinny_gemm_avx512(xp, wp, op, m, n, k, n0, n1);
      } else {
        cpu_skinny_gemm(xp, wp, op, m, n, k, n0, n1);
      }
    });
    return;
  }
  if (blas_threads_) {  // OpenBLAS on its own threads
    if (m == 1) {
      scipy_cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, wp, k, xp, 1, 0.0f, op, 1);
    } else {
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, xp, k, wp, k, 0.0f, op, n);
    }
    return;
  }
  // Column blocks over the pool, each a single-threaded OpenBLAS call.
  constexpr int64_t kBlasColumns = 64;
  const int64_t items = (n + kBlasColumns - 1) / kBlasColumns;
  parallel(items, kBlasColumns * k * m, [&](int64_t i0, int64_t i1) {
    const int64_t n0 = i0 * kBlasColumns, cols = std::min(n, i1 * kBlasColumns) - n0;
    if (m == 1) {
      scipy_cblas_sgemv(CblasRowMajor, CblasNoTrans, cols, k, 1.0f, wp + n0 * k, k, xp, 1, 0.0f, op + n0, 1);
    } else {
      scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, cols, k, 1.0f, xp, k, wp + n0 * k, k, 0.0f,
                        op + n0, n);
    }
  });
}

void CpuBackend::silu_mul(const Tensor& gate_up, Tensor& out) {
  const int64_t inter = out.dim(-1), rows = out.numel() / inter;
  parallel(rows, inter * 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gate_up.ptr<float>() + r * 2 * inter;
      const float* u = g + inter;
      float* o = out.ptr<float>() + r * inter;
      for (int64_t i = 0; i < inter; ++i) o[i] = silu(g[i]) * u[i];
    }
  });
}

void CpuBackend::add(const Tensor& a, const Tensor& b, Tensor& out) {
  const int64_t n = a.numel();
  for (int64_t i = 0; i < n; ++i) out.ptr<float>()[i] = a.ptr<float>()[i] + b.ptr<float>()[i];
}

void CpuBackend::qkv_norm_rope(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm,
                               float eps, const Tensor& positions, const Tensor& inv_freq,
                               float rope_scale, Tensor& q, Tensor& k, Tensor& v) {
  const int64_t tokens = q.dim(0), nh = q.dim(1), hd = q.dim(2), nkv = k.dim(1);
  const int64_t width = (nh + 2 * nkv) * hd, half = hd / 2;
  const float* inv = inv_freq.ptr<float>();
  parallel(tokens, width * 4, [&](int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* row = qkv.ptr<float>() + t * width;
    const float pos = static_cast<float>(positions.ptr<int32_t>()[t]);
    std::vector<float> cos_t(half), sin_t(half), tmp(hd);
    for (int64_t i = 0; i < half; ++i) {
      const float f = pos * inv[i];
      cos_t[i] = std::cos(f) * rope_scale;
      sin_t[i] = std::sin(f) * rope_scale;
    }
    auto norm_rope = [&](const float* src, const Tensor& norm_w, float* dst) {
      if (!norm_w.empty()) {
        rms_norm_row(src, norm_w.ptr<float>(), eps, hd, tmp.data());
      } else {
        std::memcpy(tmp.data(), src, hd * sizeof(float));
      }
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = tmp[i], x2 = tmp[i + half];
        dst[i] = x1 * cos_t[i] - x2 * sin_t[i];
        dst[i + half] = x2 * cos_t[i] + x1 * sin_t[i];
      }
    };
    for (int64_t h = 0; h < nh; ++h) norm_rope(row + h * hd, q_norm, q.ptr<float>() + (t * nh + h) * hd);
    for (int64_t h = 0; h < nkv; ++h)
      norm_rope(row + (nh + h) * hd, k_norm, k.ptr<float>() + (t * nkv + h) * hd);
    std::memcpy(v.ptr<float>() + t * nkv * hd, row + (nh + nkv) * hd, nkv * hd * sizeof(float));
  }
  });
}

void CpuBackend::kv_write(KVPool& pool, int64_t layer, const Tensor& k, const Tensor& v,
                          const Tensor& slots) {
  const int64_t row = pool.num_kv_heads * pool.head_dim;
  const int64_t layer_slots = pool.num_blocks * pool.block_size;
  float* kl = pool.k.ptr<float>() + layer * layer_slots * row;
  float* vl = pool.v.ptr<float>() + layer * layer_slots * row;
  const int64_t n = slots.numel();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t s = slots.ptr<int32_t>()[t];
    if (s < 0) continue;  // a row with nowhere to go (as on CUDA)
    DFLASH_CHECK(s < layer_slots, "kv_write: slot ", s, " outside the pool");
    std::memcpy(kl + s * row, k.ptr<float>() + t * row, row * sizeof(float));
    std::memcpy(vl + s * row, v.ptr<float>() + t * row, row * sizeof(float));
  }
}

void CpuBackend::copy_columns(const Tensor& src, Tensor& dst, int64_t col) {
  const int64_t rows = src.dim(0), c = src.numel() / rows, w = dst.numel() / rows;
  DFLASH_CHECK(col + c <= w, "copy_columns past the destination width");
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst.ptr<float>() + r * w + col, src.ptr<float>() + r * c, c * sizeof(float));
  }
}

void CpuBackend::gather_rows(const Tensor& x, const Tensor& rows, Tensor& out) {
  const int64_t h = x.numel() / x.dim(0), n = rows.numel();
  for (int64_t r = 0; r < n; ++r) {
    std::memcpy(out.ptr<float>() + r * h, x.ptr<float>() + rows.ptr<int32_t>()[r] * h,
                h * sizeof(float));
  }
}

}  // namespace dflash
