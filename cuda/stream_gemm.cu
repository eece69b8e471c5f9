// Streaming skinny GEMM for decode and verify rows (M <= 16): out[M, N] = x[M, K] @ w[N, K]^T with
// the fused inputs and epilogue of the skinny kernel (SkinnyFusion: RMSNorm or silu * up staged in
// shared memory, residual add), built to keep HBM busy from the first byte to the last.
//
// Why another kernel. The skinny kernel (skinny_gemm.cu) gives each CTA one tile of 16 w rows:
// with K = 4096 and 8 warps a warp loads two rounds and then the CTA reduces, writes and exits, so
// a good part of each CTA's life has no load in flight (gate/up at 86 % of the copy bandwidth,
// bench/results/gpu_h200_skinny_gemm.json), and every CTA of a fused launch stages x again.
//
// Design. Persistent CTAs (grid = resident CTAs, at most one per tile) walk tiles blockIdx.x,
// blockIdx.x + gridDim.x, ... Within a tile the W warps split K as before (chunks of 32 k, U per
// round, warp w takes rounds of chunks (r W + w) U ...), so every warp has `rounds` rounds per tile
// and the same number of jobs (tile, round) as its CTA's other warps. Each warp streams its jobs
// through a private ring of S stages in shared memory with cp.async (16 bytes a lane, L1 bypassed):
// a lane copies exactly the pieces it later reads (w rows g and g + 8, k piece t of each chunk),
// so a stage needs no barrier, only cp.async.wait_group. S - 1 jobs are in flight while one is
// multiplied (mma.sync m16n8k16 as in the skinny kernel), across tile boundaries too; the tile's
// cross-warp sum goes through a double-buffered reduction buffer with one __syncthreads per tile
// while the next tile's copies are already on their way. The first S - 1 jobs are issued before
// the programmatic-launch wait (weights depend on no kernel), so the stream starts under the tail
// of the kernel ahead; x (or its fused transform) is read after the wait, once per CTA.
//
// Rounds past K (K not a multiple of W U 32) are zero-filled by cp.async with a source size of 0
// and zero x pieces (no 0 * NaN). Rows past N read row N - 1 and are not written.
//
// Determinism: each output is summed in a fixed order (chunks in a warp's order into A accumulator
// sets, the sets in order, the warps in order), so reruns give the same bits. The order depends on
// M through NT (column tiles: 1 for M <= 8, 2 for M <= 16) and W only; with batch_invariant NT is 2
// for every M and W a function of K, so a row's bits do not depend on the other rows. Launched with
// the W of the skinny kernel's batch-invariant shape (batch_invariant_warps(N)), an output also has
// that kernel's bits: its U (4) chunks per round and warp, chunk u into set u % A (A 2), the same
// mma per chunk (lane (g, t): w rows g, g + 8 and x row g, k = chunk * 32 + t * 8, zeros past K),
// the sets added in order, then the warps from 0 up into a sum starting at 0, the same epilogue.
// So the deterministic mode runs up to 16 rows here and more in the skinny kernel's slices.
#include <mutex>

#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/skinny_common.cuh"

