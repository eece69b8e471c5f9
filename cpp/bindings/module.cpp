// dflash._core: the nanobind module, the only file that includes nanobind. Binds Session
// (token ids in, token ids out), its config, sampling config, step outputs and results.
// The GIL is released while C++ runs. dflash::Error maps to dflash.DFlashError and
// dflash::InvalidArgument to ValueError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "runtime/session.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace dflash;

namespace {

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
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const Error& e) {
      PyErr_SetString(dflash_error.ptr(), e.what());
    }
  });
  m.def("built_with_cuda", []() { return false; });

  nb::class_<SessionConfig>(m, "SessionConfig")
      .def(nb::init<>())
      .def_rw("device", &SessionConfig::device)
      .def_rw("max_model_len", &SessionConfig::max_model_len)
      .def_rw("kv_cache_tokens", &SessionConfig::kv_cache_tokens)
      .def_rw("block_size", &SessionConfig::block_size)
      .def_rw("max_num_seqs", &SessionConfig::max_num_seqs)
      .def_rw("max_num_batched_tokens", &SessionConfig::max_num_batched_tokens)
      .def_rw("num_threads", &SessionConfig::num_threads)
      .def_rw("tap_layers", &SessionConfig::tap_layers);

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
      .def_rw("record_taps", &RequestInput::record_taps);

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
      .def_ro("total_time_s", &RequestMetrics::total_time_s);

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

  nb::class_<EngineStats>(m, "EngineStats")
      .def_ro("num_steps", &EngineStats::num_steps)
      .def_ro("num_forward_tokens", &EngineStats::num_forward_tokens)
      .def_ro("num_generated_tokens", &EngineStats::num_generated_tokens)
      .def_ro("num_requests_finished", &EngineStats::num_requests_finished);

  nb::class_<SessionStats>(m, "SessionStats")
      .def_ro("device", &SessionStats::device)
      .def_ro("weight_bytes", &SessionStats::weight_bytes)
      .def_ro("kv_cache_bytes", &SessionStats::kv_cache_bytes)
      .def_ro("kv_cache_tokens", &SessionStats::kv_cache_tokens)
      .def_ro("block_size", &SessionStats::block_size)
      .def_ro("num_blocks", &SessionStats::num_blocks)
      .def_ro("num_free_blocks", &SessionStats::num_free_blocks)
      .def_ro("max_model_len", &SessionStats::max_model_len)
      .def_ro("num_threads", &SessionStats::num_threads)
      .def_ro("engine", &SessionStats::engine);

  nb::class_<ModelConfig>(m, "ModelConfig")
      .def_ro("arch_name", &ModelConfig::arch_name)
      .def_ro("hidden_size", &ModelConfig::hidden_size)
      .def_ro("num_layers", &ModelConfig::num_layers)
      .def_ro("num_heads", &ModelConfig::num_heads)
      .def_ro("num_kv_heads", &ModelConfig::num_kv_heads)
      .def_ro("head_dim", &ModelConfig::head_dim)
      .def_ro("vocab_size", &ModelConfig::vocab_size)
      .def_ro("max_position_embeddings", &ModelConfig::max_position_embeddings)
      .def_ro("eos_token_ids", &ModelConfig::eos_token_ids)
      .def_ro("tie_word_embeddings", &ModelConfig::tie_word_embeddings);

  nb::class_<Session>(m, "Session")
      .def(nb::init<const std::string&, const SessionConfig&>(), "model_dir"_a, "config"_a,
           nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("model_config", &Session::model_config, nb::rv_policy::reference_internal)
      .def("add_request", &Session::add_request, "input"_a,
           nb::call_guard<nb::gil_scoped_release>())
      .def("step", &Session::step, nb::call_guard<nb::gil_scoped_release>())
      .def("abort", &Session::abort, "request_id"_a)
      .def("has_unfinished", &Session::has_unfinished)
      .def("take_result", &Session::take_result, "request_id"_a)
      .def("generate", &Session::generate, "inputs"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("stats", &Session::stats);
}
