// Device pieces shared by the skinny GEMM kernels (cuda/skinny_gemm.cu, cuda/stream_gemm.cu):
// the weight and input loads, the bf16 tensor-core mma and its operand words, the shared-memory
// reduction layout, and the fused input transforms (RMSNorm, silu * up) staged in shared memory.
#pragma once

#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/tensor_core.cuh"  // mma_bf16

namespace dflash {
namespace cuda {
namespace skinny {

constexpr int kChunk = 32;  // k per warp chunk: 4 lanes x 8 bf16 of one row

// 16 bytes of w: read once, so not cached in L1 (keeps L1 for x).
__device__ __forceinline__ uint4 load_w(const __nv_bfloat16* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// 16 bytes of x: read by every CTA, cached in L1.
__device__ __forceinline__ uint4 load_x(const __nv_bfloat16* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Shared-memory reduction buffer: [W][8 NT][16 R + 4] fp32 (the +4 spreads the fragment
// stores over the banks).
__host__ __device__ constexpr int red_stride(int row_tiles) { return 16 * row_tiles + 4; }
__host__ __device__ constexpr size_t red_bytes(int nt, int row_tiles) { return sizeof(float) * 8 * nt * red_stride(row_tiles); }

// One output of a product: fp32, or bf16 (ADD: the bf16 value already there added first).
template <bool F32, bool ADD>
__device__ __forceinline__ void store_out(void* out, int64_t o, float sum) {
  if constexpr (F32) {
    static_cast<float*>(out)[o] = sum;
  } else {
    __nv_bfloat16* y = static_cast<__nv_bfloat16*>(out);
    if constexpr (ADD) sum += __bfloat162float(y[o]);
    y[o] = __float2bfloat16_rn(sum);
  }
}

// Static shared memory of the kernels (stage_input's row sums): a launch whose dynamic shared
// memory plus this passes the 48 KB default must raise the kernel's dynamic limit first.
constexpr size_t kStaticSmemMargin = 2048;

// Row stride (elements) of x staged in shared memory: 16 bytes of padding spread the rows over
// the banks.
__host__ __device__ constexpr int staged_stride(int k) { return k + 8; }

// Builds x [M, K] in shared memory (row stride staged_stride(K)) from the fused input `in`:
// RMSNorm of in [M, K] with gamma, or silu(gate) * up of in [M, 2K]. All threads of the CTA.
// Every thread takes the same 16-byte columns of every row (v = thread, thread + threads, ...)
// and issues the loads of all rows of a column together, so staging costs a couple of L2 round
// trips whatever M (one warp per row, as before, waited on 16 loads in a row at K = 4096). RMSNorm:
// the raw rows are copied first while each thread sums its squares per row; the row sums are
// reduced over the lanes (butterfly) and then the warps in order (deterministic), and the
// normalisation runs in place in shared memory.
template <int IN>
__device__ void stage_input(const __nv_bfloat16* __restrict__ in, const __nv_bfloat16* __restrict__ gamma, float eps,
                            int M, int K, __nv_bfloat16* xs) {
  constexpr int kRows = 16;  // kSkinnyFusedMaxRows, kStreamGemmMaxRows
  const int tid = threadIdx.x, threads = blockDim.x, lane = tid & 31, warp = tid >> 5, num_warps = threads >> 5;
  const int vecs = K / 8, ks = staged_stride(K);
  if constexpr (IN == static_cast<int>(SkinnyInput::kRmsNorm)) {
    __shared__ float part[kRows][16];  // [row][warp] (at most 16 warps)
    __shared__ float inv_rms[kRows];
    float ss[kRows];
#pragma unroll
    for (int m = 0; m < kRows; ++m) ss[m] = 0.0f;
#pragma unroll 2
    for (int v = tid; v < vecs; v += threads) {
      uint4 raw[kRows];
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        if (m < M) raw[m] = *reinterpret_cast<const uint4*>(in + static_cast<int64_t>(m) * K + v * 8);
      }
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        if (m < M) {
          *reinterpret_cast<uint4*>(xs + m * ks + v * 8) = raw[m];
          const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw[m]);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(h[e]);
            ss[m] += f.x * f.x;
            ss[m] += f.y * f.y;
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < kRows; ++m) {
      if (m < M) {
        const float sum = detail::warp_sum(ss[m]);
        if (lane == 0) part[m][warp] = sum;
      }
    }
    __syncthreads();
    if (tid < M) {
      float sum = 0.0f;
      for (int w = 0; w < num_warps; ++w) sum += part[tid][w];
      inv_rms[tid] = rsqrtf(sum / static_cast<float>(K) + eps);
    }
    __syncthreads();
    for (int v = tid; v < vecs; v += threads) {
      float gv[8];
      detail::load_bf16<8>(gamma + v * 8, gv);
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        if (m < M) {
          float x[8], o[8];
          detail::load_bf16<8>(xs + m * ks + v * 8, x);
          const float inv = inv_rms[m];
#pragma unroll
          for (int e = 0; e < 8; ++e) o[e] = gv[e] * (x[e] * inv);
          detail::store_bf16<8>(xs + m * ks + v * 8, o);
        }
      }
    }
  } else {
#pragma unroll 4
    for (int i = tid; i < M * vecs; i += threads) {
      const int m = i / vecs, c = (i - m * vecs) * 8;
      float a[8], b[8], o[8];
      const __nv_bfloat16* row = in + static_cast<int64_t>(m) * 2 * K;
      detail::load_bf16<8>(row + c, a);
      detail::load_bf16<8>(row + K + c, b);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = a[e] / (1.0f + __expf(-a[e])) * b[e];
      detail::store_bf16<8>(xs + m * ks + c, o);
    }
  }
  __syncthreads();
}

}  // namespace skinny
}  // namespace cuda
}  // namespace dflash
