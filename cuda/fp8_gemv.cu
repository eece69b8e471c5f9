// FP8 GEMV/GEMM of DFlash2's candidate head: out[M, V] (fp32) = x[M, H] (bf16) @ W^T with
// W[v, k] = scale[v] * e4m3(q[v, k]), 1 <= M <= kFp8GemvMaxRows. The e4m3 weights are read from
// HBM exactly once per launch for every M: a CTA owns a strip of vocabulary rows and ALL the
// launch's x rows, so its weight bytes are never fetched by another CTA.
//
// Tiling. CTA = WV x WM warps; warp (wv, wm) owns 16 RT vocabulary rows x 8 NT x rows (RT m16
// row tiles as the mma A operand, NT n8 column tiles as B), so the CTA covers 16 RT WV rows
// and 8 NT WM >= M x rows, with RT x NT x 4 fp32 accumulators per lane for the whole K. The K
// loop runs in stages of BK k through a STAGES-deep cp.async pipeline: per stage the CTA copies
// its rows' BK weight bytes (whole 128-byte lines at BK = 128) and the x rows' BK bf16 into
// shared memory (16-byte pieces; k past H and x rows past M zero-filled), then each warp reads
// its fragments from there, converts the e4m3 bytes to bf16 in registers and runs
// mma.sync.m16n8k16 (bf16 in, fp32 accumulate). The scale multiplies the sum in the epilogue.
//
// Fragments. A dot product may visit k in any order, so within each k16 step s of a stage, lane
// (g, t) = (lane / 4, lane % 4) takes the 4 physical k = 16 s + 4 t + {0, 1, 2, 3}: one 32-bit
// load of 4 e4m3 bytes per A row (g and g + 8) and one 64-bit load of 4 bf16 per x row (g of the
// column tile). Bytes (b0, b2) become the bf16 pair of logical k (2t, 2t+1), (b1, b3) that of
// (2t+8, 2t+9), and the x pair is permuted the same way (prmt). Shared-memory rows are padded
// (weights BK + 16 bytes, x 2 BK + 32 bytes) so that both loads are free of bank conflicts.
//
// e4m3 -> bf16 is exact (every e4m3 value is a bf16 value): the sign goes to bit 15 and the 7
// exponent/mantissa bits to bits 4..10, which is the bf16 of 2^-120 times the value (subnormal
// e4m3 codes land on bf16 subnormals with the same factor); one bf16x2 multiply by 2^120 (exact,
// subnormal inputs supported) gives the value. (The NaN codes 0x7F / 0xFF would read as +-480;
// fp8_quantize_rows produces them only from NaN weights.)
//
// Shapes by M (the smallest that holds it; each within its register bound without spills):
//   M <= 8    RT 1 NT 1, 8 x 1 warps: 128 rows x 8,    BK 128, 3 stages, 3 CTAs / SM
//   M <= 16   RT 1 NT 2, 8 x 1 warps: 128 rows x 16,   BK 128, 3 stages
//   M <= 32   RT 1 NT 4, 8 x 1 warps: 128 rows x 32,   BK 128, 3 stages
//   M <= 64   RT 2 NT 4, 4 x 2 warps: 128 rows x 64,   BK 128, 3 stages
//   M <= 128  RT 2 NT 4, 4 x 4 warps: 128 rows x 128,  BK 128, 3 stages
//   M <= 256  RT 2 NT 8, 4 x 4 warps: 128 rows x 256,  BK 64,  3 stages
//   M <= 512  RT 2 NT 8, 2 x 8 warps: 64 rows x 512,   BK 64,  2 stages
// Cost: at small M the weight stream is everything (V = 151936, H = 4096: 622 MB, about 0.15 ms at
// the H200's ~4.2 TB/s of achievable HBM bandwidth; the bf16 head is 1.24 GB); at large M the mma
// and the x traffic (each CTA reads all of x from L2: V / rows x M x H x 2 bytes) dominate.
//
// Deterministic: every output is one warp's fixed-order sum. Launched with programmatic
// dependent launch (detail::launch): before waiting for the kernel ahead, each CTA only asks L2
// to prefetch its first weight stages (a hint, safe even if that kernel wrote them).
#include <cuda_bf16.h>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

