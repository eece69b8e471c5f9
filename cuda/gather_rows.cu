// Row gather out[r] = x[rows[r]] (bf16 or fp32, copied as raw bytes) and the column-block copy
// dst[:, col:col + C] = src (bf16). Both copy in the widest unit (16, 4 or 2 bytes) that the
// sizes and pointers allow; x over the units of a row, y grid-strides over rows.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

// x [*, units] (rows index it), rows [R], out [R, units].
template <typename U>
static __global__ void gather_rows_kernel(const U* x, const int32_t* rows, int64_t num_rows,
                                          int64_t units, U* out) {
  detail::pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= units) return;
  for (int64_t r = blockIdx.y; r < num_rows; r += gridDim.y) {
    out[r * units + i] = x[static_cast<int64_t>(rows[r]) * units + i];
  }
}

// src [R, cols], dst [R, dst_width]; all in units of U.
template <typename U>
static __global__ void copy_columns_kernel(const U* src, int64_t rows, int64_t cols, U* dst,
                                           int64_t dst_width, int64_t col) {
  detail::pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= cols) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) dst[r * dst_width + col + i] = src[r * cols + i];
}

namespace {

// Grid of a [rows, units] copy: up to 256 threads over a row's units, blocks over rows.
void copy_grid(int64_t rows, int64_t units, dim3* grid, int* threads) {
  *threads = units >= 256 ? 256 : static_cast<int>((units + 31) / 32 * 32);
  *grid = dim3(detail::grid_for(units, *threads, 1 << 30), detail::grid_for(rows, 1, 65535));
}

template <typename U>
cudaError_t gather_rows_as(const void* x, const int32_t* rows, int64_t num_rows, int64_t row_bytes,
                           void* out, cudaStream_t stream) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(U));
  dim3 grid;
  int threads;
  copy_grid(num_rows, units, &grid, &threads);
  detail::launch(&gather_rows_kernel<U>, grid, threads, 0, stream, static_cast<const U*>(x), rows, num_rows,
                                                      units, static_cast<U*>(out));
  return cudaGetLastError();
}

template <typename U>
cudaError_t copy_columns_as(const __nv_bfloat16* src, int64_t rows, int64_t cols,
                            __nv_bfloat16* dst, int64_t dst_width, int64_t col, cudaStream_t stream) {
  constexpr int64_t k = sizeof(U) / sizeof(__nv_bfloat16);
  dim3 grid;
  int threads;
  copy_grid(rows, cols / k, &grid, &threads);
  detail::launch(&copy_columns_kernel<U>, grid, threads, 0, stream, reinterpret_cast<const U*>(src), rows,
                                                       cols / k, reinterpret_cast<U*>(dst),
                                                       dst_width / k, col / k);
  return cudaGetLastError();
}

}  // namespace

cudaError_t gather_rows(const void* x, const int32_t* rows, int64_t num_rows, int64_t width,
                        int64_t elem_bytes, void* out, cudaStream_t stream) {
  if (num_rows <= 0 || width <= 0) return cudaSuccess;
  if (elem_bytes != 2 && elem_bytes != 4) return cudaErrorInvalidValue;
  const int64_t row_bytes = width * elem_bytes;
  const uintptr_t bits = reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(out) |
                         static_cast<uintptr_t>(row_bytes);
  if ((bits & 15) == 0) return gather_rows_as<uint4>(x, rows, num_rows, row_bytes, out, stream);
  if ((bits & 3) == 0) return gather_rows_as<uint32_t>(x, rows, num_rows, row_bytes, out, stream);
  return gather_rows_as<uint16_t>(x, rows, num_rows, row_bytes, out, stream);
}

cudaError_t copy_columns(const __nv_bfloat16* src, int64_t rows, int64_t cols, __nv_bfloat16* dst,
                         int64_t dst_width, int64_t col, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (col < 0 || col + cols > dst_width) return cudaErrorInvalidValue;
  const bool vec = cols % 8 == 0 && dst_width % 8 == 0 && col % 8 == 0 &&
                   detail::aligned16(src) && detail::aligned16(dst);
  if (vec) return copy_columns_as<uint4>(src, rows, cols, dst, dst_width, col, stream);
  const bool pair = cols % 2 == 0 && dst_width % 2 == 0 && col % 2 == 0 &&
                    (reinterpret_cast<uintptr_t>(src) & 3) == 0 &&
                    (reinterpret_cast<uintptr_t>(dst) & 3) == 0;
  if (pair) return copy_columns_as<uint32_t>(src, rows, cols, dst, dst_width, col, stream);
  return copy_columns_as<uint16_t>(src, rows, cols, dst, dst_width, col, stream);
}

}  // namespace cuda
}  // namespace dflash