namespace dflash {
namespace cuda {

namespace {

using namespace skinny;

// Bytes of one warp's stage: 2 U loads of 16 bytes per lane.
constexpr size_t stage_bytes(int unroll) { return static_cast<size_t>(unroll) * 2 * 32 * 16; }

// Dynamic shared memory: [2][W][8 NT][RS] fp32 reduction buffers, [W][S] stages, then x staged.
size_t stream_smem_bytes(int warps, int nt, int unroll, int stages, int64_t m, int64_t k, SkinnyInput input) {
  const size_t red = 2 * static_cast<size_t>(warps) * red_bytes(nt, 1);
  const size_t ring = static_cast<size_t>(warps) * stages * stage_bytes(unroll);
  const size_t staged = input == SkinnyInput::kPlain ? 0 : static_cast<size_t>(m) * staged_stride(static_cast<int>(k)) * 2;
  return red + ring + staged;
}

// x [M, K] (or the fused input), w [N, K], out [M, N]; rounds = ceil(chunks / (W U)).
template <int NT, int U, int S, bool F32, int IN, bool ADD>
__global__ void __launch_bounds__(U == 8 ? 256 : 512) stream_gemm_kernel(const __nv_bfloat16* __restrict__ x,
                                                          const __nv_bfloat16* __restrict__ w, int M, int N, int K,
                                                          void* __restrict__ out,
                                                          const __nv_bfloat16* __restrict__ gamma, float eps,
                                                          int rounds) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int num_tiles = (N + 15) / 16;
  const int my_tiles = (num_tiles - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                       static_cast<int>(gridDim.x);
  const int jobs = my_tiles * rounds;
  constexpr int RS = red_stride(1), MP = 8 * NT;
  constexpr int kStageLoads = U * 2 * 32;  // uint4 per warp stage

  extern __shared__ __align__(16) float smem[];
  float* red = smem;
  uint4* ring = reinterpret_cast<uint4*>(smem + 2 * num_warps * MP * RS);
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(ring + num_warps * S * kStageLoads);
  uint4* my_ring = ring + warp * S * kStageLoads;
  const uint32_t my_ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(my_ring)) + lane * 16;

  // Job j of this warp: tile blockIdx.x + (j / rounds) gridDim.x, chunks (r W + warp) U + u.
  auto issue = [&](int j) {
    if (j < jobs) {
      const int tile = static_cast<int>(blockIdx.x) + (j / rounds) * static_cast<int>(gridDim.x);
      const int c0 = ((j % rounds) * num_warps + warp) * U;
      const uint32_t dst = my_ring_s + (j % S) * kStageLoads * 16;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = (c0 + u) * kChunk + t * 8;
        const bool ok = k < K;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = min(tile * 16 + h * 8 + g, N - 1);
          cp_async16(dst + (u * 2 + h) * 32 * 16, w + static_cast<int64_t>(row) * K + (ok ? k : 0), ok);
        }
      }
    }
    cp_async_commit();  // empty groups too: the wait counts stay uniform
  };

#pragma unroll
  for (int j = 0; j < S - 1; ++j) issue(j);
  detail::pdl_begin();
  constexpr bool kStaged = IN != 0;
  if constexpr (kStaged) stage_input<IN>(x, gamma, eps, M, K, xs);
  const int x_stride = kStaged ? staged_stride(K) : K;
  const __nv_bfloat16* xp[NT];
#pragma unroll
  for (int jj = 0; jj < NT; ++jj) {
    xp[jj] = (kStaged ? xs : x) + static_cast<int64_t>(min(8 * jj + g, M - 1)) * x_stride + t * 8;
  }

  constexpr int A = NT >= 4 ? 1 : 4 / NT;  // independent accumulator sets (chunk u feeds u % A)
  float acc[A][NT][4];
  for (int j = 0; j < jobs; ++j) {
    const int r = j % rounds;
    if (r == 0) {
#pragma unroll
      for (int q = 0; q < A; ++q)
#pragma unroll
        for (int jj = 0; jj < NT; ++jj)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[q][jj][e] = 0.0f;
    }
    cp_async_wait<S - 2>();  // groups complete in order: job j's copies have landed
    const uint4* st = my_ring + (j % S) * kStageLoads + lane;
    const int c0 = (r * num_warps + warp) * U;
    uint4 a[U][2], b[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      a[u][0] = st[(u * 2) * 32];
      a[u][1] = st[(u * 2 + 1) * 32];
      const int k = (c0 + u) * kChunk;
      const bool ok = k + t * 8 < K;
#pragma unroll
      for (int jj = 0; jj < NT; ++jj) {
        if (ok) {
          if constexpr (kStaged) {
            b[u][jj] = *reinterpret_cast<const uint4*>(xp[jj] + k);
          } else {
            b[u][jj] = load_x(xp[jj] + k);
          }
        } else {
          b[u][jj] = make_uint4(0, 0, 0, 0);
        }
      }
    }
    issue(j + S - 1);  // into the stage read one job ago (its registers are consumed)
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int jj = 0; jj < NT; ++jj)
          mma_bf16(acc[u % A][jj], word(a[u][0], 2 * s), word(a[u][1], 2 * s), word(a[u][0], 2 * s + 1),
                   word(a[u][1], 2 * s + 1), word(b[u][jj], 2 * s), word(b[u][jj], 2 * s + 1));

