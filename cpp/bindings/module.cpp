// dflash._core: the nanobind module, the only file that includes nanobind. Binds the public
// dflash::Session (include/dflash/session.h: token ids in, token ids out), its options, sampling
// parameters, step outputs and stats, plus the runtime's test hooks through api/session_access.h
// (debug request inputs, results with recordings, propose, block reference counts) and the
// test-only `testing` submodule. The GIL is released while C++ runs. dflash::InvalidArgument maps
// to ValueError, every other dflash::Exception to dflash.DFlashError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "api/session_access.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/host_fp8.h"
#include "dflash/session.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace dflash;

namespace dflash {
void bind_loader_testing(nb::module_& testing);
}

#ifdef DFLASH_WITH_CUDA
void bind_cuda_testing(nb::module_& testing);
void bind_cuda_testing_dflash2(nb::module_& testing);
void bind_cuda_testing_fp8(nb::module_& testing);
void bind_triton_testing(nb::module_& testing);
#endif

namespace {

// Raises `type` with `msg`, whose bytes may quote a broken file (not UTF-8): they are decoded
// with backslash escapes, so the error itself is raised, never a UnicodeDecodeError.
void raise_error(PyObject* type, const char* msg) {
  PyObject* text = PyUnicode_DecodeUTF8(msg, static_cast<Py_ssize_t>(std::strlen(msg)), "backslashreplace");
  if (text == nullptr) {
    PyErr_Clear();
    PyErr_SetString(type, "(error message could not be decoded)");
    return;
  }
  PyErr_SetObject(type, text);
  Py_DECREF(text);
}

// _core.SessionConfig: the public options with the runtime's test hooks; the device defaults to
// the CPU (dflash.Session resolves "auto" itself).
using CoreConfig = runtime::SessionConfig;

// Copies a float vector into a new numpy array of shape [rows, cols].
nb::object to_numpy_2d(const std::vector<float>& v, int64_t cols) {
  if (cols <= 0) cols = 1;
  const size_t rows = v.size() / cols;
  float* data = new float[v.size() ? v.size() : 1];
  if (!v.empty()) std::memcpy(data, v.data(), v.size() * sizeof(float));
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  size_t shape[2] = {rows, static_cast<size_t>(cols)};
  return nb::cast(nb::ndarray<nb::numpy, float, nb::ndim<2>>(data, 2, shape, owner));
}

using F32Array = nb::ndarray<float, nb::numpy, nb::c_contig, nb::device::cpu>;
using I32Array = nb::ndarray<int32_t, nb::numpy, nb::c_contig, nb::device::cpu>;

// Wraps numpy memory as a CPU Tensor (no copy, no ownership).
template <typename T>
Tensor wrap(const nb::ndarray<T, nb::numpy, nb::c_contig, nb::device::cpu>& a, DType dtype) {
  Tensor t;
  t.data = const_cast<T*>(a.data());
  t.dtype = dtype;
  t.device = DeviceKind::kCPU;
  for (size_t i = 0; i < a.ndim(); ++i) t.shape.push_back(static_cast<int64_t>(a.shape(i)));
  return t;
}

// The CPU backend's paged attention over caller-provided pools, for kernel tests.
nb::object cpu_paged_attention(const F32Array& q, const F32Array& k_pool, const F32Array& v_pool,
                               const I32Array& query_start, const I32Array& kv_len,
                               const I32Array& block_table, bool causal) {
  DFLASH_ARG_CHECK(q.ndim() == 3 && k_pool.ndim() == 4 && v_pool.ndim() == 4 &&
                       block_table.ndim() == 2 && query_start.ndim() == 1 && kv_len.ndim() == 1,
                   "paged_attention: q [T, nh, hd], pools [blocks, block_size, nkv, hd], "
                   "block_table [R, max_blocks]");
  CpuBackend backend(1);
  KVPool pool;
  pool.num_layers = 1;
  pool.num_blocks = k_pool.shape(0);
  pool.block_size = k_pool.shape(1);
  pool.num_kv_heads = k_pool.shape(2);
  pool.head_dim = k_pool.shape(3);
  pool.k = wrap(k_pool, DType::kF32);
  pool.v = wrap(v_pool, DType::kF32);
  AttentionMeta meta;
  meta.num_seqs = static_cast<int>(kv_len.shape(0));
  meta.max_blocks_per_seq = static_cast<int>(block_table.shape(1));
  meta.causal = causal;
  meta.query_start = wrap(query_start, DType::kI32);
  meta.kv_len = wrap(kv_len, DType::kI32);
  meta.block_table = wrap(block_table, DType::kI32);
  for (int s = 0; s < meta.num_seqs; ++s) {
    meta.max_kv_len = std::max(meta.max_kv_len, kv_len.data()[s]);
    DFLASH_ARG_CHECK(kv_len.data()[s] <= meta.max_blocks_per_seq * pool.block_size,
                     "kv_len exceeds the block table");
  }
  std::vector<float> out(q.size());
  Tensor out_t = wrap(q, DType::kF32);
  out_t.data = out.data();
  backend.paged_attention(wrap(q, DType::kF32), pool, 0, meta, out_t);
  return to_numpy_2d(out, static_cast<int64_t>(q.shape(1) * q.shape(2)));
}

// The CPU backend's linear layer: out[M, N] = x[M, K] @ w[N, K]^T (skinny kernel or BLAS, as
// the backend dispatches), for kernel tests.
nb::object cpu_linear(const F32Array& x, const F32Array& w, int num_threads, const std::string& cpu_gemm) {
  DFLASH_ARG_CHECK(x.ndim() == 2 && w.ndim() == 2 && x.shape(1) == w.shape(1), "linear: x [M, K], w [N, K]");
  KernelOptions kernels;
  kernels.cpu_gemm = cpu_gemm;
  CpuBackend backend(num_threads, kernels);
  std::vector<float> out(x.shape(0) * w.shape(0));
  Tensor out_t = backend.empty({static_cast<int64_t>(x.shape(0)), static_cast<int64_t>(w.shape(0))}, DType::kF32);
  backend.linear(wrap(x, DType::kF32), wrap(w, DType::kF32), out_t);
  std::memcpy(out.data(), out_t.data, out.size() * sizeof(float));
  return to_numpy_2d(out, static_cast<int64_t>(w.shape(0)));
}

// Seconds of each of `repeats` passes of the CPU backend's linear layer over weights of `shapes`
// [N, K] (each its own backend tensor, values fixed; speed does not depend on them) at `rows`
// rows, after one untimed pass: the GEMMs of a decode or verify step, for bench/bench_cpu_gemm.py.
std::vector<double> cpu_linear_pass_seconds(const std::vector<std::vector<int64_t>>& shapes, int64_t rows,
                                            int num_threads, const std::string& cpu_gemm, int repeats) {
  DFLASH_ARG_CHECK(rows >= 1 && repeats >= 1, "rows and repeats must be >= 1");
  KernelOptions kernels;
  kernels.cpu_gemm = cpu_gemm;
  CpuBackend backend(num_threads, kernels);
  std::vector<Tensor> ws, xs, outs;
  for (const std::vector<int64_t>& s : shapes) {
    DFLASH_ARG_CHECK(s.size() == 2 && s[0] >= 1 && s[1] >= 1, "each shape is [N, K] with N, K >= 1");
    Tensor w = backend.empty(s, DType::kF32), x = backend.empty({rows, s[1]}, DType::kF32);
    for (int64_t i = 0; i < w.numel(); ++i) w.ptr<float>()[i] = 0.01f * static_cast<float>(i % 7);
    std::fill(x.ptr<float>(), x.ptr<float>() + x.numel(), 0.5f);
    ws.push_back(std::move(w));
    xs.push_back(std::move(x));
    outs.push_back(backend.empty({rows, s[0]}, DType::kF32));
  }
  std::vector<double> seconds;
  for (int r = 0; r <= repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < ws.size(); ++i) backend.linear(xs[i], ws[i], outs[i]);
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) seconds.push_back(t);
  }
  return seconds;
}

