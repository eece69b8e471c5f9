// Paged decode attention for few query rows per (sequence, KV head): the AR decode step (one
// query per sequence, a GQA group of rows) and other launches with max_query_len * group <= 16
// run on CUDA cores here; launches of 17..64 rows (the verify step, the drafter's block) go to the
// tensor-core kernel of decode_attention_mma.cu (decode_attention() picks; one set of arguments,
// split rule and workspace for both, decode_attention_common.cuh).
// Same inputs and masks as the Triton kernels (triton_kernels/paged_attention.py): q [T, nh, hd],
// pools [num_blocks, block_size, nkv, hd], ragged query_start / kv_len / block_table, causal,
// non-causal, sliding-window or symmetric-window masks; bf16 in, fp32 softmax and accumulation,
// bf16 out.
//
// Why a hand-written kernel: at small batch the step's attention is latency-bound (a few
// kilobytes of K/V per CTA), and the Triton decode kernel serialises its latencies (block table,
// then K, then the scores, then V). Here one CTA of 4 warps owns (sequence, KV head, split):
//   - it issues the loads of a pass of 64 keys (K and V together: V does not depend on the
//     scores) and of the next pass before it computes on the current one;
//   - QK: two threads per key (half of head_dim each, a shuffle adds them), q in shared memory
//     pre-scaled by scale * log2(e), the scores of the pass go to shared memory;
//   - online softmax per row over the pass (8 threads per row), exp2 in fp32;
//   - PV: warp w owns keys [16 w, 16 w + 16) of the pass and lane l head dims [l hd/32, ...);
//     the warps' sums meet in shared memory at the end.
// Split-KV: the launch has num_splits CTAs per (sequence, KV head) (fixed, so a CUDA graph can
// hold it); each CTA takes an equal share of the sequence's actual key range in whole passes'
// multiples of 16 keys (at least 64 keys), so a short context uses fewer splits. Splits write
// (m, l, acc) partials to the workspace; the last CTA of a (sequence, KV head) to finish (an
// atomic counter, reset by that CTA) combines them and writes out, so there is no second launch.
// Deterministic: the combine sums the splits in index order.
//
// Fused RoPE (decode_attention_rope): the same kernel with ROPE = true also does the work of
// qkv_norm_rope_write for its sequences, so the AR step has one launch fewer per layer. Every CTA
// builds its rows' queries from the raw QKV projection (per-head RMSNorm and RoPE by
// rope_common.cuh's norm_rope_head, rounded to bf16 as the unfused kernel stores them, so the
// scores have the same bits), and the CTA whose key range holds a new token's position writes that
// token's K (normed, rotated) and V for its KV head into the pools. The key ranges of the splits
// partition the sequence, so each new key is written by the one CTA that reads it. Before waiting
// for the kernel ahead (programmatic launch), a ROPE CTA already reads what that kernel does not
// write: the batch's metadata, the block table and its first pass of K/V (earlier steps' keys);
// the new keys in that pass, read stale, are then replaced from the prologue's shared-memory
// copies, and those of later passes are read through L2 (ld.global.cg, which sees the CTA's own
// writes after __syncthreads; the read-only path does not promise that).
//
// Staged K/V (STAGED, PagedAttentionArgs::staged_kv; opt-in as kernels.attention = "staged"): the
// same kernel with each pass's K and V copied global -> shared memory by cp.async (two passes in
// flight, as the register version keeps two) instead of held in registers: the 2 x 64 registers a
// thread spent on the current and the next pass's K/V are gone (HD 128 RB 4: 78 registers instead
// of 244), so more of the next kernel's CTAs may fit beside it under programmatic launch (its 37 /
// 72 KB of shared memory at HD 64 / 128 allow two CTAs per SM, as the register version's
// registers do). Thread (w, l) copies exactly the K it reads in QK (key 16 w + l / 2, half l % 2
// of hd); key rows are padded (StagedLayout) so that the QK reads of a quarter warp and the PV
// reads of a warp are free of bank conflicts. Every product, sum and rounding is the register
// version's, in the same order: the outputs have its bits. Like ROPE, it reads the metadata and
// stages its first pass's keys of earlier steps before waiting for the kernel ahead
// (qkv_norm_rope_write, which writes only this step's keys, staged after the wait). With ROPE too
// (staged and fused), the prologue's scratch sits after the stages, and this step's keys of the
// first pass are staged after the prologue has written them and a barrier, from the pools through
// L2 (cp.async.cg), as every later pass is: no patching, the same bits.
//
// Programmatic dependent launch: detail::pdl_begin() before any memory access that the kernel
// ahead may write (ROPE and STAGED: the reads before it are argued at the kernel's top).
#include <algorithm>
#include <climits>
#include <type_traits>
#include <cfloat>
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/decode_attention_common.cuh"
#include "cuda/kernels.h"
#include "cuda/rope_common.cuh"
#include "cuda/tensor_core.cuh"  // cp_async16, smem_addr