    if (r == rounds - 1) {  // the tile's last round: sum over the warps, write
      const int local = j / rounds;
      const int row0 = (static_cast<int>(blockIdx.x) + local * static_cast<int>(gridDim.x)) * 16;
      float* buf = red + (local & 1) * num_warps * MP * RS;
      float* mine = buf + warp * MP * RS;
#pragma unroll
      for (int jj = 0; jj < NT; ++jj) {
        float c[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          c[e] = acc[0][jj][e];
#pragma unroll
          for (int q = 1; q < A; ++q) c[e] += acc[q][jj][e];
        }
        const int m = 8 * jj + 2 * t;
        mine[m * RS + g] = c[0];
        mine[(m + 1) * RS + g] = c[1];
        mine[m * RS + g + 8] = c[2];
        mine[(m + 1) * RS + g + 8] = c[3];
      }
      __syncthreads();  // the other buffer was read before this barrier: the next tile may write it
      const int rows = min(16, N - row0);
      for (int i = threadIdx.x; i < M * 16; i += blockDim.x) {
        const int m = i >> 4, n = i & 15;
        if (n >= rows) continue;
        float sum = 0.0f;
        for (int v = 0; v < num_warps; ++v) sum += buf[(v * MP + m) * RS + n];
        store_out<F32, ADD>(out, static_cast<int64_t>(m) * N + row0 + n, sum);
      }
    }
  }
  cp_async_wait<0>();
}

using StreamFn = void (*)(const __nv_bfloat16*, const __nv_bfloat16*, int, int, int, void*, const __nv_bfloat16*,
                          float, int);

// The built kernels: (NT, U) = (1, 4), (1, 8) plain only, (2, 4); S = 3, 4, 6 (plain), 3, 4 (fused).
template <int NT, int U, int S>
StreamFn pick_mode(SkinnyInput input, bool add, bool out_f32) {
  constexpr int kRms = static_cast<int>(SkinnyInput::kRmsNorm), kSilu = static_cast<int>(SkinnyInput::kSiluMul);
  if (input == SkinnyInput::kPlain && !add) {
    return out_f32 ? stream_gemm_kernel<NT, U, S, true, 0, false> : stream_gemm_kernel<NT, U, S, false, 0, false>;
  }
  if (out_f32) return nullptr;
  if constexpr (U == 4 && S <= 4) {
    if (input == SkinnyInput::kPlain && add) return stream_gemm_kernel<NT, U, S, false, 0, true>;
    if (input == SkinnyInput::kRmsNorm && !add) return stream_gemm_kernel<NT, U, S, false, kRms, false>;
    if (input == SkinnyInput::kSiluMul && add) return stream_gemm_kernel<NT, U, S, false, kSilu, true>;
    if (input == SkinnyInput::kSiluMul && !add) return stream_gemm_kernel<NT, U, S, false, kSilu, false>;
  }
  return nullptr;
}

template <int NT, int U>
StreamFn pick_stages(int stages, SkinnyInput input, bool add, bool out_f32) {
  if (stages == 3) return pick_mode<NT, U, 3>(input, add, out_f32);
  if (stages == 4) return pick_mode<NT, U, 4>(input, add, out_f32);
  if (stages == 6) return pick_mode<NT, U, 6>(input, add, out_f32);
  return nullptr;
}

