// Writers of the C++ tests' files (see test_files.h).
#include "test_files.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>

namespace dflash_test {

namespace {

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

uint16_t to_f16(float f) {  // normal numbers and zero only (what the tests store)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000;
  const int32_t exp = static_cast<int32_t>((u >> 23) & 0xFF) - 127 + 15;
  if ((u & 0x7FFFFFFF) == 0) return static_cast<uint16_t>(sign);
  if (exp <= 0 || exp >= 31) throw std::runtime_error("to_f16: value out of the tests' range");
  const uint32_t mant = u & 0x7FFFFF;
  uint32_t h = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
  return static_cast<uint16_t>(h);
}

std::string shape_json(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

NamedTensor make_tensor(const std::string& name, const std::vector<int64_t>& shape, const std::vector<float>& values,
                        const std::string& dtype) {
  NamedTensor t{name, dtype, shape, {}};
  for (float v : values) {
    if (dtype == "F32") {
      uint8_t b[4];
      std::memcpy(b, &v, 4);
      t.bytes.insert(t.bytes.end(), b, b + 4);
    } else {
      const uint16_t h = dtype == "BF16" ? to_bf16(v) : dtype == "F16" ? to_f16(v) : throw std::runtime_error(dtype);
      t.bytes.push_back(static_cast<uint8_t>(h & 0xFF));
      t.bytes.push_back(static_cast<uint8_t>(h >> 8));
    }
  }
  return t;
}

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors, const std::string& metadata) {
  std::string header = "{";
  size_t offset = 0;
  for (const NamedTensor& t : tensors) {
    if (header.size() > 1) header += ",";
    header += "\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":" + shape_json(t.shape) +
              ",\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + t.bytes.size()) + "]}";
    offset += t.bytes.size();
  }
  if (!metadata.empty()) header += std::string(header.size() > 1 ? "," : "") + "\"__metadata__\":" + metadata;
  header += "}";
  while (header.size() % 8 != 0) header += ' ';
  std::ofstream f(path, std::ios::binary);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xFF));
  f << header;
  for (const NamedTensor& t : tensors) f.write(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  if (!f) throw std::runtime_error("cannot write " + path);
}

void write_tiny_llama(const std::string& dir, const TinyLlama& m) {
  std::filesystem::create_directories(dir);
  const int64_t h = m.hidden_size, hd = h / m.num_heads, inter = m.intermediate_size, v = m.vocab_size;
  std::mt19937 rng(m.seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  auto random = [&](const std::string& name, const std::vector<int64_t>& shape, float scale) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> x(n);
    for (float& e : x) e = scale * uniform(rng);
    return make_tensor(name, shape, x);
  };
  auto ones = [&](const std::string& name, int64_t n) { return make_tensor(name, {n}, std::vector<float>(n, 1.0f)); };
  std::vector<NamedTensor> t;
  t.push_back(random("model.embed_tokens.weight", {v, h}, 1.0f));
  for (int64_t l = 0; l < m.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const float s = 2.0f / static_cast<float>(std::sqrt(static_cast<double>(h)));
    t.push_back(ones(p + "input_layernorm.weight", h));
    t.push_back(random(p + "self_attn.q_proj.weight", {m.num_heads * hd, h}, s));
    t.push_back(random(p + "self_attn.k_proj.weight", {m.num_kv_heads * hd, h}, s));
    t.push_back(random(p + "self_attn.v_proj.weight", {m.num_kv_heads * hd, h}, s));
    t.push_back(random(p + "self_attn.o_proj.weight", {h, m.num_heads * hd}, s));
    t.push_back(ones(p + "post_attention_layernorm.weight", h));
    t.push_back(random(p + "mlp.gate_proj.weight", {inter, h}, s));
    t.push_back(random(p + "mlp.up_proj.weight", {inter, h}, s));
    t.push_back(random(p + "mlp.down_proj.weight", {h, inter}, 1.0f / static_cast<float>(std::sqrt(1.0 * inter))));
  }
  t.push_back(ones("model.norm.weight", h));
  if (!m.tie_word_embeddings) t.push_back(random("lm_head.weight", {v, h}, 0.3f));
  write_safetensors(dir + "/model.safetensors", t, "{\"format\":\"pt\"}");

  std::ostringstream c;
  c << "{\"architectures\":[\"LlamaForCausalLM\"],\"model_type\":\"llama\",\"hidden_size\":" << h
    << ",\"intermediate_size\":" << inter << ",\"num_hidden_layers\":" << m.num_layers
    << ",\"num_attention_heads\":" << m.num_heads << ",\"num_key_value_heads\":" << m.num_kv_heads
    << ",\"vocab_size\":" << v << ",\"max_position_embeddings\":" << m.max_position_embeddings
    << ",\"rms_norm_eps\":1e-5,\"rope_theta\":10000.0,\"hidden_act\":\"silu\",\"tie_word_embeddings\":"
    << (m.tie_word_embeddings ? "true" : "false");
  if (!m.eos_token_ids.empty()) {
    c << ",\"eos_token_id\":[";
    for (size_t i = 0; i < m.eos_token_ids.size(); ++i) c << (i ? "," : "") << m.eos_token_ids[i];
    c << "]";
  }
  c << "}";
  write_text(dir + "/config.json", c.str());
}

std::vector<int32_t> token_range(int32_t first, int64_t n) {
  std::vector<int32_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = first + static_cast<int32_t>(i);
  return t;
}

std::string make_temp_dir(const std::string& tag) {
  std::string tmpl = (std::filesystem::temp_directory_path() / ("dflash-" + tag + "-XXXXXX")).string();
  if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
  return tmpl;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  if (!f) throw std::runtime_error("cannot write " + path);
}

}  // namespace dflash_test
