// The key functions of the public exception classes (include/dflash/errors.h): their vtables and
// type information are emitted here once. Part of the core library, since all of the runtime
// throws them; exported from libdflash, so that a program catches what the library throws.
#include "dflash/errors.h"

namespace dflash {

Exception::~Exception() = default;
Error::~Error() = default;
InvalidArgument::~InvalidArgument() = default;

}  // namespace dflash