StreamFn pick_kernel(int nt, int unroll, int stages, SkinnyInput input, bool add, bool out_f32) {
  if (nt == 1 && unroll == 4) return pick_stages<1, 4>(stages, input, add, out_f32);
  if (nt == 1 && unroll == 8) return pick_stages<1, 8>(stages, input, add, out_f32);
  if (nt == 2 && unroll == 4) return pick_stages<2, 4>(stages, input, add, out_f32);
  return nullptr;
}

// Per-device facts the launcher needs on every call (looked up once).
struct DeviceFacts {
  int sms = 0;
  int max_smem = 0;  // opt-in dynamic shared memory per block
};

const DeviceFacts& device_facts() {
  static std::mutex mu;
  static DeviceFacts facts[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) device = 0;
  std::lock_guard<std::mutex> lock(mu);
  DeviceFacts& f = facts[device];
  if (f.sms == 0) {
    int sms = 132, smem = 227 * 1024;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    f.sms = sms;
    f.max_smem = smem - 1024;  // room for the kernels' static shared memory (stage_input's)
  }
  return f;
}

// The launch shape of (m, k, fusion, config): column tiles, unroll, stages, warps.
struct StreamShape {
  int nt = 1, unroll = 4, stages = 4, warps = 8;
  size_t smem = 0;
};

// Warps per CTA. Batch-invariant: from K alone (never from M), 8, fewer where K has fewer than
// two rounds of 8 U chunks. Else by M, as the H200 sweep of every built shape over the Qwen3-8B
// GEMMs measured (bench/results/gpu_h200_gemv_stream.json, one run): up to 8 rows 16 warps (with
// the 3-stage ring that fits them) led the former 8-warp 6-stage choice by up to 8 points of the
// copy bandwidth in 20 of the 21 (shape, M = 1 / 4 / 8) cases (O at M = 4: 77.9 against 69.5 %;
// the one loss: the drafter's K/V at M = 1, 89.3 against 91.0 %), fewer where K has fewer than U
// chunks per warp; past 8 rows 4 warps with 3 stages led the former 8 warps with 6 by 3-18 points
// on all 7 shapes (QKV at M = 16: 73.6 against 59.8 %).
// Unroll 8 (benchmarks): at most 8.
int default_warps(int64_t m, int64_t k, int unroll, bool invariant) {
  const int64_t chunks = (k + kChunk - 1) / kChunk;
  const int64_t cap = invariant || unroll == 8 ? 8 : m <= 8 ? 16 : 4;  // U 8: 255 registers, 256 threads
  const int64_t w = invariant ? (chunks + 2 * unroll - 1) / (2 * unroll) : (chunks + unroll - 1) / unroll;
  return static_cast<int>(w < 1 ? 1 : w > cap ? cap : w);
}

