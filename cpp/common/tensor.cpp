// Small helpers for the Tensor handle.
#include "common/tensor.h"

#include <sstream>

namespace dflash {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << std::to_string(shape[i]);
  os << "]";
  return os.str();
}

}  // namespace dflash