namespace {

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Four e4m3 bytes (b0 .. b3 from the low byte) -> bf16 pairs lo = (b0, b2), hi = (b1, b3), exact.
__device__ __forceinline__ void e4m3x4_to_bf16(uint32_t w, uint32_t& lo, uint32_t& hi) {
  constexpr uint32_t kTwoPow120 = 0x7B807B80u;  // bf16x2 (2^120, 2^120)
  const uint32_t s = w << 8;
  hi = bf16x2_mul((w & 0x80008000u) | ((w & 0x7F007F00u) >> 4), kTwoPow120);
  lo = bf16x2_mul((s & 0x80008000u) | ((s & 0x7F007F00u) >> 4), kTwoPow120);
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// c[16 x 8] += a[16 x 16] (row) * b[16 x 8] (col), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int RT, int NT, int WV, int WM, int BK, int STAGES>
struct Shape {
  static constexpr int kThreads = 32 * WV * WM;
  static constexpr int kRows = 16 * RT * WV;      // vocabulary rows of a CTA
  static constexpr int kCols = 8 * NT * WM;       // x rows a CTA holds (>= M)
  static constexpr int kWStride = BK + 16;        // bytes per staged weight row
  static constexpr int kXStride = 2 * BK + 32;    // bytes per staged x row
  static constexpr int kStageBytes = kRows * kWStride + kCols * kXStride;
  static constexpr size_t kSmem = static_cast<size_t>(STAGES) * kStageBytes;
  static_assert(BK == 64 || BK == 128, "the padded strides are conflict-free for BK 64 and 128");
};

// x [M, H] bf16, q [V, H] e4m3, scale [V], out [M, V] fp32. Grid: ceil(V / kRows) CTAs.
template <int RT, int NT, int WV, int WM, int BK, int STAGES, int MIN_CTAS>
__global__ void __launch_bounds__(32 * WV * WM, MIN_CTAS)
    fp8_gemv_kernel(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ q,
                    const float* __restrict__ scale, int M, int V, int H, float* __restrict__ out) {
  using S = Shape<RT, NT, WV, WM, BK, STAGES>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wv = warp % WV, wm = warp / WV;
  const int row0 = blockIdx.x * S::kRows;
  const int num_stages = (H + BK - 1) / BK;
  const int m_pad = (M + 7) & ~7;  // x rows staged (the rest of kCols is never read)

  // Before waiting for the kernel ahead: L2 prefetch of this CTA's first weight stages.
  if (tid < S::kRows && row0 + tid < V) {
    const int bytes = min(H, (STAGES - 1) * BK);
    const uint8_t* p = q + static_cast<int64_t>(row0 + tid) * H;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
  }
  detail::pdl_begin();

  auto load_stage = [&](int stage, int slot) {
    uint8_t* ws = smem + slot * S::kStageBytes;
    uint8_t* xs = ws + S::kRows * S::kWStride;
    const int k0 = stage * BK;
    constexpr int kWPieces = BK / 16, kXPieces = BK / 8;
    for (int i = tid; i < S::kRows * kWPieces; i += S::kThreads) {
      const int r = i / kWPieces, k = k0 + (i % kWPieces) * 16;
      const int row = min(row0 + r, V - 1);  // rows past V: a valid row, never stored
      const bool ok = k < H;
      cp_async16(ws + r * S::kWStride + (i % kWPieces) * 16, q + static_cast<int64_t>(row) * H + (ok ? k : 0),
                 ok ? 16 : 0);
    }
    for (int i = tid; i < m_pad * kXPieces; i += S::kThreads) {
      const int m = i / kXPieces, k = k0 + (i % kXPieces) * 8;
      const bool ok = m < M && k < H;
      cp_async16(xs + m * S::kXStride + (i % kXPieces) * 16, x + (ok ? static_cast<int64_t>(m) * H + k : 0),
                 ok ? 16 : 0);
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_stages) load_stage(s, s);
    cp_async_commit();
  }

  float acc[RT][NT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[rt][j][e] = 0.0f;

  // Column tiles of this warp that hold x rows (warp-uniform).
  const int active_tiles = min(NT, max(0, (M - 8 * NT * wm + 7) / 8));

  for (int stage = 0; stage < num_stages; ++stage) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // the stage is visible to all; every warp is done with the slot refilled next
    const int next = stage + STAGES - 1;
    if (next < num_stages) load_stage(next, next % STAGES);
    cp_async_commit();
    if (active_tiles == 0) continue;
    const uint8_t* ws = smem + (stage % STAGES) * S::kStageBytes;
    const uint8_t* xs = ws + S::kRows * S::kWStride;
#pragma unroll
    for (int s = 0; s < BK / 16; ++s) {
      uint32_t a[RT][4];
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        const uint8_t* wr = ws + ((wv * RT + rt) * 16 + g) * S::kWStride + 16 * s + 4 * t;
        e4m3x4_to_bf16(*reinterpret_cast<const uint32_t*>(wr), a[rt][0], a[rt][2]);
        e4m3x4_to_bf16(*reinterpret_cast<const uint32_t*>(wr + 8 * S::kWStride), a[rt][1], a[rt][3]);
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (j >= active_tiles) break;
        const uint2 v =
            *reinterpret_cast<const uint2*>(xs + ((wm * NT + j) * 8 + g) * S::kXStride + 32 * s + 8 * t);
        const uint32_t b0 = prmt(v.x, v.y, 0x5410u);  // (x0, x2): logical k 2t, 2t + 1
        const uint32_t b1 = prmt(v.x, v.y, 0x7632u);  // (x1, x3): logical k 2t + 8, 2t + 9
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) mma_bf16(acc[rt][j], a[rt], b0, b1);
      }
    }
  }

