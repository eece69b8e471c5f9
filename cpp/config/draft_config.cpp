// DFlash drafter config.json parsing and target compatibility checks.
#include "config/draft_config.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <filesystem>

namespace dflash {

std::vector<int> build_target_layer_ids(int64_t num_target_layers, int64_t num_draft_layers) {
  if (num_draft_layers == 1) return {static_cast<int>(num_target_layers / 2)};
  const double start = 1.0, end = static_cast<double>(num_target_layers - 3);
  std::vector<int> ids;
  for (int64_t i = 0; i < num_draft_layers; ++i) {
    // Python's round(): half to even.
    const double x = start + i * (end - start) / static_cast<double>(num_draft_layers - 1);
    ids.push_back(static_cast<int>(std::nearbyint(x)));
  }
  return ids;
}

namespace {

// The dflash_config fields of a DFlash2DraftModel; errors name the file and the field.
void draft_config_parse_dflash2(const Json& dc, const std::string& path, DraftConfig* d) {
  const std::string what = path + " dflash_config";
  auto required = [&](const char* key) {
    auto v = json_opt_int(dc, key, what);
    DFLASH_CHECK(v.has_value(), path, ": a DFlash2DraftModel needs the integer field 'dflash_config.", key, "'");
    return *v;
  };
  DFlash2Config& c = d->dflash2;
  c.conv_kernel_size = required("conv_kernel_size");
  c.conv_group_size = required("conv_group_size");
  c.selector_rank = required("selector_rank");
  c.selector_top_k = required("selector_top_k");
  c.output_multiplier = json_opt_double(dc, "output_multiplier", what).value_or(1.0);
  c.final_logit_softcapping = json_opt_double(dc, "final_logit_softcapping", what).value_or(0.0);
  c.input_embedding_scale = json_opt_double(dc, "input_embedding_scale", what).value_or(1.0);
  const int64_t h = d->geometry.hidden_size;
  DFLASH_CHECK(c.conv_kernel_size >= 1 && c.conv_kernel_size <= d->block_size, path,
               ": field 'dflash_config.conv_kernel_size' must be in [1, block_size=", d->block_size, "], got ",
               c.conv_kernel_size);
  DFLASH_CHECK(c.conv_group_size >= 1 && h % c.conv_group_size == 0, path,
               ": field 'dflash_config.conv_group_size' (", c.conv_group_size, ") must divide hidden_size (", h,
               ")");
  DFLASH_CHECK(c.selector_rank >= 1, path, ": field 'dflash_config.selector_rank' must be >= 1, got ",
               c.selector_rank);
  DFLASH_CHECK(c.selector_rank <= kMaxModelWidth, path, ": field 'dflash_config.selector_rank' is ", c.selector_rank,
               ", beyond the largest dflash accepts (", kMaxModelWidth, ")");
  DFLASH_CHECK(c.selector_top_k >= 1 && c.selector_top_k < d->geometry.vocab_size, path,
               ": field 'dflash_config.selector_top_k' (", c.selector_top_k, ") must be in [1, vocab_size=",
               d->geometry.vocab_size, ")");
  DFLASH_CHECK(std::isfinite(c.output_multiplier) && c.output_multiplier > 0.0, path,
               ": field 'dflash_config.output_multiplier' must be a positive number, got ", c.output_multiplier);
  DFLASH_CHECK(std::isfinite(c.final_logit_softcapping) && c.final_logit_softcapping >= 0.0, path,
               ": field 'dflash_config.final_logit_softcapping' must be >= 0 (0 or absent: no cap), got ",
               c.final_logit_softcapping);
  DFLASH_CHECK(std::isfinite(c.input_embedding_scale) && c.input_embedding_scale > 0.0, path,
               ": field 'dflash_config.input_embedding_scale' must be a positive number, got ",
               c.input_embedding_scale);
}

}  // namespace

DraftConfig draft_config_from_json(const Json& j, const std::string& path) {
  DFLASH_CHECK(j.is_object(), path, ": expected a JSON object");
  const Json* archs = json_opt_array(j, "architectures", path);
  const bool strings = archs && !archs->empty() &&
                       std::all_of(archs->begin(), archs->end(), [](const Json& x) { return x.is_string(); });
  const std::string arch = strings ? (*archs)[0].get<std::string>() : std::string();
  DFLASH_CHECK(arch == "DFlashDraftModel" || arch == "DFlash2DraftModel", path, ": field 'architectures' is ",
               archs ? json_brief(*archs) : std::string("missing"),
               "; a drafter directory needs [\"DFlashDraftModel\"] or [\"DFlash2DraftModel\"]");
  // The drafter is a Qwen3 stack: reuse the target parser on a Qwen3-typed copy.
  Json geo = j;
  geo["architectures"] = Json::array({"Qwen3ForCausalLM"});
  geo.erase("eos_token_id");
  geo.erase("use_sliding_window");  // the drafter's windows come from layer_types (below)
  DraftConfig d;
  d.path = path;
  d.arch_name = arch;
  d.arch = arch == "DFlash2DraftModel" ? DraftArch::kDFlash2 : DraftArch::kDFlash;
  d.geometry = model_config_from_json(geo, path);
  const Json empty = Json::object();
  const Json* dc_field = json_opt_object(j, "dflash_config", path);
  const Json& dc = dc_field ? *dc_field : empty;
  if (auto b = json_opt_int(j, "block_size", path)) {
    d.block_size = *b;
  } else if (auto b2 = json_opt_int(dc, "block_size", path + " dflash_config")) {
    d.block_size = *b2;
  } else {
    DFLASH_CHECK(false, path, ": missing field 'block_size'");
  }
  DFLASH_CHECK(d.block_size >= 2 && d.block_size <= 64, path, ": field 'block_size' must be in [2, 64], got ",
               d.block_size);
  if (auto n = json_opt_int(j, "num_target_layers", path)) {
    DFLASH_CHECK(*n >= 1 && *n <= kMaxModelLayers, path, ": field 'num_target_layers' must be in [1, ",
                 kMaxModelLayers, "], got ", *n);
    d.num_target_layers = *n;
  }
  if (const Json* ids = json_opt_array(dc, "target_layer_ids", path + " dflash_config")) {
    DFLASH_CHECK(!ids->empty() && static_cast<int64_t>(ids->size()) <= kMaxModelLayers, path,
                 ": field 'dflash_config.target_layer_ids' must be a non-empty list of at most ", kMaxModelLayers,
                 " layer ids");
    for (const auto& x : *ids) {
      // Full range: 2^32 must not wrap to layer 0 (checked against the target's layers later).
      d.target_layer_ids.push_back(
          static_cast<int>(json_int_value(x, "dflash_config.target_layer_ids", path, 0, kMaxModelLayers - 1)));
    }
  } else {
    DFLASH_CHECK(d.num_target_layers > 0, path,
                 ": neither 'dflash_config.target_layer_ids' nor 'num_target_layers' is given");
    d.target_layer_ids = build_target_layer_ids(d.num_target_layers, d.geometry.num_layers);
  }
  auto mask = json_opt_int(dc, "mask_token_id", path + " dflash_config");
  if (!mask) mask = json_opt_int(j, "mask_token_id", path);
  DFLASH_CHECK(mask.has_value(), path, ": missing field 'dflash_config.mask_token_id'");
  d.mask_token_id = *mask;
  // layer_types / sliding_window, and causality: a top-level is_causal decides for every
  // layer; without it sliding layers attend causally within the window (the semantics of vLLM
  // and SGLang) and full layers attend to the whole context and block.
  d.sliding_window.assign(d.geometry.num_layers, 0);
  const std::optional<bool> is_causal = json_opt_bool(j, "is_causal", path);
  if (const Json* lt = json_opt_array(j, "layer_types", path)) {
    DFLASH_CHECK(static_cast<int64_t>(lt->size()) == d.geometry.num_layers, path,
                 ": field 'layer_types' has ", lt->size(), " entries for ", d.geometry.num_layers,
                 " layers");
    for (size_t i = 0; i < lt->size(); ++i) {
      DFLASH_CHECK((*lt)[i].is_string(), path, ": field 'layer_types' must hold strings, got ",
                   json_brief((*lt)[i]));
      const std::string t = (*lt)[i].get<std::string>();
      if (t == "full_attention") continue;
      DFLASH_CHECK(t == "sliding_attention", path, ": unsupported layer type '", t, "' in 'layer_types'");
      auto w = json_opt_int(j, "sliding_window", path);
      DFLASH_CHECK(w.has_value() && *w > 0, path,
                   ": 'layer_types' has sliding_attention but 'sliding_window' is missing");
      DFLASH_CHECK(*w <= INT32_MAX, path, ": field 'sliding_window' is ", *w, ", beyond ", INT32_MAX);
      d.sliding_window[i] = *w;
    }
  }
  d.layer_causal.resize(d.geometry.num_layers);
  for (int64_t i = 0; i < d.geometry.num_layers; ++i) {
    d.layer_causal[i] = is_causal.has_value() ? *is_causal : d.sliding_window[i] > 0;
  }
  if (d.arch == DraftArch::kDFlash2) draft_config_parse_dflash2(dc, path, &d);
  return d;
}

DraftConfig draft_config_load(const std::string& draft_dir) {
  namespace fs = std::filesystem;
  DFLASH_CHECK(fs::is_directory(draft_dir), "drafter directory not found: ", draft_dir);
  const std::string path = (fs::path(draft_dir) / "config.json").string();
  DFLASH_CHECK(fs::exists(path), draft_dir, ": missing config.json");
  return draft_config_from_json(json_read_file(path), path);
}

void draft_config_check_target(const DraftConfig& d, const ModelConfig& t, const std::string& target_dir) {
  const std::string both = d.path + " vs " + target_dir + "/config.json";
  DFLASH_CHECK(d.geometry.vocab_size == t.vocab_size, both, ": field 'vocab_size' differs (drafter ",
               d.geometry.vocab_size, ", target ", t.vocab_size, ")");
  DFLASH_CHECK(d.geometry.hidden_size == t.hidden_size, both,
               ": field 'hidden_size' differs (drafter ", d.geometry.hidden_size, ", target ", t.hidden_size,
               "); the drafter uses the target's embedding and lm_head");
  DFLASH_CHECK(d.mask_token_id >= 0 && d.mask_token_id < t.vocab_size, both,
               ": field 'dflash_config.mask_token_id' (", d.mask_token_id, ") is outside the target vocabulary (",
               t.vocab_size, ")");
  if (d.num_target_layers > 0) {
    DFLASH_CHECK(d.num_target_layers == t.num_layers, both, ": field 'num_target_layers' is ",
                 d.num_target_layers, " but the target has ", t.num_layers, " layers");
  }
  for (int id : d.target_layer_ids) {
    DFLASH_CHECK(id >= 0 && id < t.num_layers, both, ": field 'dflash_config.target_layer_ids' holds ", id,
                 ", outside the target's ", t.num_layers, " layers");
  }
  DFLASH_CHECK(d.geometry.num_heads % d.geometry.num_kv_heads == 0, both, ": drafter head geometry is invalid");
}

}  // namespace dflash
