// Test-only bindings of the loaders, added to dflash._core.testing: the JSON reader, the
// safetensors reader, the target and drafter config parsers and the target's tensor-set check,
// each on its own (no backend, no weights uploaded), so tests and the loader fuzzer
// (bench/fuzz_loaders.py) can feed them thousands of hostile inputs cheaply. Errors map as
// everywhere: dflash::InvalidArgument -> ValueError, every other dflash::Exception -> dflash.DFlashError.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <string>

#include "config/draft_config.h"
#include "config/model_config.h"
#include "model/transformer.h"
#include "weights/safetensors.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace dflash {

namespace {

std::string bytes_str(const nb::bytes& b) { return std::string(b.c_str(), b.size()); }

// The safetensors name of a dtype dflash reads.
const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kI32: return "I32";
    default: throw Error(detail::concat("no safetensors dtype for ", dtype_name(t)));
  }
}

// [(name, dtype, shape, data bytes or None for dtypes dflash cannot read)] in name order.
nb::list safetensors_read(const std::string& path) {
  SafetensorsFile file(path);
  std::map<std::string, nb::tuple> rows;
  for (const auto& [name, t] : file.tensors()) {
    nb::bytes data(reinterpret_cast<const char*>(t.data), t.nbytes);
    rows.emplace(name, nb::make_tuple(name, safetensors_dtype(t.dtype), nb::cast(t.shape), data));
  }
  for (const auto& [name, dtype] : file.unreadable()) {
    rows.emplace(name, nb::make_tuple(name, dtype, nb::none(), nb::none()));
  }
  nb::list out;
  for (auto& kv : rows) out.append(kv.second);
  return out;
}

nb::dict draft_config_parse(const nb::bytes& text, const std::string& what) {
  const DraftConfig d = draft_config_from_json(json_parse(bytes_str(text), what), what);
  nb::dict out;
  out["arch_name"] = d.arch_name;
  out["num_layers"] = d.geometry.num_layers;
  out["block_size"] = d.block_size;
  out["target_layer_ids"] = nb::cast(d.target_layer_ids);
  out["mask_token_id"] = d.mask_token_id;
  out["sliding_window"] = nb::cast(d.sliding_window);
  return out;
}

}  // namespace

void bind_loader_testing(nb::module_& testing) {
  testing.attr("JSON_MAX_DEPTH") = kJsonMaxDepth;
  // The parsed target config as the parser left it (the public API shows ModelInfo instead).
  nb::class_<ModelConfig>(testing, "ModelConfig")
      .def_ro("arch_name", &ModelConfig::arch_name)
      .def_ro("hidden_size", &ModelConfig::hidden_size)
      .def_ro("intermediate_size", &ModelConfig::intermediate_size)
      .def_ro("num_layers", &ModelConfig::num_layers)
      .def_ro("num_heads", &ModelConfig::num_heads)
      .def_ro("num_kv_heads", &ModelConfig::num_kv_heads)
      .def_ro("head_dim", &ModelConfig::head_dim)
      .def_ro("vocab_size", &ModelConfig::vocab_size)
      .def_ro("max_position_embeddings", &ModelConfig::max_position_embeddings)
      .def_ro("eos_token_ids", &ModelConfig::eos_token_ids)
      .def_ro("bos_token_id", &ModelConfig::bos_token_id)
      .def_ro("tie_word_embeddings", &ModelConfig::tie_word_embeddings);
  testing.def("json_parse", [](const nb::bytes& text, const std::string& what) {
    return json_parse(bytes_str(text), what).dump();
  }, "text"_a, "what"_a = "json", "The JSON reader on `text` (bytes): the value as compact JSON.");
  testing.def("safetensors_read", &safetensors_read, "path"_a,
              "The safetensors reader on one file: [(name, dtype, shape, data bytes | None)] in name order.");
  testing.def("model_config_parse", [](const nb::bytes& text, const std::string& what) {
    return model_config_from_json(json_parse(bytes_str(text), what), what);
  }, "text"_a, "what"_a = "config.json", "The target config parser on config.json text (bytes).");
  testing.def("draft_config_parse", &draft_config_parse, "text"_a, "what"_a = "config.json",
              "The drafter config parser on config.json text (bytes): a dict of the parsed fields.");
  testing.def("target_checkpoint_check", [](const std::string& model_dir) {
    transformer_check_checkpoint(model_config_load(model_dir), Checkpoint(model_dir));
  }, "model_dir"_a, "The target's config and tensor-set checks on a model directory (nothing is uploaded).");
}

}  // namespace dflash