namespace dflash {
namespace cuda {

namespace {

using namespace decode_attention_detail;

constexpr int kThreads = 128;        // 4 warps
constexpr int kPassKeys = 64;        // keys per pass: 2 threads per key in QK, 16 per warp in PV
constexpr int kCudaCoreMaxRows = 16;  // rows per (sequence, KV head) of this kernel; above: tensor cores

// The per-lane V piece of one key: hd / 32 bf16 (HD 128: 8 bytes, HD 64: 4 bytes).
template <int HD>
struct VPiece;
template <>
struct VPiece<128> {
  using T = uint2;
  static __device__ __forceinline__ void to_f32(const T& v, float (&f)[4]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
    const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
    f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
  }
};
template <>
struct VPiece<64> {
  using T = uint32_t;
  static __device__ __forceinline__ void to_f32(const T& v, float (&f)[2]) {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
    f[0] = a.x, f[1] = a.y;
  }
};

// The loads of one pass for this thread: K (its key, its half of hd) and V (its warp's 16 keys,
// its lane's dims). Keys outside [c0, c1) read as zeros.
template <int HD>
struct PassLoads {
  static constexpr int kKVecs = HD / 2 / 8;  // 16-byte K loads per thread
  uint4 k[kKVecs];
  typename VPiece<HD>::T v[16];
};

// A K/V piece: the read-only path, or L2 (COHERENT: the pools were written by this kernel).
template <bool COHERENT, typename T>
__device__ __forceinline__ T load_kv(const T* p) {
  if constexpr (COHERENT) {
    return __ldcg(p);
  } else {
    return __ldg(p);
  }
}

// The keys [pass0, c1) of the pass starting at pass0 into out; keys past c1 read as zeros.
template <int HD, bool COHERENT>
__device__ __forceinline__ void load_pass(const Params& p, const int32_t* table, int kv_head, int pass0, int c1,
                                          PassLoads<HD>& out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Lane e < 16 of warp w looks up key 16 w + e; shuffles hand the slot to the lanes that need it.
  const int my_key = pass0 + 16 * warp + (lane & 15);
  int64_t my_row = -1;  // the key's row in the pool (slot * nkv + kv_head), -1 outside the range
  if (my_key < c1) {
    const int blk = __ldg(table + my_key / p.block_size);
    my_row = (static_cast<int64_t>(blk) * p.block_size + my_key % p.block_size) * p.num_kv_heads + kv_head;
  }
  // QK: thread (warp w, lane l) owns key 16 w + l / 2, half l % 2 of hd.
  const int64_t k_row = __shfl_sync(0xffffffffu, my_row, lane >> 1);
  const int half = lane & 1;
  if (k_row >= 0) {
    const uint4* src = reinterpret_cast<const uint4*>(p.k_pool + k_row * HD + half * (HD / 2));
#pragma unroll
    for (int i = 0; i < PassLoads<HD>::kKVecs; ++i) out.k[i] = load_kv<COHERENT>(src + i);
  } else {
#pragma unroll
    for (int i = 0; i < PassLoads<HD>::kKVecs; ++i) out.k[i] = make_uint4(0, 0, 0, 0);
  }
  using VT = typename VPiece<HD>::T;
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    const int64_t v_row = __shfl_sync(0xffffffffu, my_row, e);
    if (v_row >= 0) {
      out.v[e] = load_kv<COHERENT>(reinterpret_cast<const VT*>(p.v_pool + v_row * HD) + lane);
    } else {
      out.v[e] = VT{};
    }
  }
}

// Shared memory of the fused prologue (ROPE), in red (not used before the end of the key loop):
// the rows' queries qb [RB][HD], and this CTA's new keys kn, vn [RB][HD] (bf16); with STAGED,
// after the stages.
constexpr size_t rope_scratch_bytes(int rb, int hd) { return size_t{3} * rb * hd * sizeof(__nv_bfloat16); }
template <int HD>
struct RopeScratch {
  __nv_bfloat16* qb;
  __nv_bfloat16* kn;
  __nv_bfloat16* vn;
  int* written;  // [RB]: new key i went to the pools (its slot is not negative)
};

// The fused prologue (ROPE): the rows' queries, RMSNormed per head (q_norm) and rotated, into
// qb; the new tokens i in [new0, new1) of this CTA's key range: K (k_norm, rotated) and V of
// this KV head into kn, vn [i - new0] and the pools at slots[token] (skipped when negative). One
// warp per (row) or (token, K or V) unit; the caller syncs. The pools are written from the
// shared copy by the lanes that wrote it (each lane copies its own elements).
template <int HD>
__device__ void rope_prologue(const Params& p, int q_begin, int group, int rows, int kv_head, int new0, int new1,
                              const RopeScratch<HD>& sm) {
  constexpr int P = HD / 64;  // rope_common.cuh's lane layout (decode_attention_rope_check)
  const int warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const int64_t heads = p.num_heads + 2 * p.num_kv_heads;
  const int units = rows + 2 * (new1 - new0);
  for (int u = warp; u < units; u += num_warps) {
    if (u < rows) {
      const int tok = q_begin + u / group, head = kv_head * group + u % group;
      detail::norm_rope_head<P>(p.rope.qkv + (tok * heads + head) * HD, p.rope.q_norm, p.rope.eps,
                                static_cast<float>(p.rope.positions[tok]), p.rope.inv_freq, HD, sm.qb + u * HD);
      continue;
    }
    const int e = u - rows, i = e / 2, tok = q_begin + new0 + i;
    const int64_t slot = p.rope.slots[tok];
    if ((threadIdx.x & 31) == 0 && e % 2 == 0) sm.written[i] = slot >= 0;
    if (slot < 0) continue;  // uniform over the warp
    const int64_t dst = (slot * p.num_kv_heads + kv_head) * HD;
    const __nv_bfloat16* k_src = p.rope.qkv + (tok * heads + p.num_heads + kv_head) * HD;
    if (e % 2 == 0) {
      detail::norm_rope_head<P>(k_src, p.rope.k_norm, p.rope.eps, static_cast<float>(p.rope.positions[tok]),
                                p.rope.inv_freq, HD, sm.kn + i * HD);
      detail::copy_head<P>(sm.kn + i * HD, HD, p.k_write + dst);
    } else {
      detail::copy_head<P>(k_src + p.num_kv_heads * HD, HD, sm.vn + i * HD);  // V follows the K heads
      detail::copy_head<P>(sm.vn + i * HD, HD, p.v_write + dst);
    }
  }
}

// The new keys [lo, c1) of the pass at pass0 that went to the pools, from the prologue's shared
// copies (row key - lo) into out over what load_pass read before they were written.
template <int HD>
__device__ __forceinline__ void patch_new_keys(const RopeScratch<HD>& sm, int pass0, int lo, int c1,
                                               PassLoads<HD>& out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int k_key = pass0 + 16 * warp + (lane >> 1), half = lane & 1;  // load_pass's QK layout
  if (k_key >= lo && k_key < c1 && sm.written[k_key - lo]) {
    const uint4* src = reinterpret_cast<const uint4*>(sm.kn + (k_key - lo) * HD + half * (HD / 2));
#pragma unroll
    for (int i = 0; i < PassLoads<HD>::kKVecs; ++i) out.k[i] = src[i];
  }
  using VT = typename VPiece<HD>::T;
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    const int key = pass0 + 16 * warp + e;
    if (key >= lo && key < c1 && sm.written[key - lo]) {
      out.v[e] = reinterpret_cast<const VT*>(sm.vn + (key - lo) * HD)[lane];
    }
  }
}

// STAGED: a pass's K and V in shared memory, [kStages][K, V][kPassKeys][kRow] bf16 (dynamic).
// Element d of a key row sits at d in the first half and at kHalf + d - HD / 2 in the second.
// Bank-conflict free for both readers: QK (a quarter warp reads 16 bytes at key k, half h: word
// (k kRow + h kHalf) / 2 must fall on 8 distinct 4-bank groups) and PV (a warp reads lane l's
// dims of one key: the second half must continue the first modulo 32 banks).
//   HD 128: kRow 144 (72 words, 8 mod 32), kHalf 72 (36 words, 4 mod 32): groups 8k + 4h; PV
//           reads 8 bytes a lane, each half warp its own wavefront.
//   HD 64:  kRow 72 (36 words, 4 mod 32), kHalf 32 (16 words): groups 4k + 16h; PV contiguous.
template <int HD>
struct StagedLayout {
  static_assert(HD == 64 || HD == 128, "head_dim 64 or 128");
  static constexpr int kStages = 2;                        // passes in flight
  static constexpr int kHalf = HD == 128 ? 72 : 32;        // offset of the second half of a row
  static constexpr int kRow = HD == 128 ? 144 : 72;        // bf16 per key row
  static constexpr int kTile = kPassKeys * kRow;           // K or V of one pass
  static constexpr size_t kBytes = size_t{kStages} * 2 * kTile * sizeof(__nv_bfloat16);
  static_assert(kRow % 8 == 0 && kHalf % 8 == 0, "16-byte aligned copies");
  static __device__ __forceinline__ int at(int d) { return d < HD / 2 ? d : kHalf + d - HD / 2; }
};
static_assert(kThreads == 2 * kPassKeys, "two copying threads per key of a pass");

// The keys [pass0, c1) of the pass starting at pass0 into k_dst / v_dst (StagedLayout rows), by
// cp.async; keys past c1 are zero-filled. Only the pass's keys j in [from, to) are touched (the
// first pass is staged in two calls, either side of the wait for the kernel ahead). Thread t
// copies key t / 2, half t % 2 of hd: the K piece load_pass would have given that thread for QK.
template <int HD>
__device__ __forceinline__ void stage_pass(const Params& p, const int32_t* table, int kv_head, int pass0, int c1,
                                           __nv_bfloat16* k_dst, __nv_bfloat16* v_dst, int from = 0,
                                           int to = INT_MAX) {
  using L = StagedLayout<HD>;
  const int key = threadIdx.x >> 1, half = threadIdx.x & 1, j = pass0 + key;
  if (j < from || j >= to) return;
  const bool ok = j < c1;
  int64_t row = 0;
  if (ok) {
    const int blk = __ldg(table + j / p.block_size);
    row = (static_cast<int64_t>(blk) * p.block_size + j % p.block_size) * p.num_kv_heads + kv_head;
  }
  const int64_t src = row * HD + half * (HD / 2);
  const int dst = key * L::kRow + half * L::kHalf;
#pragma unroll
  for (int c = 0; c < HD / 16; ++c) {
    cp_async16(smem_addr(k_dst + dst + 8 * c), p.k_pool + src + 8 * c, ok);
    cp_async16(smem_addr(v_dst + dst + 8 * c), p.v_pool + src + 8 * c, ok);
  }
}

struct NoLoads {};

// RB: row capacity (a multiple of 4, <= kCudaCoreMaxRows); the launch's rows = max_query_len * group <= RB.
// ROPE: the fused prologue (decode_attention_rope; p.rope set, p.q unused).
// STAGED: K/V staged in shared memory by cp.async (dynamic shared memory StagedLayout<HD>::kBytes).
template <int HD, int RB, bool ROPE, bool STAGED>
__global__ void __launch_bounds__(kThreads) decode_attention_kernel(Params p) {
  using SL = StagedLayout<HD>;
  constexpr int DL = HD / 32;           // head dims per lane in PV
  constexpr int QS = HD / 2 + 4;        // q_s half-row stride (the halves on different banks)
  __shared__ __align__(16) float q_s[RB][2][QS];
  __shared__ float s_s[RB][kPassKeys + 1];
  __shared__ float m_s[RB], l_s[RB], alpha_s[RB];
  // The warps' partial rows [4][RB][HD] (and the prologue's / the combine's scratch): static, or
  // with STAGED the K/V stages, free after the key loop.
  __shared__ __align__(16) float red_static[STAGED ? 1 : 4][RB][STAGED ? 1 : HD];
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  [[maybe_unused]] __nv_bfloat16* kv_s = reinterpret_cast<__nv_bfloat16*>(dyn_smem);
  float* red = STAGED ? reinterpret_cast<float*>(dyn_smem) : &red_static[0][0][0];
  static_assert(!STAGED || size_t{4} * RB * HD * sizeof(float) <= SL::kBytes, "the partial rows fit in the stages");
  static_assert((2 * kMaxSplits + 1) * RB <= 4 * RB * HD, "the combine's weights fit in red");

  // ROPE waits for the kernel before it further down. What it reads before that (the batch's
  // metadata, the block table, the K/V of earlier steps) the kernel right before it (the QKV GEMM,
  // which writes only qkv) does not write; kernels of this step that do write them (the pipelined
  // step's feed_spec_inputs: kv_len, positions, slots; the drafter's context update: its pools)
  // run before that GEMM, which waits for them before it lets this kernel launch. So no kernel
  // that triggers its dependents before waiting (l2_prefetch) may sit alone between such a writer
  // and this kernel.
  // STAGED waits further down too: before that it reads the same as ROPE does, and stages the
  // first pass's keys of earlier steps (the kernel right before it, qkv_norm_rope_write, writes
  // only this step's, the last num_q keys, which are staged after the wait).
  if constexpr (!ROPE && !STAGED) detail::pdl_begin();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int seq = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z, num_splits = gridDim.z;
  const int q_begin = p.query_start[seq];
  const int num_q = p.query_start[seq + 1] - q_begin;
  // A CTA leaving before its wait waits first (ROPE, STAGED): a grid of such CTAs alone must still
  // end after the kernel ahead, which a kernel behind it that waits on this one relies on.
  if (num_q <= 0) {
    if constexpr (ROPE || STAGED) detail::pdl_begin();
    return;
  }
  const int group = p.num_heads / p.num_kv_heads;
  const int rows = min(num_q * group, RB);
  const int kv_len = max(p.kv_len[seq], 0);

  const SplitKeys keys = split_keys(p, kv_len, num_q, split, num_splits, 16);
  if (split >= keys.active) {
    if constexpr (ROPE || STAGED) detail::pdl_begin();
    return;
  }
  const int c0 = keys.c0, c1 = keys.c1, active = keys.active;

  // The first pass's K/V loads (HBM) go out before Q is staged (L2), so their latencies overlap;
  // with ROPE, before the wait for the kernel ahead (only the new tokens' keys come after).
  const int32_t* table = p.block_table + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  std::conditional_t<STAGED, NoLoads, PassLoads<HD>> cur, nxt;
  // ROPE: the prologue's queries and new keys in red (not used before the end of the key loop), or
  // with STAGED (where red is the stages) in the dynamic shared memory after the stages.
  __shared__ int written_s[RB];
  [[maybe_unused]] __nv_bfloat16* rope_s =
      STAGED ? reinterpret_cast<__nv_bfloat16*>(dyn_smem + SL::kBytes) : reinterpret_cast<__nv_bfloat16*>(red);
  [[maybe_unused]] const RopeScratch<HD> sm{rope_s, rope_s + RB * HD, rope_s + 2 * RB * HD, written_s};
  static_assert(rope_scratch_bytes(RB, HD) <= 4 * RB * HD * sizeof(float), "the prologue's rows fit in red");
  const int first_new = kv_len - num_q;  // this step's keys: [first_new, kv_len)
  // ROPE: this CTA's new tokens, queries [new0, new1), keys first_new + i in [c0, c1); their keys
  // and values go to the pools (and kn / vn), the queries to qb. new1 is clamped to new0: a split
  // whose keys all precede the new tokens (c1 <= first_new, every split but the last ones at long
  // contexts) has none, and a negative count would make rope_prologue's units = rows + 2 (new1 -
  // new0) smaller than rows, leaving queries unbuilt.
  [[maybe_unused]] const int new0 = max(c0 - first_new, 0), new1 = max(min(c1 - first_new, num_q), new0);
  if constexpr (STAGED) {
    if (c0 < c1) stage_pass<HD>(p, table, kv_head, c0, c1, kv_s, kv_s + SL::kTile, 0, first_new);
    cp_async_commit();
    detail::pdl_begin();
    if constexpr (ROPE) {
      rope_prologue<HD>(p, q_begin, group, rows, kv_head, new0, new1, sm);
      // The new keys are in the pools (and qb is complete): the first pass's copies of them below,
      // and the later passes', read them through L2 (cp.async.cg) after this barrier.
      __syncthreads();
    }
    if (c0 < c1 && first_new < c0 + kPassKeys) {
      stage_pass<HD>(p, table, kv_head, c0, c1, kv_s, kv_s + SL::kTile, first_new, INT_MAX);
    }
    cp_async_commit();  // (the key loop's wait<1> leaves only the newest group in flight)
  } else {
    if (c0 < c1) load_pass<HD, false>(p, table, kv_head, c0, c1, cur);
    if constexpr (ROPE) {
      detail::pdl_begin();
      rope_prologue<HD>(p, q_begin, group, rows, kv_head, new0, new1, sm);
      __syncthreads();  // the new keys are in the pools and in kn / vn, qb is complete
      // The first pass read the new keys before they were written: their shared copies replace them.
      if (new0 < new1 && first_new + new0 < c0 + kPassKeys) patch_new_keys<HD>(sm, c0, first_new + new0, c1, cur);
    }
  }

  for (int i = tid; i < RB * HD; i += kThreads) {
    const int r = i / HD, d = i % HD;
    float v = 0.0f;
    if (r < rows) {
      if constexpr (ROPE) {
        v = __bfloat162float(sm.qb[r * HD + d]) * p.qk_scale;
      } else {
        const int tok = q_begin + r / group, head = kv_head * group + r % group;
        v = __bfloat162float(p.q[(static_cast<int64_t>(tok) * p.num_heads + head) * HD + d]) * p.qk_scale;
      }
    }
    q_s[r][d / (HD / 2)][d % (HD / 2)] = v;
  }
  if (tid < RB) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  float acc[RB][DL];
#pragma unroll
  for (int r = 0; r < RB; ++r)
#pragma unroll
    for (int d = 0; d < DL; ++d) acc[r][d] = 0.0f;

  __syncthreads();

  const int half = lane & 1, kk = 16 * warp + (lane >> 1);  // QK: this thread's key in the pass
  const int srow = tid >> 3, ssub = tid & 7;                 // softmax: 8 threads per row
  for (int pass0 = c0, it = 0; pass0 < c1; pass0 += kPassKeys, ++it) {
    [[maybe_unused]] const __nv_bfloat16* k_s = kv_s + (it % SL::kStages) * 2 * SL::kTile;
    [[maybe_unused]] const __nv_bfloat16* v_s = k_s + SL::kTile;
    if constexpr (STAGED) {
      if (pass0 + kPassKeys < c1) {
        __nv_bfloat16* k_next = kv_s + ((it + 1) % SL::kStages) * 2 * SL::kTile;
        stage_pass<HD>(p, table, kv_head, pass0 + kPassKeys, c1, k_next, k_next + SL::kTile);
      }
      cp_async_commit();  // empty groups too: the wait count stays uniform
      cp_async_wait<1>();  // this pass's copies (this thread's) have landed
      __syncthreads();     // and every thread's (PV reads other threads' V)
    } else {
      if (pass0 + kPassKeys < c1) load_pass<HD, ROPE>(p, table, kv_head, pass0 + kPassKeys, c1, nxt);
    }

    // QK: partial dot over this thread's half of hd, then the pair's sum.
    float part[RB];
#pragma unroll
    for (int r = 0; r < RB; ++r) part[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < PassLoads<HD>::kKVecs; ++c) {
      uint4 kc;
      if constexpr (STAGED) {
        kc = reinterpret_cast<const uint4*>(k_s + kk * SL::kRow + half * SL::kHalf)[c];
      } else {
        kc = cur.k[c];
      }
      const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&kc);
      float kf[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 t = __bfloat1622float2(h2[e]);
        kf[2 * e] = t.x, kf[2 * e + 1] = t.y;
      }
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        const float4 qa = *reinterpret_cast<const float4*>(&q_s[r][half][8 * c]);
        const float4 qb = *reinterpret_cast<const float4*>(&q_s[r][half][8 * c + 4]);
        part[r] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] + qb.y * kf[5] +
                   qb.z * kf[6] + qb.w * kf[7];
      }
    }
    const int j = pass0 + kk;
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      const float s = part[r] + __shfl_xor_sync(0xffffffffu, part[r], 1);
      if ((r & 1) == half) {  // the pair writes alternate rows
        const bool visible = r < rows && j < c1 && key_visible(p, j, kv_len - num_q + r / group);
        s_s[r][kk] = visible ? s : -INFINITY;
      }
    }
    __syncthreads();

    // Online softmax over the pass: 8 threads per row (rows >= RB idle but shuffle along).
    {
      const bool row_ok = srow < RB;
      float sv[8], mx = -INFINITY;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        sv[e] = row_ok ? s_s[srow][ssub * 8 + e] : -INFINITY;
        mx = fmaxf(mx, sv[e]);
      }
