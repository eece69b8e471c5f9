// Skinny GEMM for small-batch decode and speculative verify: out[M, N] = x[M, K] @ w[N, K]^T,
// bf16 x and w, fp32 accumulation, bf16 or fp32 out, 1 <= M <= 32. The weight stream is the
// whole cost, so the kernel is shaped to read w at HBM speed; the FLOPs run on tensor cores
// (mma.sync m16n8k16), where they are free, so one kernel serves every M up to 32.
//
// Tiling. A CTA owns 16 R rows of w (R row tiles of 16) and all of K; its W warps split K
// (chunks of 32 k, U consecutive chunks per warp per step, W U chunks per CTA per step).
// A warp computes out^T[16 R rows, 8 NT] = w_tile · x^T with w as the mma A operand (m16) and
// x^T as the B operand (n8; NT = 1, 2 or 4 column tiles: M <= 8, 16, 32). Lane (g, t) = (lane / 4,
// lane % 4) loads 16 bytes (8 k) of w rows g and g + 8 and of x row g, k = chunk * 32 + t * 8,
// with one 128-bit load each: a dot product may visit k in any order, so the 8 k of a load are
// given to the mma fragments as logical k {2t, 2t+1, 2t+8, 2t+9} of two k16 steps. The w loads
// bypass L1 (x, read by every CTA, stays there). All loads of a step are issued before its
// mmas: 2 R U loads of 16 bytes of w per thread in flight (U = 8, R = 1: 256 bytes, 8 KB a warp).
//
// Launch: ceil(N / 16 R) CTAs. Defaults: R = 1; U = 8 (M <= 8), 4 (M <= 16), 2 (M <= 32);
// W = 8, or 16 when there are no more CTAs than SMs (small N: a deeper split of K). Every built
// shape fits 128 registers without spills, so two 8-warp CTAs share an SM; with 128 KB of w in
// flight per SM at U = 8 (33 KB would sustain 4.4 TB/s at 1 us latency), HBM latency is covered.
//
// Reduction: each warp's accumulators go to shared memory and are summed over the warps in a
// fixed order, so results are deterministic (the same bits on every run). Tails: rows past N
// read row N - 1 and are not written; x rows past M read row M - 1 (their columns are dropped);
// the k tail (K % 32) is zero-filled by predicated loads in the last step only.
//
// Batch-invariant shape (SkinnyGemmConfig / SkinnyFusion batch_invariant): NT 2, R 1, U 4 for
// every M <= 16, so the chunks of K a warp visits, the accumulator sets and the warp sum are the
// same for every M: an output depends on its x row and w row only, whatever the other rows.
// Every M runs in one launch of the sliced instantiation, in slices of 16 rows: CTA b owns slice
// b % slices of w tile b / slices and computes exactly what a launch of that slice alone would
// (same code, same warps: chosen by the number of w tiles), so a row's bits are those of its
// slice whatever M. The slices of a w tile run side by side, so the tile comes from HBM once and
// from L2 for the other slices (one launch instead of one per 16 rows, each streaming all of w).
// Past one slice a CTA computes G slices of its w tile (G = 2, or 4 with 8 warps; plain x only):
// each w load of a step feeds the mmas of all G slices, one accumulator set per slice, so L2
// serves the tile ceil(slices / G) times instead of once per slice (at 256 rows, the verify step
// of 16 sequences, 16 reads of every weight from L2 were the step's whole cost). A slice's mmas,
// accumulator sets and warp sum are those of its launch alone, in the same order (the other
// slices' mmas only interleave with them), so its bits do not depend on G; a CTA whose group runs
// past the last slice computes that slice again and does not write it.
//
// Fused variants (skinny_gemm_fused, M <= 16): the CTA first builds x in shared memory from the
// layer's input (RMSNorm of the residual stream, or silu(gate) * up), with the formulas of the
// rms_norm and silu_mul kernels, then runs the same main loop on it; the add epilogue
// accumulates into a bf16 residual stream. This removes the norm / activation / add launches of
// a decoder layer (a small model's decode step is launch-bound).
//
// Programmatic dependent launch: each CTA asks L2 to prefetch its weight rows (they depend on no
// kernel) before it waits for the kernel ahead in the stream (detail::pdl_begin), so with
// DFLASH_PDL on the weight stream starts while that kernel is still finishing.
#include <algorithm>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/skinny_common.cuh"

