// What the C++ tests share: the files they write (safetensors files of F32 / F16 / BF16 tensors
// written from floats, a tiny random Llama model directory that the runtime loads) and token id
// ranges. Standard C++ only: the public API tests use it without the runtime's headers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dflash_test {

struct NamedTensor {
  std::string name;
  std::string dtype;  // "F32", "F16" or "BF16"
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// A tensor of `shape` holding `values` (numel of them) stored as `dtype`.
NamedTensor make_tensor(const std::string& name, const std::vector<int64_t>& shape, const std::vector<float>& values,
                        const std::string& dtype = "F32");
// Writes a .safetensors file: 8-byte header length, JSON header (with `metadata` as
// "__metadata__" when non-empty: a JSON object), the tensors' bytes in order.
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::string& metadata = "");

struct TinyLlama {
  int64_t vocab_size = 64;
  int64_t hidden_size = 32;
  int64_t num_layers = 2;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 2;
  int64_t intermediate_size = 64;
  int64_t max_position_embeddings = 256;
  bool tie_word_embeddings = false;
  std::vector<int64_t> eos_token_ids;  // none by default: requests run to max_tokens
  uint32_t seed = 3;  // (seed 3 gives varied greedy continuations of the tests' prompts)
};
// A LlamaForCausalLM directory with random fp32 weights (head_dim = hidden / heads).
void write_tiny_llama(const std::string& dir, const TinyLlama& model = TinyLlama());

// Token ids first, first + 1, ..., first + n - 1.
std::vector<int32_t> token_range(int32_t first, int64_t n);

// A new empty directory under the system's temporary directory.
std::string make_temp_dir(const std::string& tag);
void write_text(const std::string& path, const std::string& text);

}  // namespace dflash_test