// The CPU backend's non-finite row flags of logits [R, V]: int32 [R] (1: a NaN or an infinity).
std::vector<int32_t> cpu_nonfinite_rows(const F32Array& logits) {
  DFLASH_ARG_CHECK(logits.ndim() == 2, "nonfinite_rows: logits [R, V]");
  CpuBackend backend(1);
  const int64_t rows = logits.shape(0);
  Tensor flags = backend.empty({rows}, DType::kI32);
  backend.nonfinite_rows(wrap(logits, DType::kF32), flags);
  return std::vector<int32_t>(flags.ptr<int32_t>(), flags.ptr<int32_t>() + rows);
}

// The CPU backend's DFlash2 top-K: (ids [R * K] int32, unary [R, K]), for
// kernel tests (ties, -inf and NaN rows).
nb::object cpu_topk_candidates(const F32Array& logits, int64_t k, float multiplier, float softcap) {
  DFLASH_ARG_CHECK(logits.ndim() == 2 && k >= 1 && k <= static_cast<int64_t>(logits.shape(1)),
                   "topk_candidates: logits [R, V] and 1 <= k <= V");
  CpuBackend backend(1);
  const int64_t rows = logits.shape(0);
  Tensor ids = backend.empty({rows, k}, DType::kI32), unary = backend.empty({rows, k}, DType::kF32);
  backend.topk_candidates(wrap(logits, DType::kF32), k, multiplier, softcap, ids, unary);
  std::vector<int32_t> id_list(ids.ptr<int32_t>(), ids.ptr<int32_t>() + rows * k);
  std::vector<float> values(unary.ptr<float>(), unary.ptr<float>() + rows * k);
  return nb::make_tuple(nb::cast(id_list), to_numpy_2d(values, k));
}

