// DFLASH_CUDA_CHECK: turns a failed CUDA runtime call into a dflash::Error naming the call.
#pragma once

#include <cuda_runtime.h>

#include "common/error.h"

#define DFLASH_CUDA_CHECK(expr)                                                              \
  do {                                                                                       \
    cudaError_t dflash_cuda_err_ = (expr);                                                   \
    DFLASH_CHECK(dflash_cuda_err_ == cudaSuccess, #expr, " failed: ",                       \
                 cudaGetErrorString(dflash_cuda_err_));                                      \
  } while (0)
