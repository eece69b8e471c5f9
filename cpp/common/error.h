// The one error type of the runtime and the checks that raise it.
// dflash::Error is for broken files and internal failures (Python: dflash.DFlashError);
// dflash::InvalidArgument is for caller mistakes (Python: ValueError).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace dflash {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

class InvalidArgument : public std::invalid_argument {
 public:
  explicit InvalidArgument(const std::string& msg) : std::invalid_argument(msg) {}
};

namespace detail {
inline void stream_parts(std::ostringstream&) {}
template <typename T, typename... Rest>
void stream_parts(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
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
