// The exceptions dflash throws: one hierarchy under dflash::Exception.
//   dflash::InvalidArgument  a caller mistake: bad options or sampling parameters, a prompt that
//                            does not fit, an unknown request id (Python: ValueError);
//   dflash::Error            broken or inconsistent model files, and failures of the runtime or
//                            the device (Python: dflash.DFlashError).
// Messages say what was wrong and, for files, which file and field. A call that throws leaves
// the session as it was, except where the function's comment says otherwise.
#pragma once

#include <stdexcept>
#include <string>

#include "dflash/export.h"

namespace dflash {

// The base of every dflash exception (catch it to catch them all).
class DFLASH_API Exception : public std::runtime_error {
 public:
  explicit Exception(const std::string& message) : std::runtime_error(message) {}
  ~Exception() override;
};

// Broken or inconsistent files, runtime and device failures.
class DFLASH_API Error : public Exception {
 public:
  explicit Error(const std::string& message) : Exception(message) {}
  ~Error() override;
};

// A mistake of the caller: nothing was changed.
class DFLASH_API InvalidArgument : public Exception {
 public:
  explicit InvalidArgument(const std::string& message) : Exception(message) {}
  ~InvalidArgument() override;
};

}  // namespace dflash