using U8Array = nb::ndarray<uint8_t, nb::numpy, nb::c_contig, nb::device::cpu>;

// A new numpy array of `shape` holding a copy of data[numel].
template <typename T>
nb::object numpy_copy(const T* data, std::vector<size_t> shape) {
  size_t n = 1;
  for (size_t d : shape) n *= d;
  T* buf = new T[n ? n : 1];
  if (n) std::memcpy(buf, data, n * sizeof(T));
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::cast(nb::ndarray<nb::numpy, T>(buf, shape.size(), shape.data(), owner));
}

// The host e4m3 codec (backend/cpu/host_fp8.h) over an array, for tests: bytes of the values'
// shape, and the values of bytes.
nb::object cpu_fp8_encode(const F32Array& x) {
  std::vector<uint8_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = fp8_e4m3_encode(x.data()[i]);
  std::vector<size_t> shape;
  for (size_t i = 0; i < x.ndim(); ++i) shape.push_back(x.shape(i));
  return numpy_copy(out.data(), shape);
}

nb::object cpu_fp8_decode(const U8Array& q) {
  std::vector<float> out(q.size());
  for (size_t i = 0; i < q.size(); ++i) out[i] = fp8_e4m3_decode(q.data()[i]);
  std::vector<size_t> shape;
  for (size_t i = 0; i < q.ndim(); ++i) shape.push_back(q.shape(i));
  return numpy_copy(out.data(), shape);
}

// The CPU backend's FP8 copy of w [V, H]: (q [V, H] uint8 e4m3, scale [V] fp32).
nb::object cpu_fp8_rows(const F32Array& w) {
  DFLASH_ARG_CHECK(w.ndim() == 2 && w.shape(1) >= 1, "fp8_rows: w [V, H]");
  CpuBackend backend(1);
  const Fp8Weight f = backend.fp8_rows(wrap(w, DType::kF32));
  return nb::make_tuple(numpy_copy(f.q.ptr<uint8_t>(), {w.shape(0), w.shape(1)}),
                        numpy_copy(f.scale.ptr<float>(), {w.shape(0)}));
}

// The CPU backend's linear_fp8: out [M, V] = x [M, H] @ (scale[v] * e4m3(q[v, :]))^T.
nb::object cpu_linear_fp8(const F32Array& x, const U8Array& q, const F32Array& scale) {
  DFLASH_ARG_CHECK(x.ndim() == 2 && q.ndim() == 2 && scale.ndim() == 1 && x.shape(1) == q.shape(1) &&
                       scale.shape(0) == q.shape(0),
                   "linear_fp8: x [M, H], q [V, H], scale [V]");
  CpuBackend backend(2);
  Fp8Weight f;
  f.q = wrap(q, DType::kU8);
  f.scale = wrap(scale, DType::kF32);
  Tensor out = backend.empty({static_cast<int64_t>(x.shape(0)), static_cast<int64_t>(q.shape(0))}, DType::kF32);
  backend.linear_fp8(wrap(x, DType::kF32), f, out);
  return numpy_copy(out.ptr<float>(), {x.shape(0), q.shape(0)});
}