#pragma unroll
      for (int o = 4; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = row_ok ? m_s[srow] : -INFINITY;
      const float m_new = fmaxf(m_old, mx);
      const float m_ref = m_new == -INFINITY ? 0.0f : m_new;
      float sum = 0.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float pe = exp2f(sv[e] - m_ref);
        sum += pe;
        if (row_ok) s_s[srow][ssub * 8 + e] = pe;
      }
#pragma unroll
      for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (row_ok && ssub == 0) {
        const float alpha = exp2f(m_old - m_ref);
        m_s[srow] = m_new;
        l_s[srow] = l_s[srow] * alpha + sum;
        alpha_s[srow] = alpha;
      }
    }
    __syncthreads();

    // PV over this warp's 16 keys of the pass.
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      const float alpha = alpha_s[r];
#pragma unroll
      for (int d = 0; d < DL; ++d) acc[r][d] *= alpha;
    }
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      float vf[DL];
      if constexpr (STAGED) {
        using VT = typename VPiece<HD>::T;
        VPiece<HD>::to_f32(*reinterpret_cast<const VT*>(v_s + (16 * warp + e) * SL::kRow + SL::at(lane * DL)), vf);
      } else {
        VPiece<HD>::to_f32(cur.v[e], vf);
      }
      // A key masked for a row has pe = 0, but 0 * NaN is NaN: a non-finite value (a NaN row
      // of another query behind it in causal order) adds nothing. Finite values pass unchanged.
