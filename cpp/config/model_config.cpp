// config.json → ModelConfig, with validation, and RoPE frequency tables.
#include "config/model_config.h"

#include <cmath>
#include <filesystem>
#include <set>

namespace dflash {

namespace {

void collect_eos(const Json& j, const std::string& what, std::vector<int64_t>* out) {
  if (!j.is_object() || !j.contains("eos_token_id") || j["eos_token_id"].is_null()) return;
  const Json& e = j["eos_token_id"];
  if (e.is_number_integer()) {
    out->push_back(json_int_value(e, "eos_token_id", what));
  } else if (e.is_array()) {
    for (const auto& x : e) out->push_back(json_int_value(x, "eos_token_id", what));
  } else {
    DFLASH_CHECK(false, what, ": field 'eos_token_id' must be an integer or a list, got ", json_brief(e));
  }
}

// A finite positive number, for scales and frequencies.
void check_positive(double v, const std::string& what, const char* field) {
  DFLASH_CHECK(std::isfinite(v) && v > 0, what, ": field '", field, "' must be a positive number, got ", v);
}

RopeConfig parse_rope(const Json& j, const std::string& what) {
  RopeConfig r;
  // transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; older files write
  // rope_theta at the top level and rope_scaling {rope_type|type, factor, ...} (null: none).
  const Json* rope_parameters = json_opt_object(j, "rope_parameters", what);
  const Json* rope_scaling = json_opt_object(j, "rope_scaling", what);
  const Json* params = rope_scaling ? rope_scaling : rope_parameters;
  const std::string field = rope_scaling ? "rope_scaling" : "rope_parameters";
  if (auto t = json_opt_double(j, "rope_theta", what)) r.theta = *t;
  if (rope_parameters) {
    if (auto t = json_opt_double(*rope_parameters, "rope_theta", what + " rope_parameters")) r.theta = *t;
  }
  check_positive(r.theta, what, "rope_theta");
  if (!params) return r;
  const std::string pw = what + " " + field;
  if (auto t = json_opt_string(*params, "rope_type", pw)) {
    r.type = *t;
  } else if (auto t2 = json_opt_string(*params, "type", pw)) {
    r.type = *t2;
  }
  if (r.type == "default") return r;
  if (r.type == "linear") {
    r.factor = json_get_double(*params, "factor", pw);
    check_positive(r.factor, pw, "factor");
    return r;
  }
  if (r.type == "llama3") {
    r.factor = json_get_double(*params, "factor", pw);
    r.low_freq_factor = json_get_double(*params, "low_freq_factor", pw);
    r.high_freq_factor = json_get_double(*params, "high_freq_factor", pw);
    r.original_max_position_embeddings =
        json_get_int(*params, "original_max_position_embeddings", pw);
    check_positive(r.factor, pw, "factor");
    check_positive(r.low_freq_factor, pw, "low_freq_factor");
    check_positive(r.high_freq_factor, pw, "high_freq_factor");
    DFLASH_CHECK(r.high_freq_factor > r.low_freq_factor && r.original_max_position_embeddings > 0,
                 pw, ": inconsistent llama3 rope parameters");
    return r;
  }
  DFLASH_CHECK(false, pw, ": unsupported rope_type '", r.type,
               "' (supported: default, linear, llama3)");
  return r;
}

// The architecture name: architectures[0] (a non-empty list of strings), else model_type.
std::string architecture_name(const Json& j, const std::string& what) {
  if (const Json* a = json_opt_array(j, "architectures", what)) {
    for (const auto& x : *a) {
      DFLASH_CHECK(x.is_string(), what, ": field 'architectures' must be a list of strings, got ", json_brief(*a));
    }
    if (!a->empty()) return (*a)[0].get<std::string>();
  }
  if (auto mt = json_opt_string(j, "model_type", what)) {
    return *mt == "llama" ? "LlamaForCausalLM" : *mt == "qwen3" ? "Qwen3ForCausalLM" : *mt;
  }
  return std::string();
}

}  // namespace

ModelConfig model_config_from_json(const Json& j, const std::string& what) {
  DFLASH_CHECK(j.is_object(), what, ": expected a JSON object");
  ModelConfig c;
  const std::string arch = architecture_name(j, what);
  DFLASH_CHECK(!arch.empty(), what, ": missing field 'architectures'");
  if (arch == "LlamaForCausalLM") {
    c.arch = Architecture::kLlama;
  } else if (arch == "Qwen3ForCausalLM") {
    c.arch = Architecture::kQwen3;
    c.qk_norm = true;
  } else {
    DFLASH_CHECK(false, what, ": unsupported architecture '", arch,
                 "' in field 'architectures' (supported: LlamaForCausalLM, Qwen3ForCausalLM)");
  }
  c.arch_name = arch;
  // Dimensions: positive and at most a bound far above any real model, so that every size the
  // runtime derives from them (weights, activations, logits) fits in 64 bits and a config
  // declaring enormous sizes is refused before anything is allocated.
  auto dim = [&](int64_t v, const char* field, int64_t max) {
    DFLASH_CHECK(v > 0, what, ": field '", field, "' must be positive, got ", v);
    DFLASH_CHECK(v <= max, what, ": field '", field, "' is ", v, ", beyond the largest dflash accepts (", max, ")");
    return v;
  };
  c.hidden_size = dim(json_get_int(j, "hidden_size", what), "hidden_size", kMaxModelWidth);
  c.intermediate_size = dim(json_get_int(j, "intermediate_size", what), "intermediate_size", kMaxModelWidth);
  c.num_layers = dim(json_get_int(j, "num_hidden_layers", what), "num_hidden_layers", kMaxModelLayers);
  c.num_heads = dim(json_get_int(j, "num_attention_heads", what), "num_attention_heads", kMaxModelHeads);
  c.num_kv_heads = dim(json_opt_int(j, "num_key_value_heads", what).value_or(c.num_heads), "num_key_value_heads",
                       kMaxModelHeads);
  c.vocab_size = dim(json_get_int(j, "vocab_size", what), "vocab_size", kMaxModelVocab);
  DFLASH_CHECK(c.num_heads % c.num_kv_heads == 0, what, ": field 'num_attention_heads' (",
               c.num_heads, ") must be a multiple of 'num_key_value_heads' (", c.num_kv_heads,
               ")");
  auto head_dim = json_opt_int(j, "head_dim", what);
  if (head_dim) {
    c.head_dim = *head_dim;
  } else {
    DFLASH_CHECK(c.hidden_size % c.num_heads == 0, what, ": field 'hidden_size' (",
                 c.hidden_size, ") is not divisible by 'num_attention_heads' (", c.num_heads,
                 ") and no 'head_dim' is given");
    c.head_dim = c.hidden_size / c.num_heads;
  }
  DFLASH_CHECK(c.head_dim > 0 && c.head_dim % 2 == 0, what,
               ": field 'head_dim' must be positive and even, got ", c.head_dim);
  dim(c.head_dim, "head_dim", kMaxModelHeadDim);
  c.max_position_embeddings = dim(json_opt_int(j, "max_position_embeddings", what).value_or(2048),
                                  "max_position_embeddings", INT32_MAX);  // positions are int32
  c.rms_norm_eps = json_opt_double(j, "rms_norm_eps", what).value_or(1e-6);
  check_positive(c.rms_norm_eps, what, "rms_norm_eps");
  c.tie_word_embeddings = json_opt_bool(j, "tie_word_embeddings", what).value_or(false);
  if (j.contains("hidden_act")) {  // absent: silu (transformers' default); null or a non-string: an error
    const Json& act = j["hidden_act"];
    DFLASH_CHECK(act.is_string(), what, ": field 'hidden_act' must be a string, got ", json_brief(act));
    DFLASH_CHECK(act.get<std::string>() == "silu", what, ": unsupported 'hidden_act' '", act.get<std::string>(),
                 "' (only silu)");
  }
  DFLASH_CHECK(!json_opt_bool(j, "attention_bias", what).value_or(false), what,
               ": 'attention_bias': true is not supported");
  DFLASH_CHECK(!json_opt_bool(j, "mlp_bias", what).value_or(false), what,
               ": 'mlp_bias': true is not supported");
  DFLASH_CHECK(!json_opt_bool(j, "use_sliding_window", what).value_or(false), what,
               ": 'use_sliding_window': true is not supported");
  c.rope = parse_rope(j, what);
  if (auto b = json_opt_int(j, "bos_token_id", what)) c.bos_token_id = *b;
  DFLASH_CHECK(c.bos_token_id < c.vocab_size, what, ": bos_token_id ", c.bos_token_id,
               " is outside the vocabulary (", c.vocab_size, ")");
  collect_eos(j, what, &c.eos_token_ids);
  return c;
}

ModelConfig model_config_load(const std::string& model_dir) {
  namespace fs = std::filesystem;
  DFLASH_CHECK(fs::is_directory(model_dir), "model directory not found: ", model_dir);
  const std::string path = (fs::path(model_dir) / "config.json").string();
  DFLASH_CHECK(fs::exists(path), model_dir, ": missing config.json");
  ModelConfig c = model_config_from_json(json_read_file(path), path);
  const std::string gen = (fs::path(model_dir) / "generation_config.json").string();
  if (fs::exists(gen)) collect_eos(json_read_file(gen), gen, &c.eos_token_ids);
  std::set<int64_t> uniq(c.eos_token_ids.begin(), c.eos_token_ids.end());
  c.eos_token_ids.assign(uniq.begin(), uniq.end());
  for (int64_t e : c.eos_token_ids) {
    DFLASH_CHECK(e >= 0 && e < c.vocab_size, path, ": eos_token_id ", e,
                 " is outside the vocabulary (", c.vocab_size, ")");
  }
  return c;
}

std::vector<float> ModelConfig::rope_inv_freq() const {
  const int64_t half = head_dim / 2;
  std::vector<float> inv(half);
  for (int64_t i = 0; i < half; ++i) {
    float e = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv[i] = 1.0f / std::pow(static_cast<float>(rope.theta), e);
  }
  if (rope.type == "linear") {
    for (auto& f : inv) f = static_cast<float>(f / rope.factor);
  } else if (rope.type == "llama3") {
    const double old_len = static_cast<double>(rope.original_max_position_embeddings);
    const double low_wavelen = old_len / rope.low_freq_factor;
    const double high_wavelen = old_len / rope.high_freq_factor;
    for (auto& f : inv) {
      const double wavelen = 2.0 * M_PI / f;
      if (wavelen > low_wavelen) {
        f = static_cast<float>(f / rope.factor);
      } else if (wavelen >= high_wavelen) {
        const double smooth = (old_len / wavelen - rope.low_freq_factor) /
                              (rope.high_freq_factor - rope.low_freq_factor);
        f = static_cast<float>((1.0 - smooth) * f / rope.factor + smooth * f);
      }
    }
  }
  return inv;
}

}  // namespace dflash
