// The checks that raise the runtime's exceptions (the public ones of include/dflash/errors.h):
// dflash::Error is for broken files and internal failures (Python: dflash.DFlashError);
// dflash::InvalidArgument is for caller mistakes (Python: ValueError).
#pragma once

#include <cstdio>
#include <sstream>
#include <string>
#include <type_traits>

#include "dflash/errors.h"

namespace dflash {

namespace detail {
// Numbers are formatted without the stream's locale facets (std::to_string / snprintf): a
// process may hold another C++ runtime's facets (seen with torch loaded first on the GPU
// machine), and an error message must never be what crashes.
template <typename T>
void stream_one(std::ostringstream& os, const T& x) {
  if constexpr (std::is_same_v<T, bool>) {
    os << (x ? "true" : "false");
  } else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, char>) {
    os << std::to_string(x);
  } else if constexpr (std::is_floating_point_v<T>) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(x));
    os << buf;
  } else {
    os << x;
  }
}
inline void stream_parts(std::ostringstream&) {}
template <typename T, typename... Rest>
void stream_parts(std::ostringstream& os, const T& first, const Rest&... rest) {
  stream_one(os, first);
  stream_parts(os, rest...);
}
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  stream_parts(os, parts...);
  return os.str();
}
}  // namespace detail

}  // namespace dflash

// DFLASH_CHECK(cond, parts...): throws dflash::Error("parts... [file:line]") when cond is false.
#define DFLASH_CHECK(cond, ...)                                                              \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      throw ::dflash::Error(::dflash::detail::concat(__VA_ARGS__, " [", __FILE__, ":",      \
                                                     __LINE__, "]"));                       \
    }                                                                                        \
  } while (0)

// DFLASH_ARG_CHECK(cond, parts...): throws dflash::InvalidArgument (a caller mistake).
#define DFLASH_ARG_CHECK(cond, ...)                                                       \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      throw ::dflash::InvalidArgument(::dflash::detail::concat(__VA_ARGS__));             \
    }                                                                                     \
  } while (0)