#pragma unroll
      for (int d = 0; d < DL; ++d) vf[d] = fabsf(vf[d]) <= FLT_MAX ? vf[d] : 0.0f;
#pragma unroll
      for (int r = 0; r < RB; ++r) {
        const float pe = s_s[r][16 * warp + e];
#pragma unroll
        for (int d = 0; d < DL; ++d) acc[r][d] += pe * vf[d];
      }
    }
    if constexpr (!STAGED) cur = nxt;
    __syncthreads();  // s_s and alpha_s are rewritten by the next pass (STAGED: and this stage)
  }
  if constexpr (STAGED) {
    cp_async_wait<0>();  // no copy in flight into the stages, which now hold the partial rows
    __syncthreads();
  }

  // The warps' sums.
#pragma unroll
  for (int r = 0; r < RB; ++r)
#pragma unroll
    for (int d = 0; d < DL; ++d) red[(warp * RB + r) * HD + lane * DL + d] = acc[r][d];
  __syncthreads();

  for (int i = tid; i < rows * HD; i += kThreads) {
    const int r = i / HD, d = i % HD;
    const float a = red[r * HD + d] + red[(RB + r) * HD + d] + red[(2 * RB + r) * HD + d] + red[(3 * RB + r) * HD + d];
    write_row_element<HD>(p, row_base(p, q_begin, kv_head, group, r), d, a, m_s[r], l_s[r], split, num_splits,
                          active);
  }
  if (active > 1) combine_splits<HD>(p, seq, kv_head, q_begin, group, rows, RB, num_splits, active, red);
}

