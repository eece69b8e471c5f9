// Safetensors reader: memory-maps .safetensors files, validates their headers, and gives
// typed views of the tensors. A Checkpoint opens a model directory, single-file or sharded
// through model.safetensors.index.json. No torch; every malformed input is a dflash::Error.
// Headers are validated as the reference `safetensors` library does: exact header length,
// tensors stored back to back from byte 0 to the end of the file (no gap, overlap, shared
// bytes or trailing data), no duplicate names, bounded JSON nesting, sizes without overflow.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/tensor.h"

namespace dflash {

// One stored tensor: its dtype as stored, its shape and a pointer into the mapped file.
struct StoredTensor {
  std::string name;
  std::string file;  // path of the file holding it (for messages)
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // points into the mapping; valid while the file is open
  size_t nbytes = 0;

  int64_t numel() const;
  // Converts to fp32 into `out` (numel() floats).
  void to_f32(float* out) const;
  // Converts to bf16 bits into `out` (numel() uint16).
  void to_bf16(uint16_t* out) const;
};

// A read-only memory mapping of one .safetensors file and its parsed header.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::map<std::string, StoredTensor>& tensors() const { return tensors_; }
  // Tensors with a valid header entry but a dtype dflash cannot read: name -> dtype.
  const std::map<std::string, std::string>& unreadable() const { return unreadable_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::map<std::string, StoredTensor> tensors_;
  std::map<std::string, std::string> unreadable_;
};

// The tensors a model uses with the shapes it needs: name -> shape.
using TensorShapes = std::map<std::string, std::vector<int64_t>>;

// All tensors of a model directory.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& model_dir);

  bool has(const std::string& name) const { return index_.count(name) != 0; }
  // Throws dflash::Error naming the directory if absent.
  const StoredTensor& get(const std::string& name) const;
  // Checks the shape too; the error names the tensor, the expected and the stored shape.
  const StoredTensor& get(const std::string& name, const std::vector<int64_t>& shape) const;
  std::vector<std::string> names() const;
  const std::string& dir() const { return dir_; }
  // Every tensor of the checkpoint (of any dtype) is one `expected` names, and every tensor
  // `expected` names is present: the error names an unused tensor, `owner` (what loads the
  // checkpoint) and what hint(name) adds, or the first missing tensor. Shapes are not checked.
  void check_tensor_set(const TensorShapes& expected, const std::string& owner,
                        const std::function<std::string(const std::string&)>& hint) const;

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const StoredTensor*> index_;
  std::map<std::string, std::string> unreadable_;  // name -> dtype of unloadable tensors
};

float half_to_float(uint16_t h);
inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_bf16(float f);  // round to nearest even

}  // namespace dflash