namespace dflash {
namespace cuda {

namespace {

using namespace skinny;

// x [M, K], w [N, K], out [M, N] (bf16, or fp32 when F32). Block: W warps (blockDim.x = 32 W);
// grid.x = ceil(N / (16 R)); dynamic shared memory W * red_bytes(NT, R).
// IN: SkinnyInput (kPlain: x from global memory; else staged in shared memory from `x`, the
// fused input, after the reduction buffer); ADD: out (bf16) += the product.
// SLICED (the batch-invariant launches, every M): slice_rows rows of x per slice, G slices per CTA;
// with groups = ceil(slices / G), CTA b computes w tile b / groups for the slices
// s = (b % groups) G + i, i < G (past the last slice: the last one again, not written), x rows
// [s slice_rows, min((s + 1) slice_rows, M)) each. The other instantiations ignore slice_rows
// (one slice; their code and registers as before). G > 1: plain x only, 8 warps at most with G 4.
template <int NT, int R, int U, bool F32, int IN = 0, bool ADD = false, bool SLICED = false, int G = 1>
__global__ void __launch_bounds__(G >= 4 ? 256 : 512) skinny_gemm_kernel(const __nv_bfloat16* __restrict__ x,
                                                          const __nv_bfloat16* __restrict__ w, int M, int N, int K,
                                                          void* __restrict__ out,
                                                          const __nv_bfloat16* __restrict__ gamma = nullptr,
                                                          float eps = 0.0f, int slice_rows = 0) {
  static_assert(G == 1 || (SLICED && IN == 0), "several slices per CTA: batch-invariant launches of plain x only");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  int tile = blockIdx.x;
  // This CTA's slices as launches of their own: row offset and rows of slice i; `valid` of them
  // are written (the rest repeat the last slice).
  int m0s[G], ms[G], valid = 1;
  if constexpr (SLICED && G == 1) {  // this CTA's slice of x and out, as a launch of its own
    const int slices = (M + slice_rows - 1) / slice_rows, slice = blockIdx.x % slices, m0 = slice * slice_rows;
    tile = blockIdx.x / slices;
    x += static_cast<int64_t>(m0) * (IN == static_cast<int>(SkinnyInput::kSiluMul) ? 2 * K : K);
    out = static_cast<char*>(out) + static_cast<int64_t>(m0) * N * (F32 ? 4 : 2);
    M = min(slice_rows, M - m0);
  } else if constexpr (SLICED) {
    const int slices = (M + slice_rows - 1) / slice_rows, groups = (slices + G - 1) / G;
    const int first = (static_cast<int>(blockIdx.x) % groups) * G;
    tile = blockIdx.x / groups;
    valid = min(G, slices - first);
#pragma unroll
    for (int i = 0; i < G; ++i) {
      m0s[i] = min(first + i, slices - 1) * slice_rows;
      ms[i] = min(slice_rows, M - m0s[i]);
    }
  }
  // Slice i's first row and rows (G 1: x and out start at the CTA's only slice, of M rows).
  auto first_row = [&](int i) { return G == 1 ? 0 : m0s[i]; };
  auto rows_of = [&](int i) { return G == 1 ? M : ms[i]; };
  const int row0 = tile * (16 * R);
  // Before waiting for the kernel ahead (programmatic dependent launch): this CTA's weight rows,
  // which no kernel writes, start streaming into L2 while that kernel finishes.
  if (warp == 0) {
    constexpr int64_t kPiece = 32 * 1024;
    const int64_t bytes = static_cast<int64_t>(min(16 * R, N - row0)) * K * 2;
    const char* base = reinterpret_cast<const char*>(w + static_cast<int64_t>(row0) * K);
    const int64_t at = lane * kPiece;
    if (at < bytes) {
      const uint32_t size = static_cast<uint32_t>(min(kPiece, bytes - at));
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + at), "r"(size) : "memory");
    }
  }
  detail::pdl_begin();
  constexpr bool kStaged = IN != 0;
  extern __shared__ float red[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(red + num_warps * G * (8 * NT) * red_stride(R));
  if constexpr (kStaged) stage_input<IN>(x, gamma, eps, M, K, xs);
  const int x_stride = kStaged ? staged_stride(K) : K;
  auto load_in = [&](const __nv_bfloat16* p) -> uint4 {
    if constexpr (kStaged) {
      return *reinterpret_cast<const uint4*>(p);
    } else {
      return load_x(p);
    }
  };

  const __nv_bfloat16* wp[R][2];
#pragma unroll
  for (int rt = 0; rt < R; ++rt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = min(row0 + rt * 16 + h * 8 + g, N - 1);
      wp[rt][h] = w + static_cast<int64_t>(r) * K + t * 8;
    }
  }
  const __nv_bfloat16* xp[G][NT];
#pragma unroll
  for (int i = 0; i < G; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      xp[i][j] = (kStaged ? xs : x) + static_cast<int64_t>(first_row(i) + min(8 * j + g, rows_of(i) - 1)) * x_stride +
                 t * 8;
    }