using KernelFn = void (*)(Params);

// The kernel's row capacity RB for a launch of `rows` rows per (sequence, KV head).
constexpr int row_block(int rows) { return rows <= 4 ? 4 : rows <= 8 ? 8 : 16; }

template <int HD, bool ROPE, bool STAGED>
KernelFn pick_rows(int rows) {
  switch (row_block(rows)) {
    case 4: return decode_attention_kernel<HD, 4, ROPE, STAGED>;
    case 8: return decode_attention_kernel<HD, 8, ROPE, STAGED>;
    default: return decode_attention_kernel<HD, 16, ROPE, STAGED>;
  }
}

// The kernel of a launch: head_dim HD, `rows` rows per (sequence, KV head), fused RoPE, staged K/V.
template <int HD>
KernelFn pick_kernel(int rows, bool rope, bool staged) {
  if (staged) return rope ? pick_rows<HD, true, true>(rows) : pick_rows<HD, false, true>(rows);
  return rope ? pick_rows<HD, true, false>(rows) : pick_rows<HD, false, false>(rows);
}

int num_sms() {
  static const int sms = [] {
    int device = 0, n = 132;
    if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    return n;
  }();
  return sms;
}

int clamp_splits(int64_t s) { return static_cast<int>(s < 1 ? 1 : s > kMaxSplits ? kMaxSplits : s); }

}  // namespace

