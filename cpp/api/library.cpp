// The public API's free functions (include/dflash/version.h, session.h): the library's version
// and the backends of this build.
#include "backend/backend.h"
#include "dflash/session.h"
#include "dflash/version.h"

namespace dflash {

const char* version() { return DFLASH_VERSION_STRING; }

bool built_with_cuda() { return backend_built_with_cuda(); }
bool cuda_usable() { return backend_cuda_usable(); }

}  // namespace dflash