// The CPU backend's exact re-score of candidates: (ids [R, K] re-sorted, unary [R, K]).
nb::object cpu_rescore_candidates(const F32Array& h, const F32Array& head, const I32Array& ids, float multiplier,
                                  float softcap) {
  DFLASH_ARG_CHECK(h.ndim() == 2 && head.ndim() == 2 && ids.ndim() == 2 && h.shape(1) == head.shape(1) &&
                       ids.shape(0) == h.shape(0),
                   "rescore_candidates: h [R, H], head [V, H], ids [R, K]");
  CpuBackend backend(1);
  const int64_t rows = ids.shape(0), k = ids.shape(1);
  Tensor id = backend.empty({rows, k}, DType::kI32), unary = backend.empty({rows, k}, DType::kF32);
  std::memcpy(id.data, ids.data(), id.nbytes());
  backend.rescore_candidates(wrap(h, DType::kF32), wrap(head, DType::kF32), multiplier, softcap, id, unary);
  return nb::make_tuple(numpy_copy(id.ptr<int32_t>(), {ids.shape(0), ids.shape(1)}),
                        numpy_copy(unary.ptr<float>(), {ids.shape(0), ids.shape(1)}));
}

// The CPU backend's grouped dynamic conv (one side), for kernel tests: out [N, H].
nb::object cpu_grouped_conv(const F32Array& x, const F32Array& base, const F32Array& deltas, int64_t side,
                            int64_t block, int64_t group) {
  DFLASH_ARG_CHECK(x.ndim() == 2 && base.ndim() == 3 && deltas.ndim() == 2 && group >= 1 &&
                       x.shape(1) % group == 0 && block >= 1 && x.shape(0) % block == 0 &&
                       base.shape(0) == 2 && base.shape(2) == x.shape(1) && deltas.shape(0) == x.shape(0) &&
                       deltas.shape(1) == 2 * base.shape(1) * (x.shape(1) / group) && (side == 0 || side == 1),
                   "grouped_conv: x [N, H], base [2, T, H], deltas [N, 2 T H / group], N a multiple of block");
  CpuBackend backend(1);
  Tensor out = backend.empty({static_cast<int64_t>(x.shape(0)), static_cast<int64_t>(x.shape(1))}, DType::kF32);
  backend.grouped_conv(wrap(x, DType::kF32), wrap(base, DType::kF32), wrap(deltas, DType::kF32), side, block,
                       group, /*accumulate=*/false, out);
  std::vector<float> values(out.ptr<float>(), out.ptr<float>() + out.numel());
  return to_numpy_2d(values, static_cast<int64_t>(x.shape(1)));
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "dflash C++ runtime (private; use the dflash package)";
  // One Python class for broken files and runtime failures, defined in dflash/errors.py.
  static nb::object dflash_error = nb::module_::import_("dflash.errors").attr("DFlashError");
  m.attr("DFlashError") = dflash_error;
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      raise_error(PyExc_ValueError, e.what());
    } catch (const Exception& e) {
      raise_error(dflash_error.ptr(), e.what());
    }
  });
  m.def("built_with_cuda", &built_with_cuda);
  m.def("cuda_usable", &cuda_usable, "This build has the CUDA backend and a Hopper GPU is usable.");
  m.attr("__version__") = version();

  // Test-only access to pieces of the runtime (not public API).
  nb::module_ testing = m.def_submodule("testing", "Test access to runtime internals");
  testing.def("cpu_paged_attention", &cpu_paged_attention, "q"_a, "k_pool"_a, "v_pool"_a,
              "query_start"_a, "kv_len"_a, "block_table"_a, "causal"_a,
              "The CPU backend's paged attention; returns [T, nh * hd].");
  testing.def("cpu_topk_candidates", &cpu_topk_candidates, "logits"_a, "k"_a, "multiplier"_a = 1.0f,
              "softcap"_a = 0.0f, "The CPU backend's DFlash2 top-K: (ids [R * K], unary [R, K]).");
  testing.def("cpu_fp8_encode", &cpu_fp8_encode, "x"_a,
              "The host e4m3 encode (round to nearest even, saturating at +-448, NaN -> 0x7F): uint8 bytes.");
  testing.def("cpu_fp8_decode", &cpu_fp8_decode, "q"_a, "The value of e4m3 bytes (float32).");
  testing.def("cpu_fp8_rows", &cpu_fp8_rows, "w"_a,
              "The CPU backend's FP8 copy of w [V, H]: (q [V, H] uint8 e4m3, scale [V] float32).");
  testing.def("cpu_linear_fp8", &cpu_linear_fp8, "x"_a, "q"_a, "scale"_a,
              "The CPU backend's linear_fp8: x [M, H] @ (scale[:, None] * e4m3(q))^T, [M, V] float32.");
  testing.def("cpu_rescore_candidates", &cpu_rescore_candidates, "h"_a, "head"_a, "ids"_a, "multiplier"_a = 1.0f,
              "softcap"_a = 0.0f, "The CPU backend's exact re-score of candidates: (ids [R, K], unary [R, K]).");
  testing.def("cpu_grouped_conv", &cpu_grouped_conv, "x"_a, "base"_a, "deltas"_a, "side"_a, "block"_a, "group"_a,
              "The CPU backend's DFlash2 grouped dynamic conv (one side): out [N, H].");
  testing.def("cpu_nonfinite_rows", &cpu_nonfinite_rows, "logits"_a,
              "The CPU backend's row flags: 1 where a row of logits [R, V] holds a NaN or an infinity.");
  testing.def("cpu_linear", &cpu_linear, "x"_a, "w"_a, "num_threads"_a = 2, "cpu_gemm"_a = "auto",
              "The CPU backend's linear layer x @ w.T (cpu_gemm picks the kernel: auto, avx512, avx2 or blas).");
  testing.def("cpu_linear_pass_seconds", &cpu_linear_pass_seconds, "shapes"_a, "rows"_a, "num_threads"_a = 2,
              "cpu_gemm"_a = "auto", "repeats"_a = 5,
              "Seconds of each timed pass of the CPU linear layer over weights of `shapes` [N, K] at `rows` rows.");
  // Adaptive speculation's policy (runtime/spec_policy.h) on synthetic cost tables: rows
  // [batch_size, seconds of each of `lengths`].
  testing.def("spec_expected_tokens", &spec_expected_tokens, "rates"_a, "length"_a, "remaining"_a,
              "E[min(accepted + 1, remaining)] of a step with `length` drafts at per-position acceptance `rates`.");
  testing.def("spec_cost", [](const std::vector<int64_t>& lengths, const std::vector<std::vector<double>>& rows,
                              int64_t batch, int64_t length) {
    const SpecCostTable t = SpecCostTable::from_rows(lengths, rows);
    const auto it = std::find(t.lengths.begin(), t.lengths.end(), length);
    DFLASH_ARG_CHECK(it != t.lengths.end(), "length ", length, " is not in the table");
    return t.cost(batch, static_cast<size_t>(it - t.lengths.begin()));
  }, "lengths"_a, "rows"_a, "batch"_a, "length"_a, "The cost table's (interpolated) seconds of a step.");
  testing.def("spec_choose_length", [](const std::vector<int64_t>& lengths, const std::vector<std::vector<double>>& rows,
                                       int64_t batch, const std::vector<std::vector<double>>& rates,
                                       const std::vector<int64_t>& remaining) {
    const SpecCostTable t = SpecCostTable::from_rows(lengths, rows);
    std::vector<const std::vector<double>*> r;
    for (const auto& x : rates) {
      DFLASH_ARG_CHECK(static_cast<int64_t>(x.size()) >= t.lengths.back(), "acceptance rates must cover the longest length");
      r.push_back(&x);
    }
    return t.lengths[spec_choose_length(t, batch, r, remaining)];
  }, "lengths"_a, "rows"_a, "batch"_a, "rates"_a, "remaining"_a,
     "The draft length the policy picks for a step of requests with these acceptance rates and tokens left.");
  nb::class_<SpecPolicy>(testing, "SpecPolicy")
      .def("__init__", [](SpecPolicy* p, int64_t max_length, const std::vector<int64_t>& lengths,
                          const std::vector<std::vector<double>>& rows, double prior, double request_rate,
                          double global_rate, double recovery_rate) {
        SpecPolicyConfig c;
        c.prior = prior;
        c.request_rate = request_rate;
        c.global_rate = global_rate;
        c.recovery_rate = recovery_rate;
        new (p) SpecPolicy(max_length, c, SpecCostTable::from_rows(lengths, rows));
      }, "max_length"_a, "lengths"_a, "rows"_a, "prior"_a = 0.6, "request_rate"_a = 0.125, "global_rate"_a = 0.02,
         "recovery_rate"_a = 0.01)
      .def("choose", &SpecPolicy::choose, "ids"_a, "remaining"_a, "batch"_a)
      .def("observe", &SpecPolicy::observe, "id"_a, "length"_a, "accepted"_a)
      .def("forget", &SpecPolicy::forget, "id"_a)
      .def("rates", [](const SpecPolicy& p, int64_t id) { return p.rates(id); }, "id"_a)
      .def_prop_ro("global_rates", [](const SpecPolicy& p) { return p.global_rates(); })
      .def_prop_ro("num_tracked", &SpecPolicy::num_tracked);
  nb::class_<BlockAllocator>(testing, "BlockAllocator")
      .def(nb::init<int64_t, bool>(), "num_blocks"_a, "prefix_caching"_a = false)
      .def_prop_ro("num_free", &BlockAllocator::num_free)
      .def_prop_ro("num_blocks", &BlockAllocator::num_blocks)
      .def_prop_ro("num_cached", &BlockAllocator::num_cached)
      .def_prop_ro("num_evictable", &BlockAllocator::num_evictable)
      .def_prop_ro("num_evictions", &BlockAllocator::num_evictions)
      .def("ref_count", &BlockAllocator::ref_count, "block"_a)
      .def("is_cached", &BlockAllocator::is_cached, "block"_a)
      .def("share", &BlockAllocator::share, "block"_a)
      .def("allocate", [](BlockAllocator& a, int64_t n) {
        std::vector<int32_t> out;
        a.allocate(n, &out);
        return out;
      }, "n"_a)
      .def("free", &BlockAllocator::free, "blocks"_a)
      .def("cache", [](BlockAllocator& a, int32_t block, uint64_t hash, uint64_t parent,
                       const std::vector<int32_t>& tokens) {
        a.cache(block, hash, parent, tokens.data(), static_cast<int64_t>(tokens.size()));
      }, "block"_a, "hash"_a, "parent"_a, "tokens"_a)
      .def("lookup", [](const BlockAllocator& a, uint64_t hash, uint64_t parent, const std::vector<int32_t>& tokens) {
        return a.lookup(hash, parent, tokens.data(), static_cast<int64_t>(tokens.size()));
      }, "hash"_a, "parent"_a, "tokens"_a);
  testing.def("prefix_block_hash", [](uint64_t parent, const std::vector<int32_t>& tokens) {
    return prefix_block_hash(parent, tokens.data(), static_cast<int64_t>(tokens.size()));
  }, "parent"_a, "tokens"_a, "The chain hash of a full KV block of `tokens` after the block of hash `parent`.");
  testing.attr("PREFIX_HASH_ROOT") = kPrefixHashRoot;
  nb::class_<BlockTable>(testing, "BlockTable")
      .def(nb::init<int64_t>(), "block_size"_a)
      .def_prop_ro("num_tokens", &BlockTable::num_tokens)
      .def_prop_ro("capacity", &BlockTable::capacity)
      .def_prop_ro("blocks", &BlockTable::blocks)
      .def("reserve", &BlockTable::reserve, "tokens"_a, "allocator"_a)
      .def("append", &BlockTable::append, "n"_a)
      .def("truncate", &BlockTable::truncate, "tokens"_a)
      .def("slot", &BlockTable::slot, "pos"_a)
      .def("release", &BlockTable::release, "allocator"_a);
  bind_loader_testing(testing);