  // A independent accumulator sets (chunk u feeds set u % A) keep the chain of dependent mmas
  // of a step short; they are added in a fixed order at the end.
  // With G slices, one such accumulator per slice.
  constexpr int A = (R * NT >= 4 || U < 2) ? 1 : (U >= 8 ? 2 : 4 / (R * NT));
  float acc[G][A][R][NT][4];
#pragma unroll
  for (int i = 0; i < G; ++i)
#pragma unroll
    for (int q = 0; q < A; ++q)
#pragma unroll
      for (int rt = 0; rt < R; ++rt)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][q][rt][j][e] = 0.0f;

  const int num_chunks = (K + kChunk - 1) / kChunk, full_chunks = K / kChunk;
  for (int c0 = warp * U; c0 < num_chunks; c0 += num_warps * U) {
    const bool full = c0 + U <= full_chunks;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4 a[U][R][2], b[U][NT];
    // x pieces of slice i for this step (the k tail: pieces at k >= K read as zeros, both
    // operands: no 0 * NaN).
    auto load_b = [&](int i) {
      if (full) {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int j = 0; j < NT; ++j) b[u][j] = load_in(xp[i][j] + (c0 + u) * kChunk);
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const bool ok = (c0 + u) * kChunk + t * 8 < K;
#pragma unroll
          for (int j = 0; j < NT; ++j) b[u][j] = ok ? load_in(xp[i][j] + (c0 + u) * kChunk) : zero;
        }
      }
    };
    if (full) {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int rt = 0; rt < R; ++rt)
#pragma unroll
          for (int h = 0; h < 2; ++h) a[u][rt][h] = load_w(wp[rt][h] + (c0 + u) * kChunk);
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const bool ok = (c0 + u) * kChunk + t * 8 < K;
#pragma unroll
        for (int rt = 0; rt < R; ++rt)
#pragma unroll
          for (int h = 0; h < 2; ++h) a[u][rt][h] = ok ? load_w(wp[rt][h] + (c0 + u) * kChunk) : zero;
      }
    }
    // The step's w pieces feed the mmas of every slice of the CTA, one slice after the other.
#pragma unroll
    for (int i = 0; i < G; ++i) {
      load_b(i);
      // Words 2s, 2s + 1 of a load (k + 4s + {0, 1} and k + 4s + {2, 3}) are logical k {2t, 2t+1}
      // and {2t+8, 2t+9} of k16 step s, for the A rows g (h = 0), g + 8 (h = 1) and the B column g.
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int s = 0; s < 2; ++s)
#pragma unroll
          for (int rt = 0; rt < R; ++rt)
#pragma unroll
            for (int j = 0; j < NT; ++j)
              mma_bf16(acc[i][u % A][rt][j], word(a[u][rt][0], 2 * s), word(a[u][rt][1], 2 * s),
                       word(a[u][rt][0], 2 * s + 1), word(a[u][rt][1], 2 * s + 1), word(b[u][j], 2 * s),
                       word(b[u][j], 2 * s + 1));
    }
  }

  // Accumulator fragment: c0, c1 = (row g, columns 2t, 2t+1), c2, c3 = (row g + 8, same columns),
  // row = w row in the tile, column = x row in the column tile. Buffer [W][G][8 NT][S].
  constexpr int S = red_stride(R), MP = 8 * NT, RT = 16 * R;
