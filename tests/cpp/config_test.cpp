// config.json parsing of targets and drafters (cpp/config/): the fields of valid Llama and Qwen3
// configs, defaults, EOS ids merged from generation_config.json, RoPE frequencies, a drafter's
// dflash_config and its check against the target. (Hostile files are tested from Python.)
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>

#include "common/error.h"
#include "config/draft_config.h"
#include "config/model_config.h"
#include "test_files.h"

namespace dflash {
namespace {

class ConfigFiles : public ::testing::Test {
 protected:
  void SetUp() override { dir = dflash_test::make_temp_dir("config"); }
  void TearDown() override { std::filesystem::remove_all(dir); }
  std::string write(const std::string& sub, const std::string& config) {
    const std::string d = dir + "/" + sub;
    std::filesystem::create_directories(d);
    dflash_test::write_text(d + "/config.json", config);
    return d;
  }
  std::string dir;
};

const char* kLlama = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
  "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 100,
  "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": true,
  "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"})";

TEST_F(ConfigFiles, ParsesALlamaConfigAndMergesGenerationEosIds) {
  const std::string d = write("llama", kLlama);
  dflash_test::write_text(d + "/generation_config.json", R"({"eos_token_id": [7, 2]})");
  const ModelConfig c = model_config_load(d);
  EXPECT_EQ(c.arch, Architecture::kLlama);
  EXPECT_EQ(c.arch_name, "LlamaForCausalLM");
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.intermediate_size, 128);
  EXPECT_EQ(c.num_layers, 4);
  EXPECT_EQ(c.num_heads, 8);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 8);  // hidden_size / num_attention_heads
  EXPECT_EQ(c.vocab_size, 100);
  EXPECT_EQ(c.max_position_embeddings, 512);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{2, 7}));  // both files, sorted, unique
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
  const std::vector<float> inv = c.rope_inv_freq();
  ASSERT_EQ(inv.size(), 4u);
  for (size_t i = 0; i < inv.size(); ++i) {
    EXPECT_FLOAT_EQ(inv[i], 1.0f / std::pow(500000.0f, 2.0f * i / 8.0f)) << i;
  }
}

TEST_F(ConfigFiles, ParsesAQwen3ConfigWithDefaults) {
  const ModelConfig c = model_config_load(write("qwen3", R"({"model_type": "qwen3", "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
    "vocab_size": 50})"));
  EXPECT_EQ(c.arch, Architecture::kQwen3);
  EXPECT_EQ(c.arch_name, "Qwen3ForCausalLM");
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.head_dim, 16);  // given, not hidden / heads
  EXPECT_EQ(c.num_kv_heads, 4);  // defaults to the attention heads
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_EQ(c.bos_token_id, -1);
}

TEST_F(ConfigFiles, Llama3RopeScalesTheLowFrequencies) {
  const ModelConfig c = model_config_from_json(Json::parse(R"({"architectures": ["LlamaForCausalLM"],
    "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 8,
    "rope_theta": 10000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})"), "inline");
  EXPECT_EQ(c.rope.type, "llama3");
  const std::vector<float> inv = c.rope_inv_freq();
  ASSERT_EQ(inv.size(), 32u);
  EXPECT_FLOAT_EQ(inv[0], 1.0f);  // wavelength 2 pi < 64 / 4: unchanged
  // The lowest frequency: wavelength far above 64 / 1, divided by the factor.
  EXPECT_FLOAT_EQ(inv[31], static_cast<float>(1.0f / std::pow(10000.0f, 62.0f / 64.0f) / 8.0));
}

TEST_F(ConfigFiles, UnsupportedArchitectureNamesTheFileAndField) {
  const std::string d = write("gpt2", R"({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8})");
  try {
    model_config_load(d);
    FAIL() << "expected dflash::Error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("config.json"), std::string::npos) << what;
    EXPECT_NE(what.find("architectures"), std::string::npos) << what;
  }
  EXPECT_THROW(model_config_load(dir + "/missing"), Error);
}

TEST_F(ConfigFiles, ParsesADFlashDrafterAndChecksItAgainstItsTarget) {
  const std::string target_dir = write("target", kLlama);
  const std::string d = write("drafter", R"({"architectures": ["DFlashDraftModel"], "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "vocab_size": 100, "block_size": 8, "num_target_layers": 4,
    "dflash_config": {"target_layer_ids": [0, 3], "mask_token_id": 99}})");
  const DraftConfig c = draft_config_load(d);
  EXPECT_EQ(c.arch, DraftArch::kDFlash);
  EXPECT_EQ(c.arch_name, "DFlashDraftModel");
  EXPECT_EQ(c.block_size, 8);
  EXPECT_EQ(c.num_target_layers, 4);
  EXPECT_EQ(c.target_layer_ids, (std::vector<int>{0, 3}));
  EXPECT_EQ(c.mask_token_id, 99);
  EXPECT_EQ(c.geometry.num_layers, 1);
  EXPECT_EQ(c.geometry.head_dim, 16);
  EXPECT_TRUE(c.geometry.qk_norm);  // a Qwen3 stack
  ASSERT_EQ(c.layer_causal.size(), 1u);
  EXPECT_FALSE(c.layer_causal[0]);  // full attention over the block
  const ModelConfig target = model_config_load(target_dir);
  EXPECT_NO_THROW(draft_config_check_target(c, target, target_dir));
  ModelConfig other = target;
  other.vocab_size = 120;
  EXPECT_THROW(draft_config_check_target(c, other, target_dir), Error);
  other = target;
  other.num_layers = 3;
  EXPECT_THROW(draft_config_check_target(c, other, target_dir), Error);  // num_target_layers and layer id 3
}

TEST(BuildTargetLayerIds, IsThePublishedDefaultSelection) {
  // z-lab's Qwen3-8B drafters: 5 layers tapping [1, 9, 17, 25, 33] of 36; one layer taps the middle.
  EXPECT_EQ(build_target_layer_ids(36, 5), (std::vector<int>{1, 9, 17, 25, 33}));
  EXPECT_EQ(build_target_layer_ids(36, 1), (std::vector<int>{18}));
}

}  // namespace
}  // namespace dflash