int decode_attention_max_splits() { return kMaxSplits; }

size_t decode_attention_workspace_bytes(int64_t num_tokens, int64_t num_heads, int64_t head_dim, int splits) {
  return static_cast<size_t>(splits) * num_tokens * num_heads * (head_dim + 2) * sizeof(float);
}

const char* decode_attention_check(const PagedAttentionArgs& a) {
  if (a.head_dim != 64 && a.head_dim != 128) return "head_dim must be 64 or 128";
  if (a.num_kv_heads <= 0 || a.num_heads <= 0 || a.num_heads % a.num_kv_heads != 0) {
    return "num_heads must be a positive multiple of num_kv_heads";
  }
  if (a.max_query_len < 0 || int64_t{a.max_query_len} * (a.num_heads / a.num_kv_heads) > kDecodeAttentionMaxRows) {
    return "max_query_len * (num_heads / num_kv_heads) exceeds kDecodeAttentionMaxRows";
  }
  if (a.block_size <= 0 || a.max_blocks_per_seq < 0 || a.num_seqs < 0 || a.num_tokens < 0 || a.window < 0) {
    return "negative sizes, or block_size <= 0";
  }
  if (!detail::aligned16(a.q) || !detail::aligned16(a.k_pool) || !detail::aligned16(a.v_pool)) {
    return "q and the pools must be 16-byte aligned";
  }
  return nullptr;
}

