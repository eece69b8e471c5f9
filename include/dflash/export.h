// DFLASH_API: marks the symbols of the public API (the headers of include/dflash/) as exported
// from the shared library libdflash. The library is built with hidden visibility and a linker
// version script, so nothing else of the runtime is visible to its users.
#pragma once

#if defined(__GNUC__) || defined(__clang__)
#define DFLASH_API __attribute__((visibility("default")))
#else
#define DFLASH_API
#endif