bool shape_of(int64_t m, int64_t k, const SkinnyFusion& f, bool out_f32, const StreamGemmConfig* config,
              StreamShape& s) {
  const bool invariant = f.batch_invariant || (config != nullptr && config->batch_invariant);
  s.nt = (m <= 8 && !invariant) ? 1 : 2;
  s.unroll = 4;
  if (config != nullptr && config->unroll != 0 && !invariant) s.unroll = config->unroll;
  const bool fixed_warps = config != nullptr && config->warps != 0;
  s.warps = fixed_warps ? config->warps : default_warps(m, k, s.unroll, invariant);
  if (s.warps < 1 || s.warps > (s.unroll == 8 ? 8 : 16)) return false;  // U = 8: 255 registers, 256 threads
  const int max_smem = device_facts().max_smem;
  // Staged x sized for 16 rows when invariant, so the shape never depends on m.
  const int64_t staged_rows = invariant ? kStreamGemmMaxRows : m;
  if (config != nullptr && config->stages != 0) {
    s.stages = config->stages;
  } else {
    // The deepest ring that fits (past 8 rows, not batch-invariant: 3 stages, which led 4 and 6
    // at 4 warps on 4 of the sweep's 7 shapes, e.g. QKV at M = 16: 73.6 / 69.9 / 60.2 %);
    // then fewer warps (unless given) until one does.
    const bool plain = f.input == SkinnyInput::kPlain && !f.add;
    const bool shallow = !invariant && m > 8;
    s.stages = 0;
    while (s.stages == 0 && s.warps >= 1) {
      for (int stages : {6, 4, 3}) {
        if ((stages == 6 && !plain) || (shallow && stages != 3)) continue;
        if (stream_smem_bytes(s.warps, s.nt, s.unroll, stages, staged_rows, k, f.input) <=
            static_cast<size_t>(max_smem)) {
          s.stages = stages;
          break;
        }
      }
      if (s.stages == 0) {
        if (fixed_warps) return false;
        s.warps -= 2;
      }
    }
    if (s.stages == 0) return false;
  }
  if (!fixed_warps && config != nullptr && s.warps < config->min_warps) return false;
  s.smem = stream_smem_bytes(s.warps, s.nt, s.unroll, s.stages, staged_rows, k, f.input);
  return s.smem <= static_cast<size_t>(max_smem) &&
         pick_kernel(s.nt, s.unroll, s.stages, f.input, f.add, out_f32) != nullptr;
}

}  // namespace

bool stream_gemm_supports(const void* in, const void* w, int64_t m, int64_t k, const SkinnyFusion& f, bool out_f32,
                          const StreamGemmConfig* config) {
  if (in == nullptr || w == nullptr || m < 1 || m > kStreamGemmMaxRows || k <= 0 || k % 8 != 0 ||
      k > (int64_t{1} << 24) || !detail::aligned16(in) || !detail::aligned16(w)) {
    return false;
  }
  if (f.input == SkinnyInput::kRmsNorm && (f.gamma == nullptr || !detail::aligned16(f.gamma))) return false;
  StreamShape s;
  return shape_of(m, k, f, out_f32, config, s);
}

cudaError_t stream_gemm(const __nv_bfloat16* in, const __nv_bfloat16* w, int64_t m, int64_t n, int64_t k,
                        const SkinnyFusion& f, bool out_f32, void* out, cudaStream_t stream,
                        const StreamGemmConfig* config) {
  if (m == 0 || n == 0) return cudaSuccess;
  if (!stream_gemm_supports(in, w, m, k, f, out_f32, config) || n < 0 || n > (int64_t{1} << 30) || out == nullptr) {
    return cudaErrorInvalidValue;
  }
  StreamShape s;
  if (!shape_of(m, k, f, out_f32, config, s)) return cudaErrorInvalidValue;
  StreamFn kernel = pick_kernel(s.nt, s.unroll, s.stages, f.input, f.add, out_f32);
  if (s.smem + kStaticSmemMargin > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(s.smem));
    if (e != cudaSuccess) return e;
  }
  int per_sm = 0;
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, s.warps * 32, s.smem);
  if (e != cudaSuccess) return e;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  const int64_t tiles = (n + 15) / 16;
  int64_t grid = static_cast<int64_t>(device_facts().sms) * per_sm;
  if (config != nullptr && config->ctas_per_sm > 0 && config->ctas_per_sm < per_sm) {
    grid = static_cast<int64_t>(device_facts().sms) * config->ctas_per_sm;
  }
  if (grid > tiles) grid = tiles;
  const int64_t chunks = (k + kChunk - 1) / kChunk;
  const int rounds = static_cast<int>((chunks + s.warps * s.unroll - 1) / (s.warps * s.unroll));
  detail::launch(kernel, static_cast<unsigned>(grid), s.warps * 32, s.smem, stream, in, w, static_cast<int>(m),
                 static_cast<int>(n), static_cast<int>(k), out, f.gamma, f.eps, rounds);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