int decode_attention_splits(const PagedAttentionArgs& a) {
  if (a.force_splits > 0) return a.force_splits;
  if (a.workspace == nullptr || a.counters == nullptr ||
      int64_t{a.num_seqs} * a.num_kv_heads > a.counter_slots) {
    return 1;
  }
  int64_t span = a.max_kv_len;
  if (a.window > 0) span = std::min<int64_t>(span, int64_t{a.window} + a.max_query_len);
  const int64_t ctas = std::max<int64_t>(int64_t{a.num_seqs} * a.num_kv_heads, 1);
  const int64_t target = int64_t{kCtasPerSm} * num_sms();
  int64_t splits = std::min<int64_t>((target + ctas - 1) / ctas, span / kMinSplitKeys);
  while (splits > 1 && decode_attention_workspace_bytes(a.num_tokens, a.num_heads, a.head_dim,
                                                        static_cast<int>(splits)) > a.workspace_bytes) {
    --splits;
  }
  return clamp_splits(splits);
}

namespace {

// The split count for a, or -1 when a split-KV launch lacks its counters or workspace.
int checked_splits(const PagedAttentionArgs& a) {
  const int splits = decode_attention_splits(a);
  if (splits > kMaxSplits) return -1;
  if (splits > 1 && (a.counters == nullptr || int64_t{a.num_seqs} * a.num_kv_heads > a.counter_slots ||
                     a.workspace == nullptr ||
                     decode_attention_workspace_bytes(a.num_tokens, a.num_heads, a.head_dim, splits) >
                         a.workspace_bytes)) {
    return -1;
  }
  return splits;
}

// The CUDA-core kernel over the grid (num_seqs, nkv, splits): the fused RoPE prologue, staged
// K/V, or neither.
cudaError_t launch_cuda_cores(const Params& p, int head_dim, int rows, dim3 grid, bool rope, bool staged,
                              cudaStream_t stream) {
  const KernelFn kernel =
      head_dim == 128 ? pick_kernel<128>(rows, rope, staged) : pick_kernel<64>(rows, rope, staged);
  size_t smem = 0;
  if (staged) {
    smem = head_dim == 128 ? StagedLayout<128>::kBytes : StagedLayout<64>::kBytes;
    // With ROPE: the prologue's qb, kn, vn [RB][HD] bf16 after the stages (RB as pick_rows picks).
    if (rope) smem += rope_scratch_bytes(row_block(rows), head_dim);
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  const cudaError_t e = detail::launch(kernel, grid, dim3(kThreads), smem, stream, p);
  return e != cudaSuccess ? e : cudaGetLastError();
}

dim3 grid_of(const PagedAttentionArgs& a, int splits) {
  return dim3(static_cast<unsigned>(a.num_seqs), static_cast<unsigned>(a.num_kv_heads), static_cast<unsigned>(splits));
}

}  // namespace

cudaError_t decode_attention(const PagedAttentionArgs& a, cudaStream_t stream) {
  if (decode_attention_check(a) != nullptr) return cudaErrorInvalidValue;
  if (a.num_seqs == 0 || a.num_tokens == 0) return cudaSuccess;
  const int splits = checked_splits(a);
  if (splits < 0) return cudaErrorInvalidValue;
  const Params p = make_params(a);
  const int rows = a.max_query_len * (a.num_heads / a.num_kv_heads);
  if (rows > kCudaCoreMaxRows || a.force_tensor_cores) {
    return decode_attention_mma(p, a.head_dim, rows, grid_of(a, splits), stream);
  }
  return launch_cuda_cores(p, a.head_dim, rows, grid_of(a, splits), false, a.staged_kv, stream);
}

const char* decode_attention_rope_check(const PagedAttentionArgs& a, const DecodeRopeArgs& r) {
  if (r.qkv == nullptr || r.positions == nullptr || r.inv_freq == nullptr || r.slots == nullptr) {
    return "qkv, positions, inv_freq and slots are required";
  }
  PagedAttentionArgs without_q = a;
  without_q.q = nullptr;  // unused: the queries come from qkv
  if (const char* why = decode_attention_check(without_q)) return why;
  if (int64_t{a.max_query_len} * (a.num_heads / a.num_kv_heads) > kCudaCoreMaxRows || a.force_tensor_cores) {
    return "more than 16 rows per (sequence, KV head): the fused RoPE runs on the CUDA-core kernel only";
  }
  // rope_common.cuh's lane layout with head_dim / 64 pairs per lane, which qkv_norm_rope_write
  // also picks for such pointers (so the same bits).
  const uintptr_t bits = reinterpret_cast<uintptr_t>(r.qkv) | reinterpret_cast<uintptr_t>(r.q_norm) |
                         reinterpret_cast<uintptr_t>(r.k_norm);
  if (detail::rope_pairs_per_lane(a.head_dim, bits) != a.head_dim / 64) {
    return "qkv, q_norm and k_norm must allow head_dim / 32-byte accesses";
  }
  return nullptr;
}

cudaError_t decode_attention_rope(const PagedAttentionArgs& a, const DecodeRopeArgs& r, cudaStream_t stream) {
  if (decode_attention_rope_check(a, r) != nullptr) return cudaErrorInvalidValue;
  if (a.num_seqs == 0 || a.num_tokens == 0) return cudaSuccess;
  const int splits = checked_splits(a);
  if (splits < 0) return cudaErrorInvalidValue;
  Params p = make_params(a);
  p.q = nullptr;
  p.rope = r;
  // The prologue writes the new keys into the pools that the kernel then reads.
  p.k_write = const_cast<__nv_bfloat16*>(p.k_pool);
  p.v_write = const_cast<__nv_bfloat16*>(p.v_pool);
  const int rows = a.max_query_len * (a.num_heads / a.num_kv_heads);
  return launch_cuda_cores(p, a.head_dim, rows, grid_of(a, splits), true, a.staged_kv, stream);
}

}  // namespace cuda
}  // namespace dflash