#pragma unroll
  for (int i = 0; i < G; ++i) {
    float* mine = red + (warp * G + i) * MP * S;
#pragma unroll
    for (int rt = 0; rt < R; ++rt) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        float c[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          c[e] = acc[i][0][rt][j][e];
#pragma unroll
          for (int q = 1; q < A; ++q) c[e] += acc[i][q][rt][j][e];
        }
        const int m = 8 * j + 2 * t, n = rt * 16 + g;
        mine[m * S + n] = c[0];
        mine[(m + 1) * S + n] = c[1];
        mine[m * S + n + 8] = c[2];
        mine[(m + 1) * S + n + 8] = c[3];
      }
    }
  }
  __syncthreads();
  const int rows = min(RT, N - row0);
#pragma unroll
  for (int i = 0; i < G; ++i) {
    if (i >= valid) break;
    for (int r = threadIdx.x; r < rows_of(i) * RT; r += blockDim.x) {
      const int m = r / RT, n = r % RT;
      if (n >= rows) continue;
      float sum = 0.0f;
      for (int v = 0; v < num_warps; ++v) sum += red[((v * G + i) * MP + m) * S + n];
      store_out<F32, ADD>(out, static_cast<int64_t>(first_row(i) + m) * N + row0 + n, sum);
    }
  }
}

// The kernel for (NT, R, U) with the output type chosen at run time; null when not built.
using KernelFn = void (*)(const __nv_bfloat16*, const __nv_bfloat16*, int, int, int, void*, const __nv_bfloat16*,
                          float, int);

template <int NT, int R, int U>
KernelFn pick_out(bool out_f32) {
  return out_f32 ? skinny_gemm_kernel<NT, R, U, true> : skinny_gemm_kernel<NT, R, U, false>;
}

// The batch-invariant kernel (NT 2, R 1, U 4, sliced), for every M, with G slices per CTA.
template <int G>
KernelFn invariant_out(bool out_f32) {
  return out_f32 ? skinny_gemm_kernel<2, 1, 4, true, 0, false, true, G>
                 : skinny_gemm_kernel<2, 1, 4, false, 0, false, true, G>;
}
KernelFn invariant_kernel(bool out_f32, int slices_per_cta) {
  return slices_per_cta == 4 ? invariant_out<4>(out_f32)
         : slices_per_cta == 2 ? invariant_out<2>(out_f32)
                               : invariant_out<1>(out_f32);
}

// The built (R, U) shapes per NT (each within 128 registers without spills, so that two CTAs of
// 8 warps fit on an SM), the first one being the default.
template <int NT>
KernelFn pick_shape(int row_tiles, int unroll, bool out_f32) {
  if constexpr (NT == 1) {
    if (row_tiles == 1 && unroll == 8) return pick_out<1, 1, 8>(out_f32);
    if (row_tiles == 1 && unroll == 4) return pick_out<1, 1, 4>(out_f32);
    if (row_tiles == 2 && unroll == 4) return pick_out<1, 2, 4>(out_f32);
  } else if constexpr (NT == 2) {
    if (row_tiles == 1 && unroll == 4) return pick_out<2, 1, 4>(out_f32);
    if (row_tiles == 2 && unroll == 2) return pick_out<2, 2, 2>(out_f32);
  } else {
    if (row_tiles == 1 && unroll == 2) return pick_out<4, 1, 2>(out_f32);
    if (row_tiles == 2 && unroll == 2) return pick_out<4, 2, 2>(out_f32);
  }
  return nullptr;
}

// The fused kernels: the default shapes of M <= 8 (NT 1, R 1, U 8) and M <= 16 (NT 2, R 1, U 4),
// and the batch-invariant one (NT 2, U 4, sliced).
using FusedFn = KernelFn;

