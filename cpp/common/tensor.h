// A minimal tensor handle shared by the model and the backends: a shape, a dtype, a device and
// a pointer into storage owned by a shared_ptr. Contiguous, row-major. No math lives here: ops
// are in the backend (cpp/backend/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"

namespace dflash {

enum class DType { kF32, kBF16, kF16, kI32, kU8 };
enum class DeviceKind { kCPU, kCUDA };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kI32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kU8: return 1;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kI32: return "int32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kU8: return "uint8";
  }
  return "?";
}

struct Tensor {
  std::shared_ptr<void> storage;  // keeps the memory alive; null for an empty tensor
  void* data = nullptr;
  DType dtype = DType::kF32;
  DeviceKind device = DeviceKind::kCPU;
  std::vector<int64_t> shape;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  int64_t dim(int i) const { return shape.at(i < 0 ? shape.size() + i : i); }
  bool empty() const { return data == nullptr; }

  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }

  // Rows [begin, end) of the first dimension, sharing storage.
  Tensor rows(int64_t begin, int64_t end) const {
    DFLASH_CHECK(!shape.empty() && begin >= 0 && begin <= end && end <= shape[0],
                 "Tensor::rows out of range");
    Tensor t = *this;
    t.shape[0] = end - begin;
    t.data = static_cast<char*>(data) + begin * (nbytes() / (shape[0] ? shape[0] : 1));
    return t;
  }
  // Same storage, another shape with the same number of elements.
  Tensor reshape(std::vector<int64_t> new_shape) const {
    Tensor t = *this;
    t.shape = std::move(new_shape);
    DFLASH_CHECK(t.numel() == numel(), "Tensor::reshape changes the element count");
    return t;
  }
};

std::string shape_str(const std::vector<int64_t>& shape);

}  // namespace dflash