  // Accumulator fragment: c0, c1 = (vocabulary row g, x rows 2t, 2t + 1), c2, c3 = row g + 8.
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int v = row0 + (wv * RT + rt) * 16 + g + 8 * h;
      if (v >= V) continue;
      const float sc = scale[v];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int m = (wm * NT + j) * 8 + 2 * t;
        if (m < M) out[static_cast<int64_t>(m) * V + v] = acc[rt][j][2 * h] * sc;
        if (m + 1 < M) out[static_cast<int64_t>(m + 1) * V + v] = acc[rt][j][2 * h + 1] * sc;
      }
    }
  }
}

template <int RT, int NT, int WV, int WM, int BK, int STAGES, int MIN_CTAS>
cudaError_t launch_shape(const __nv_bfloat16* x, const uint8_t* q, const float* scale, int m, int v, int h,
                         float* out, cudaStream_t stream) {
  using S = Shape<RT, NT, WV, WM, BK, STAGES>;
  auto kernel = fp8_gemv_kernel<RT, NT, WV, WM, BK, STAGES, MIN_CTAS>;
  if (S::kSmem > 48 * 1024) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(S::kSmem));
    if (e != cudaSuccess) return e;
  }
  const unsigned blocks = static_cast<unsigned>((static_cast<int64_t>(v) + S::kRows - 1) / S::kRows);
  const cudaError_t e = detail::launch(kernel, blocks, S::kThreads, S::kSmem, stream, x, q, scale, m, v, h, out);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace

bool linear_fp8_supports(const void* x, const void* q, int64_t m, int64_t hidden) {
  return x != nullptr && q != nullptr && m >= 1 && m <= kFp8GemvMaxRows && hidden >= 16 && hidden % 16 == 0 &&
         hidden <= (int64_t{1} << 30) && detail::aligned16(x) && detail::aligned16(q);
}

cudaError_t linear_fp8(const __nv_bfloat16* x, const uint8_t* q, const float* scale, int64_t m, int64_t vocab,
                       int64_t hidden, float* out, cudaStream_t stream) {
  if (m == 0 || vocab == 0) return cudaSuccess;
  if (!linear_fp8_supports(x, q, m, hidden) || scale == nullptr || out == nullptr || vocab < 0 ||
      vocab > (int64_t{1} << 30) || (reinterpret_cast<uintptr_t>(scale) & 3) || (reinterpret_cast<uintptr_t>(out) & 3)) {
    return cudaErrorInvalidValue;
  }
  const int mi = static_cast<int>(m), v = static_cast<int>(vocab), h = static_cast<int>(hidden);
  if (m <= 8) return launch_shape<1, 1, 8, 1, 128, 3, 3>(x, q, scale, mi, v, h, out, stream);
  if (m <= 16) return launch_shape<1, 2, 8, 1, 128, 3, 2>(x, q, scale, mi, v, h, out, stream);
  if (m <= 32) return launch_shape<1, 4, 8, 1, 128, 3, 2>(x, q, scale, mi, v, h, out, stream);
  if (m <= 64) return launch_shape<2, 4, 4, 2, 128, 3, 2>(x, q, scale, mi, v, h, out, stream);
  if (m <= 128) return launch_shape<2, 4, 4, 4, 128, 3, 1>(x, q, scale, mi, v, h, out, stream);
  if (m <= 256) return launch_shape<2, 8, 4, 4, 64, 3, 1>(x, q, scale, mi, v, h, out, stream);
  return launch_shape<2, 8, 2, 8, 64, 2, 1>(x, q, scale, mi, v, h, out, stream);
}

}  // namespace cuda
}  // namespace dflash
