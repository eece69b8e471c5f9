// The version of the dflash headers (semantic versioning; the same as the Python package's), and
// of the library they were compiled against: dflash::version() returns the library's, so a
// program can check at start-up that it runs with the libdflash it was built for.
#pragma once

#include "dflash/export.h"

#define DFLASH_VERSION_MAJOR 0
#define DFLASH_VERSION_MINOR 1
#define DFLASH_VERSION_PATCH 0
#define DFLASH_VERSION_STRING "0.1.0"
// One number for comparisons: MAJOR * 10000 + MINOR * 100 + PATCH.
#define DFLASH_VERSION (DFLASH_VERSION_MAJOR * 10000 + DFLASH_VERSION_MINOR * 100 + DFLASH_VERSION_PATCH)

namespace dflash {

// The version of the library linked at run time, "MAJOR.MINOR.PATCH".
DFLASH_API const char* version();

}  // namespace dflash