template <int NT, int U, bool SLICED = false>
FusedFn pick_fused(SkinnyInput input, bool add, int slices_per_cta = 1) {
  if (input == SkinnyInput::kRmsNorm && !add) return skinny_gemm_kernel<NT, 1, U, false, 1, false, SLICED>;
  if (input == SkinnyInput::kPlain && add) {
    if constexpr (SLICED) {  // the only fused form with several slices per CTA (x is not staged)
      if (slices_per_cta == 4) return skinny_gemm_kernel<NT, 1, U, false, 0, true, true, 4>;
      if (slices_per_cta == 2) return skinny_gemm_kernel<NT, 1, U, false, 0, true, true, 2>;
    }
    return skinny_gemm_kernel<NT, 1, U, false, 0, true, SLICED>;
  }
  if (input == SkinnyInput::kSiluMul && add) return skinny_gemm_kernel<NT, 1, U, false, 2, true, SLICED>;
  if (input == SkinnyInput::kSiluMul && !add) return skinny_gemm_kernel<NT, 1, U, false, 2, false, SLICED>;
  return nullptr;
}

// Warps per CTA over `tiles` w tiles: all CTAs resident at once where possible, two CTAs of 8
// warps per SM, or one of 16 warps (a deeper split of K) when there are no more tiles than SMs.
int warps_for_tiles(int64_t tiles) {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return tiles <= sms ? 16 : 8;
}

// Slices of a batch-invariant launch per CTA (the kernel's G): 1 for one slice or a staged input;
// else 4 when at least 3 slices share a w tile and the CTA has at most 8 warps (G 4 needs up to
// 255 registers a thread), 2 otherwise. A row's bits do not depend on it (the kernel's top).
int slices_per_cta(int64_t m, bool batch_invariant, int warps, SkinnyInput input) {
  const int64_t slices = batch_invariant ? (m + kBatchInvariantRows - 1) / kBatchInvariantRows : 1;
  if (slices <= 1 || input != SkinnyInput::kPlain) return 1;
  return slices >= 3 && warps <= 8 ? 4 : 2;
}

// Shared memory of a fused launch: the reduction buffers (one per slice of the CTA), then x
// staged (when the input is).
size_t fused_smem_bytes(int warps, int nt, int64_t m, int64_t k, SkinnyInput input, int slices = 1) {
  const size_t staged = input == SkinnyInput::kPlain ? 0 : static_cast<size_t>(m) * staged_stride(static_cast<int>(k)) * 2;
  return warps * slices * red_bytes(nt, 1) + staged;
}

constexpr size_t kFusedMaxSmem = 112 * 1024;  // two CTAs per SM still fit (227 KB)

// Rows of x per CTA: all of them, or a batch-invariant slice (any M, in slices of 16).
int64_t rows_per_cta(int64_t m, bool batch_invariant) {
  return batch_invariant ? std::min(m, kBatchInvariantRows) : m;
}

// CTAs of a launch over `tiles` w tiles: one per tile, times the groups of `per_cta` slices of a
// batch-invariant M.
int64_t num_blocks(int64_t tiles, int64_t m, bool batch_invariant, int per_cta) {
  const int64_t slices = (m + rows_per_cta(m, batch_invariant) - 1) / rows_per_cta(m, batch_invariant);
  return tiles * ((slices + per_cta - 1) / per_cta);
}

}  // namespace

bool skinny_gemm_fused_supports(const void* in, const void* w, int64_t m, int64_t k, const SkinnyFusion& f) {
  if (in == nullptr || w == nullptr || m < 1 || (m > kSkinnyFusedMaxRows && !f.batch_invariant) ||
      m > (int64_t{1} << 30) || k <= 0 || k % 8 != 0 || k > (int64_t{1} << 24) || !detail::aligned16(in) ||
      !detail::aligned16(w)) {
    return false;
  }
  if (f.input == SkinnyInput::kRmsNorm && (f.gamma == nullptr || !detail::aligned16(f.gamma))) return false;
  if (f.input == SkinnyInput::kPlain && !f.add) return false;  // that is skinny_gemm
  const int nt = (m <= 8 && !f.batch_invariant) ? 1 : 2;
  return fused_smem_bytes(16, nt, rows_per_cta(m, f.batch_invariant), k, f.input) <= kFusedMaxSmem;
}

