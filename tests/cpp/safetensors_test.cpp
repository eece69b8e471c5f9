// The safetensors reader (cpp/weights/safetensors.h) on valid files: F32 / BF16 / F16 tensors
// with their shapes and values, a single-file and a sharded checkpoint directory (index.json),
// lookups with shape checks. (Malformed files are tested from Python.)
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "common/error.h"
#include "test_files.h"
#include "weights/safetensors.h"

namespace dflash {
namespace {

using dflash_test::make_tensor;

class SafetensorsFiles : public ::testing::Test {
 protected:
  void SetUp() override { dir = dflash_test::make_temp_dir("safetensors"); }
  void TearDown() override { std::filesystem::remove_all(dir); }
  std::string dir;
};

// Values exact in bf16 and f16.
const std::vector<float> kValues = {1.5f, -2.0f, 0.15625f, 0.0f, 384.0f, -0.75f};

TEST_F(SafetensorsFiles, ReadsEachFloatTypeWithItsShape) {
  const std::string path = dir + "/t.safetensors";
  dflash_test::write_safetensors(path, {make_tensor("a", {2, 3}, kValues, "F32"),
                                        make_tensor("b", {3, 2}, kValues, "BF16"),
                                        make_tensor("c", {6}, kValues, "F16")},
                                 R"({"format": "pt"})");
  SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_TRUE(f.unreadable().empty());
  const StoredTensor& a = f.tensors().at("a");
  EXPECT_EQ(a.dtype, DType::kF32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.numel(), 6);
  EXPECT_EQ(a.nbytes, 24u);
  EXPECT_EQ(f.tensors().at("b").dtype, DType::kBF16);
  EXPECT_EQ(f.tensors().at("b").nbytes, 12u);
  EXPECT_EQ(f.tensors().at("c").dtype, DType::kF16);
  for (const char* name : {"a", "b", "c"}) {
    std::vector<float> out(6);
    f.tensors().at(name).to_f32(out.data());
    EXPECT_EQ(out, kValues) << name;
    std::vector<uint16_t> bf(6);
    f.tensors().at(name).to_bf16(bf.data());
    for (size_t i = 0; i < 6; ++i) EXPECT_EQ(bf16_to_float(bf[i]), kValues[i]) << name << " " << i;
  }
}

TEST_F(SafetensorsFiles, HalfAndBf16ConversionsRoundTrip) {
  EXPECT_EQ(half_to_float(0x3C00), 1.0f);
  EXPECT_EQ(half_to_float(0xC000), -2.0f);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.5f)), 1.5f);
  // Round to nearest even: 1 + 2^-8 is halfway between two bf16 values and goes to the even one.
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
}

TEST_F(SafetensorsFiles, OpensSingleFileAndShardedCheckpoints) {
  const std::string single = dir + "/single", sharded = dir + "/sharded";
  std::filesystem::create_directories(single);
  std::filesystem::create_directories(sharded);
  dflash_test::write_safetensors(single + "/model.safetensors",
                                 {make_tensor("w", {2, 3}, kValues), make_tensor("v", {6}, kValues)});
  Checkpoint one(single);
  EXPECT_EQ(one.names(), (std::vector<std::string>{"v", "w"}));
  EXPECT_TRUE(one.has("w"));
  EXPECT_FALSE(one.has("x"));
  EXPECT_EQ(one.get("w", {2, 3}).numel(), 6);
  EXPECT_THROW(one.get("w", {3, 2}), Error);  // shape mismatch
  EXPECT_THROW(one.get("x"), Error);

  dflash_test::write_safetensors(sharded + "/model-00001-of-00002.safetensors", {make_tensor("w", {2, 3}, kValues)});
  dflash_test::write_safetensors(sharded + "/model-00002-of-00002.safetensors",
                                 {make_tensor("v", {6}, kValues, "BF16")});
  dflash_test::write_text(sharded + "/model.safetensors.index.json",
                          R"({"metadata": {}, "weight_map": {"w": "model-00001-of-00002.safetensors",
                              "v": "model-00002-of-00002.safetensors"}})");
  Checkpoint two(sharded);
  EXPECT_EQ(two.names(), (std::vector<std::string>{"v", "w"}));
  EXPECT_EQ(two.get("v").dtype, DType::kBF16);
  std::vector<float> out(6);
  two.get("v", {6}).to_f32(out.data());
  EXPECT_EQ(out, kValues);
  EXPECT_NE(two.get("w").file.find("model-00001-of-00002"), std::string::npos);
}

TEST_F(SafetensorsFiles, ADirectoryWithoutWeightsIsAnError) {
  EXPECT_THROW(Checkpoint c(dir), Error);
}

}  // namespace
}  // namespace dflash