#ifdef DFLASH_WITH_CUDA
  bind_cuda_testing(testing);
  bind_cuda_testing_dflash2(testing);
  bind_cuda_testing_fp8(testing);
  bind_triton_testing(testing);
#endif

  nb::class_<CoreConfig>(m, "SessionConfig")
      .def(nb::init<>())
      .def_rw("device", &SessionOptions::device)
      .def_rw("max_model_len", &SessionOptions::max_model_len)
      .def_rw("kv_cache_tokens", &SessionOptions::kv_cache_tokens)
      .def_rw("block_size", &SessionOptions::block_size)
      .def_rw("max_num_seqs", &SessionOptions::max_num_seqs)
      .def_rw("max_num_batched_tokens", &SessionOptions::max_num_batched_tokens)
      .def_rw("enable_chunked_prefill", &SessionOptions::enable_chunked_prefill)
      .def_rw("enable_prefix_caching", &SessionOptions::enable_prefix_caching)
      .def_rw("num_threads", &SessionOptions::num_threads)
      .def_rw("draft_dir", &SessionOptions::draft_dir)
      .def_rw("num_speculative_tokens", &SessionOptions::num_speculative_tokens)
      .def_rw("gpu_memory_utilization", &SessionOptions::gpu_memory_utilization)
      .def_rw("cuda_graphs", &SessionOptions::cuda_graphs)
      .def_rw("async_decode", &SessionOptions::async_decode)
      .def_rw("draft_sampling", &SessionOptions::draft_sampling)
      .def_rw("draft_head", &SessionOptions::draft_head)
      .def_rw("speculation", &SessionOptions::speculation)
      .def_rw("draft_lengths", &SessionOptions::draft_lengths)
      .def_rw("spec_cost_table", &SessionOptions::spec_cost_table)
      .def_prop_rw(
          "batch_invariant", [](const CoreConfig& c) { return c.kernels.batch_invariant; },
          [](CoreConfig& c, bool on) { c.kernels.batch_invariant = on; })
      .def_rw("tap_layers", &detail::SessionHooks::tap_layers)
      .def_rw("pad_decode_batches", &detail::SessionHooks::pad_decode_batches)
      .def_rw("spec_length_schedule", &detail::SessionHooks::spec_length_schedule);

  nb::class_<SamplingConfig>(m, "SamplingConfig")
      .def(nb::init<>())
      .def_rw("max_tokens", &SamplingConfig::max_tokens)
      .def_rw("temperature", &SamplingConfig::temperature)
      .def_rw("top_p", &SamplingConfig::top_p)
      .def_rw("top_k", &SamplingConfig::top_k)
      .def_rw("seed", &SamplingConfig::seed)
      .def_rw("stop_token_ids", &SamplingConfig::stop_token_ids)
      .def_rw("ignore_eos", &SamplingConfig::ignore_eos);

  nb::class_<RequestInput>(m, "RequestInput")
      .def(nb::init<>())
      .def_rw("prompt", &RequestInput::prompt)
      .def_rw("sampling", &RequestInput::sampling)
      .def_rw("forced_tokens", &RequestInput::forced_tokens)
      .def_rw("record_logits", &RequestInput::record_logits)
      .def_rw("record_prompt_logits", &RequestInput::record_prompt_logits)
      .def_rw("record_taps", &RequestInput::record_taps)
      .def_rw("oracle_drafts", &RequestInput::oracle_drafts);

  nb::class_<StepOutput>(m, "StepOutput")
      .def_ro("request_id", &StepOutput::request_id)
      .def_ro("new_tokens", &StepOutput::new_tokens)
      .def_ro("finished", &StepOutput::finished)
      .def_ro("finish_reason", &StepOutput::finish_reason);

  nb::class_<RequestMetrics>(m, "RequestMetrics")
      .def_ro("prompt_tokens", &RequestMetrics::prompt_tokens)
      .def_ro("generated_tokens", &RequestMetrics::generated_tokens)
      .def_ro("num_steps", &RequestMetrics::num_steps)
      .def_ro("time_to_first_token_s", &RequestMetrics::time_to_first_token_s)
      .def_ro("decode_tokens_per_s", &RequestMetrics::decode_tokens_per_s)
      .def_ro("total_time_s", &RequestMetrics::total_time_s)
      .def_ro("num_spec_steps", &RequestMetrics::num_spec_steps)
      .def_ro("num_drafted", &RequestMetrics::num_drafted)
      .def_ro("num_accepted", &RequestMetrics::num_accepted)
      .def_ro("num_spec_emitted", &RequestMetrics::num_spec_emitted)
      .def_ro("accepted_per_position", &RequestMetrics::accepted_per_position)
      .def_ro("num_preemptions", &RequestMetrics::num_preemptions)
      .def_ro("num_cached_tokens", &RequestMetrics::num_cached_tokens)
      .def_prop_ro("acceptance_length", &RequestMetrics::acceptance_length);

  using runtime::RequestResult;
  nb::class_<RequestResult>(m, "RequestResult")
      .def_ro("request_id", &RequestResult::request_id)
      .def_ro("prompt", &RequestResult::prompt)
      .def_ro("token_ids", &RequestResult::token_ids)
      .def_ro("finish_reason", &RequestResult::finish_reason)
      .def_ro("metrics", &RequestResult::metrics)
      .def_prop_ro("num_logit_values", [](const RequestResult& r) { return r.logits.size(); })
      .def("logits", [](const RequestResult& r, int64_t vocab) {
        return to_numpy_2d(r.logits, vocab);
      }, "vocab_size"_a, "Recorded logits as a float32 array [rows, vocab_size].")
      .def("taps", [](const RequestResult& r, int64_t width) {
        return to_numpy_2d(r.taps, width);
      }, "width"_a, "Recorded hidden-state taps as a float32 array [rows, width].");

  // The stats' attributes and dict come from the one list of their fields (include/dflash/stats.h).
  nb::class_<EngineStats> engine_stats(m, "EngineStats");
  for_each_engine_stat([&](const char* key, auto member) { engine_stats.def_ro(key, member); });

  nb::class_<SessionStats> session_stats(m, "SessionStats");
  for_each_session_stat([&](const char* key, auto member) { session_stats.def_ro(key, member); });
  session_stats.def_ro("engine", &SessionStats::engine)
      .def("as_dict", [](const SessionStats& s) {
        nb::dict d;
        for_each_session_stat([&](const char* key, auto member) { d[key] = nb::cast(s.*member); });
        for_each_engine_stat([&](const char* key, auto member) { d[key] = nb::cast(s.engine.*member); });
        return d;
      }, "Every field, its engine's too, as {key: value} (keys as the attributes are named).");

  nb::class_<ModelInfo>(m, "ModelInfo")
      .def_ro("architecture", &ModelInfo::architecture)
      .def_ro("vocab_size", &ModelInfo::vocab_size)
      .def_ro("hidden_size", &ModelInfo::hidden_size)
      .def_ro("num_layers", &ModelInfo::num_layers)
      .def_ro("num_heads", &ModelInfo::num_heads)
      .def_ro("num_kv_heads", &ModelInfo::num_kv_heads)
      .def_ro("head_dim", &ModelInfo::head_dim)
      .def_ro("max_position_embeddings", &ModelInfo::max_position_embeddings)
      .def_ro("max_model_len", &ModelInfo::max_model_len)
      .def_ro("eos_token_ids", &ModelInfo::eos_token_ids)
      .def_ro("bos_token_id", &ModelInfo::bos_token_id)
      .def_ro("tie_word_embeddings", &ModelInfo::tie_word_embeddings);

  using detail::SessionAccess;
  nb::class_<Session>(m, "Session")
      .def("__init__", [](Session* self, const std::string& model_dir, const CoreConfig& config) {
        new (self) Session(SessionAccess::open(model_dir, config, config));
      }, "model_dir"_a, "config"_a, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("model_config", &Session::model_info, nb::rv_policy::reference_internal)
      .def("add_request", [](Session& s, RequestInput input) {
        return SessionAccess::add_request(s, std::move(input));
      }, "input"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("step", &Session::step, nb::call_guard<nb::gil_scoped_release>())
      .def("abort", &Session::abort, "request_id"_a)
      .def("has_unfinished", &Session::has_unfinished)
      .def("take_result", &SessionAccess::take_result, "request_id"_a,
           "The finished request's result with its recordings (moved out of the session).")
      .def("generate", [](Session& s, std::vector<RequestInput> inputs) {
        return SessionAccess::core(s).generate(std::move(inputs));
      }, "inputs"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("stats", &Session::stats)
      .def("block_ref_counts", [](const Session& s) { return SessionAccess::core(s).block_ref_counts(); },
           "Test hook: the reference count of every KV block (block tables holding it).")
      .def("propose", [](Session& s, const std::vector<int32_t>& prompt) {
        std::vector<int32_t> drafts;
        std::vector<float> logits;
        {
          nb::gil_scoped_release release;
          SessionAccess::core(s).propose(prompt, &drafts, &logits);
        }
        const int64_t n = static_cast<int64_t>(drafts.size());
        int32_t* ids = new int32_t[n ? n : 1];
        std::copy(drafts.begin(), drafts.end(), ids);
        nb::capsule owner(ids, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
        size_t shape[1] = {static_cast<size_t>(n)};
        nb::object id_arr = nb::cast(nb::ndarray<nb::numpy, int32_t, nb::ndim<1>>(ids, 1, shape, owner));
        return nb::make_tuple(id_arr, to_numpy_2d(logits, s.model_info().vocab_size));
      }, "prompt"_a, "Prefill + context update + one draft step: (draft ids [n], draft logits [n, vocab]).")
      .def("propose_details", [](Session& s, const std::vector<int32_t>& prompt) {
        std::vector<int32_t> drafts;
        std::vector<float> logits;
        Engine::ProposeDetails d;
        {
          nb::gil_scoped_release release;
          SessionAccess::core(s).propose(prompt, &drafts, &logits, &d);
        }
        nb::dict out;
        out["draft_ids"] = nb::cast(drafts);
        out["draft_logits"] = to_numpy_2d(logits, s.model_info().vocab_size);
        out["k"] = d.k;
        if (d.k > 0) {
          out["candidate_ids"] = nb::cast(d.cand_ids);
          out["unary"] = to_numpy_2d(d.unary, d.k);
          out["edges"] = to_numpy_2d(d.edges, d.k);
          out["realized"] = to_numpy_2d(d.realized, d.k);
        }
        return out;
      }, "prompt"_a, "propose() with a K-candidate drafter's candidates, unary and edge scores and walked rows.");
}