cudaError_t skinny_gemm_fused(const __nv_bfloat16* in, const __nv_bfloat16* w, int64_t m, int64_t n, int64_t k,
                              const SkinnyFusion& f, __nv_bfloat16* out, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  if (!skinny_gemm_fused_supports(in, w, m, k, f) || n < 0 || n > (int64_t{1} << 30) || out == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int nt = (m <= 8 && !f.batch_invariant) ? 1 : 2;
  const int64_t tiles = (n + 15) / 16, rows = rows_per_cta(m, f.batch_invariant);
  const int warps = warps_for_tiles(tiles);  // by the w tiles only: a slice computes as a launch of its own
  const int per_cta = slices_per_cta(m, f.batch_invariant, warps, f.input);
  FusedFn kernel = f.batch_invariant ? pick_fused<2, 4, true>(f.input, f.add, per_cta)
                   : nt == 1          ? pick_fused<1, 8>(f.input, f.add)
                                      : pick_fused<2, 4>(f.input, f.add);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const int64_t blocks = num_blocks(tiles, m, f.batch_invariant, per_cta);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  const size_t smem = fused_smem_bytes(warps, nt, rows, k, f.input, per_cta);
  if (smem + kStaticSmemMargin > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  detail::launch(kernel, static_cast<unsigned>(blocks), warps * 32, smem, stream, in, w, static_cast<int>(m),
                 static_cast<int>(n), static_cast<int>(k), static_cast<void*>(out), f.gamma, f.eps,
                 static_cast<int>(rows));
  return cudaGetLastError();
}

int batch_invariant_warps(int64_t n) { return warps_for_tiles((n + 15) / 16); }

bool skinny_gemm_supports(const void* x, const void* w, int64_t m, int64_t k) {
  return x != nullptr && w != nullptr && m >= 1 && m <= kSkinnyGemmMaxRows && k > 0 && k % 8 == 0 &&
         k <= (int64_t{1} << 30) && detail::aligned16(x) && detail::aligned16(w);
}

cudaError_t skinny_gemm(const __nv_bfloat16* x, const __nv_bfloat16* w, int64_t m, int64_t n, int64_t k,
                        bool out_f32, void* out, cudaStream_t stream, const SkinnyGemmConfig* config) {
  if (m == 0 || n == 0) return cudaSuccess;
  const bool invariant = config != nullptr && config->batch_invariant;
  // Batch-invariant launches take any M (in slices of kBatchInvariantRows rows).
  if (!skinny_gemm_supports(x, w, invariant ? std::min(m, kBatchInvariantRows) : m, k) || m > (int64_t{1} << 30) ||
      n < 0 || n > (int64_t{1} << 30) || out == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int nt = invariant ? 2 : m <= 8 ? 1 : m <= 16 ? 2 : 4;
  int row_tiles = 1, unroll = nt == 1 ? 8 : nt == 2 ? 4 : 2, warps = 0;
  if (config != nullptr) {
    if (config->row_tiles && !invariant) row_tiles = config->row_tiles;
    if (config->unroll && !invariant) unroll = config->unroll;
    warps = config->warps;
  }
  if (warps < 0 || warps > 16) return cudaErrorInvalidValue;
  const int64_t tiles = (n + 16 * row_tiles - 1) / (16 * row_tiles);
  // By the w tiles only: a batch-invariant slice computes as a launch of its own would.
  if (warps == 0) warps = warps_for_tiles(tiles);
  const int per_cta = slices_per_cta(m, invariant, warps, SkinnyInput::kPlain);
  KernelFn kernel = invariant ? invariant_kernel(out_f32, per_cta)
                    : nt == 1 ? pick_shape<1>(row_tiles, unroll, out_f32)
                    : nt == 2 ? pick_shape<2>(row_tiles, unroll, out_f32)
                              : pick_shape<4>(row_tiles, unroll, out_f32);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const int64_t blocks = num_blocks(tiles, m, invariant, per_cta);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  const size_t smem = warps * per_cta * red_bytes(nt, row_tiles);
  if (smem + kStaticSmemMargin > 48 * 1024) {  // only the largest tuning shapes (16 warps, M > 16, 2 row tiles)
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  detail::launch(kernel, static_cast<unsigned>(blocks), warps * 32, smem, stream, x, w, static_cast<int>(m),
                 static_cast<int>(n), static_cast<int>(k), out, static_cast<const __nv_bfloat16*>(nullptr), 0.0f,
                 static_cast<int>(rows_per_cta(m, invariant)));
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
