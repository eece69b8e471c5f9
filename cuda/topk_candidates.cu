// Exact top-K per row of fp32 logits (topk_candidates of kernels.h) in one launch of
// chunks x rows CTAs: each CTA selects the exact top-K of its chunk of the row (a lower bound from
// the warps' order statistics of the thread maxima, the survivors compacted to shared memory and
// ranked, or radix selected on their ordered keys with ties by a bitmap of ids), writes it to the
// workspace, and the last CTA of the row merges the chunks' sorted lists (pairwise merge tree) into
// ids / unary and resets the row's counter.
//
// Cost: one read of the logits, rows * vocab * 4 bytes: rows 8 x vocab 151936 is 4.9 MB, 1.2 us at
// 4 TB/s, so that launch is latency-bound (launch, a DRAM round trip, a few barriers, the merge);
// rows 256 is 156 MB, 39 us. Measured on an H200 (back-to-back launches in a CUDA graph), vocab
// 151936, K 16: rows 8 10 us, rows 256 61 us (torch.topk: 70 and 584 us); K 64, rows 8: 19 us.
#include <algorithm>
#include <climits>
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxChunk = 8192;                      // elements of a CTA: 8 float4 per thread in registers
constexpr int kVecs = kMaxChunk / (4 * kThreads);    // float4 per thread
constexpr int kMinChunk = 4096;                      // shortest chunk when the row has more (merge cost)
constexpr int kTargetCtas = 132;                     // about one per SM of an H200
constexpr int kMaxMerge = 2048;                      // entries (lists x K) the last CTA of a row merges
constexpr int kListCap = 1024;                       // survivors held in shared memory
constexpr int kRankCap = kThreads;                   // survivors ranked directly (one per thread)
constexpr int kMaxK = static_cast<int>(kTopkMaxK);
constexpr uint32_t kNanKey = 1u;                     // below every number
constexpr uint32_t kMinNumberKey = 0x007fffffu;      // the key of -inf
constexpr unsigned long long kEmpty = ~0ull;         // sort key of an empty slot (after every entry)
static_assert(kMaxChunk / 32 == kThreads, "one bitmap word per thread");
static_assert(kMaxMerge / kMaxK >= (kTopkMaxVocab + kMaxChunk - 1) / kMaxChunk, "merge holds the lists");

// ---------------------------------------------------------------------------------------------
// Keys

// Order-preserving key of a logit: NaN lowest (kNanKey), -0 counted as +0; 0 marks no element.
__device__ __forceinline__ uint32_t rank_key(float x) {
  if (isnan(x)) return kNanKey;
  const uint32_t b = __float_as_uint(x + 0.0f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The number of a key >= kMinNumberKey.
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Ascending sort keys = the CPU order: larger key first, then lower id.
__device__ __forceinline__ unsigned long long sort_key(uint32_t key, int id) {
  return (static_cast<unsigned long long>(~key) << 32) | static_cast<uint32_t>(id);
}

// The chunk's selection: keys above key, and those equal to key at offsets <= off.
struct Cut {
  uint32_t key;
  int off;
};

struct Smem {
  union {
    struct {
      union {
        unsigned long long list[kListCap];  // survivors' sort keys (key >= the lower bound), unordered
        uint32_t keys[kMaxChunk];           // every key of the chunk (when the survivors overflow)
      };
      uint32_t hist[2][256];        // radix histograms (alternating, one cleared while the other is read)
      uint32_t bitmap[kThreads];    // offsets of the ties at the cut, one bit each
      unsigned long long cand[kMaxK];
      unsigned long long sorted[kMaxK];
    } sel;
    struct {
      unsigned long long a[kMaxMerge];  // the row's lists, then every other round's output
      unsigned long long b[kMaxMerge / 2];
    } merge;
  };
  uint32_t wjth[kWarps];  // each warp's j-th largest thread maximum (the lower bound's parts)
  uint32_t wmax[kWarps];
  uint32_t scan[kWarps];
  uint32_t digit, above, nbin;
  int num_list, num_cand, tie_off, last;
};

// Inclusive prefix sum over the block's threads in order. tot: __shared__ [kWarps]; the caller
// synchronises before tot is written again.
__device__ __forceinline__ uint32_t block_scan(uint32_t v, uint32_t* tot) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t x = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += x;
  }
  if (lane == 31) tot[warp] = v;
  __syncthreads();
  for (int w = 0; w < warp; ++w) v += tot[w];
  return v;
}

// ---------------------------------------------------------------------------------------------
// Selection inside a chunk

// The kk best elements of those visited by for_each(f) (f(key, offset) on every thread; the
// elements with key >= lower, at least kk of them, have keys in [lower, top]) into s.sel.cand:
// radix select over 8-bit digits below the common prefix of lower and top, stopping as soon as
// the digit's bin is taken whole; the ties at a fully resolved cut by lowest offset (bitmap).
template <typename ForEach>
__device__ void select_chunk(const ForEach& for_each, uint32_t lower, uint32_t top, int kk, int start,
                             Smem& s) {
  const int t = threadIdx.x;
  uint32_t r = static_cast<uint32_t>(kk);  // still to take among the keys matching prefix
  Cut cut{top, INT_MAX};
  bool ties = true;
  if (lower != top) {
    int hi = 31 - __clz(lower ^ top);
    uint32_t prefix = top & ~((2u << hi) - 1u);  // hi == 31: 2u << 31 == 0, mask 0
    int buf = 0;
    while (true) {
      const int lo = max(hi - 7, 0);
      const uint32_t nb = 1u << (hi - lo + 1);
      uint32_t* hist = s.sel.hist[buf];
      for_each([&](uint32_t key, int) {
        if (key >= lower && ((key ^ prefix) >> hi >> 1) == 0) atomicAdd(&hist[(key >> lo) & (nb - 1)], 1u);
      });
      __syncthreads();
      const uint32_t h = t < static_cast<int>(nb) ? hist[nb - 1 - t] : 0u;  // digits from the top
      s.sel.hist[buf ^ 1][t] = 0;
      const uint32_t cum = block_scan(h, s.scan);
      if (t < static_cast<int>(nb) && cum >= r && cum - h < r) {
        s.digit = nb - 1 - t;
        s.above = cum - h;
        s.nbin = h;
      }
      __syncthreads();
      r -= s.above;
      prefix |= s.digit << lo;
      buf ^= 1;
      if (r == s.nbin) {  // the bin is taken whole: every survivor with these high bits
        cut = Cut{max(prefix, lower), INT_MAX};
        ties = false;
        break;
      }
      if (lo == 0) {
        cut.key = prefix;
        break;
      }
      hi = lo - 1;
    }
  }
  if (ties) {  // the r-th lowest offset with key == cut.key (every one when there are r)
    for_each([&](uint32_t key, int off) {
      if (key == cut.key) atomicOr(&s.sel.bitmap[off >> 5], 1u << (off & 31));
    });
    __syncthreads();
    uint32_t word = s.sel.bitmap[t];
    const uint32_t c = __popc(word);
    const uint32_t cum = block_scan(c, s.scan);
    if (cum >= r && cum - c < r) {
      for (uint32_t i = cum - c + 1; i < r; ++i) word &= word - 1;
      s.tie_off = t * 32 + __ffs(word) - 1;
    }
    __syncthreads();
    cut.off = s.tie_off;
  }
  for_each([&](uint32_t key, int off) {
    if (key > cut.key || (key == cut.key && off <= cut.off)) {
      const int slot = atomicAdd(&s.num_cand, 1);
      if (slot < kMaxK) s.sel.cand[slot] = sort_key(key, start + off);
    }
  });
  __syncthreads();
}

// Writes the sorted list[k] of a row: ids, and unary from the logit itself (its sign of zero).
__device__ __forceinline__ void write_row(const unsigned long long* list, const float* row_logits, int k,
                                          float multiplier, float softcap, int32_t* ids, float* unary) {
  const int t = threadIdx.x;
  if (t >= k) return;
  const int id = static_cast<int>(static_cast<uint32_t>(list[t]));
  float v = __ldg(row_logits + id);
  if (isnan(v)) {
    v = -INFINITY;
  } else {
    v *= multiplier;
    if (softcap > 0.0f) v = softcap * tanhf(v / softcap);
  }
  ids[t] = id;
  unary[t] = v;
}

// ---------------------------------------------------------------------------------------------
// Kernel: blockIdx.x = row * chunks + chunk

// logits [rows, vocab]; ids, unary [rows, k]; partials [rows, chunks, k] sort keys; counters [rows].
__global__ void __launch_bounds__(kThreads, 4)
    topk_kernel(const float* logits, int vocab, int k, int chunks, int chunk_len, float multiplier, float softcap,
                int32_t* ids, float* unary, unsigned long long* partials, int32_t* counters) {
  __shared__ Smem s;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int row = blockIdx.x / chunks, chunk = blockIdx.x - row * chunks;
  const float* row_logits = logits + static_cast<int64_t>(row) * vocab;
  const int start = chunk * chunk_len, n = min(chunk_len, vocab - start);
  const int kk = min(k, n);
  s.sel.hist[0][t] = 0;
  s.sel.hist[1][t] = 0;
  s.sel.bitmap[t] = 0;
  if (t == 0) s.num_list = 0, s.num_cand = 0;
  detail::pdl_begin();

  // The chunk: a0 scalar head elements up to a 16-byte boundary, nv float4, a scalar tail; slots
  // past the chunk hold NaN (and count as no element where keys are used).
  const float* cp = row_logits + start;
  const int a0 = min(static_cast<int>((0u - static_cast<uint32_t>(reinterpret_cast<uintptr_t>(cp) >> 2)) & 3u), n);
  const int nv = (n - a0) >> 2;
  const int tail = n - a0 - 4 * nv;
  const float4* vp = reinterpret_cast<const float4*>(cp + a0);
  float4 f[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int q = j * kThreads + t;
    f[j] = q < nv ? __ldg(vp + q) : make_float4(NAN, NAN, NAN, NAN);
  }
  const float fh = t < a0 ? __ldg(cp + t) : NAN;
  const float ft = t < tail ? __ldg(cp + a0 + 4 * nv + t) : NAN;
  // fn(key, offset) for every slot of the thread (key 0: no element); the same slots in every
  // thread, so fn may use warp collectives.
  auto for_each_reg = [&](auto&& fn) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int q = j * kThreads + t;
      const bool in = q < nv;
      fn(in ? rank_key(f[j].x) : 0u, a0 + 4 * q);
      fn(in ? rank_key(f[j].y) : 0u, a0 + 4 * q + 1);
      fn(in ? rank_key(f[j].z) : 0u, a0 + 4 * q + 2);
      fn(in ? rank_key(f[j].w) : 0u, a0 + 4 * q + 3);
    }
    fn(t < a0 ? rank_key(fh) : 0u, t);
    fn(t < tail ? rank_key(ft) : 0u, a0 + 4 * nv + t);
  };

  // Lower bound: the minimum over the warps of the warp's j-th largest thread maximum,
  // j = ceil(k / kWarps), so at least k elements have keys >= it (a slot past the chunk counts as
  // NaN here, which only lowers the bound); also the chunk's maximum.
  float mf = fmaxf(fh, ft);
#pragma unroll
  for (int j = 0; j < kVecs; ++j) mf = fmaxf(mf, fmaxf(fmaxf(f[j].x, f[j].y), fmaxf(f[j].z, f[j].w)));
  uint32_t v = rank_key(mf);  // NaN (no number): kNanKey
  const int jth = (k + kWarps - 1) / kWarps;
  if (jth > 1) {  // bitonic sort of the warp's maxima, descending
#pragma unroll
    for (int size = 2; size <= 32; size <<= 1) {
#pragma unroll
      for (int stride = size >> 1; stride > 0; stride >>= 1) {
        const uint32_t o = __shfl_xor_sync(0xffffffffu, v, stride);
        v = (((lane & stride) == 0) == ((lane & size) == 0)) ? max(v, o) : min(v, o);
      }
    }
  } else {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  const uint32_t wj = __shfl_sync(0xffffffffu, v, jth - 1), wmax = __shfl_sync(0xffffffffu, v, 0);
  if (lane == 0) s.wjth[warp] = wj, s.wmax[warp] = wmax;
  __syncthreads();
  uint32_t lower = UINT_MAX, top = 0;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) lower = min(lower, s.wjth[i]), top = max(top, s.wmax[i]);

  // Survivors (key >= lower) into shared memory as sort keys (warp-aggregated slots).
  auto keep = [&](bool take, uint32_t key, int off) {
    const unsigned mask = __ballot_sync(0xffffffffu, take);
    if (mask == 0) return;
    int base = 0;
    if (lane == 0) base = atomicAdd(&s.num_list, __popc(mask));
    base = __shfl_sync(0xffffffffu, base, 0);
    const int pos = base + __popc(mask & ((1u << lane) - 1u));
    if (take && pos < kListCap) s.sel.list[pos] = sort_key(key, start + off);
  };
  if (lower >= kMinNumberKey) {  // a number: compare the floats (NaN and empty slots fail)
    const float lf = key_value(lower);
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const float4 x = f[j];
      const bool any = fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w)) >= lf;
      if (__any_sync(0xffffffffu, any)) {
        const int off = a0 + 4 * (j * kThreads + t);
        keep(x.x >= lf, rank_key(x.x), off);
        keep(x.y >= lf, rank_key(x.y), off + 1);
        keep(x.z >= lf, rank_key(x.z), off + 2);
        keep(x.w >= lf, rank_key(x.w), off + 3);
      }
    }
    keep(fh >= lf, rank_key(fh), t);
    keep(ft >= lf, rank_key(ft), a0 + 4 * nv + t);
  } else {  // NaN: every element survives
    for_each_reg([&](uint32_t key, int off) { keep(key >= lower && key != 0u, key, off); });
  }
  __syncthreads();
  const int num_list = s.num_list;

  // The chunk's kk best as sort keys in s.sel.sorted[k] (padded with kEmpty).
  if (num_list <= kRankCap) {  // few survivors: each one's rank among them
    if (t < num_list) {
      const unsigned long long x = s.sel.list[t];
      int rank = 0;
#pragma unroll 4
      for (int j = 0; j < num_list; ++j) rank += s.sel.list[j] < x;
      if (rank < kk) s.sel.sorted[rank] = x;
    }
  } else {
    if (num_list <= kListCap) {  // radix select over the survivors
      select_chunk(
          [&](auto&& fn) {
            for (int i = t; i < num_list; i += kThreads) {
              const unsigned long long e = s.sel.list[i];
              fn(~static_cast<uint32_t>(e >> 32), static_cast<int>(static_cast<uint32_t>(e)) - start);
            }
          },
          lower, top, kk, start, s);
    } else {  // many ties or a flat chunk: radix select over all the chunk's keys
      for_each_reg([&](uint32_t key, int off) {
        if (key != 0u) s.sel.keys[off] = key;
      });
      __syncthreads();
      select_chunk(
          [&](auto&& fn) {
            for (int i = t; i < n; i += kThreads) fn(s.sel.keys[i], i);
          },
          lower, top, kk, start, s);
    }
    if (t < kk) {
      const unsigned long long x = s.sel.cand[t];
      int rank = 0;
      for (int j = 0; j < kk; ++j) rank += s.sel.cand[j] < x;
      s.sel.sorted[rank] = x;
    }
  }
  if (t >= kk && t < k) s.sel.sorted[t] = kEmpty;
  __syncthreads();
  if (chunks == 1) {
    write_row(s.sel.sorted, row_logits, k, multiplier, softcap, ids + static_cast<int64_t>(row) * k,
              unary + static_cast<int64_t>(row) * k);
    return;
  }
  unsigned long long* part = partials + static_cast<int64_t>(row) * chunks * k;
  if (t < k) part[chunk * k + t] = s.sel.sorted[t];
  __threadfence();
  __syncthreads();
  if (t == 0) s.last = atomicAdd(counters + row, 1) == chunks - 1;
  __syncthreads();
  if (!s.last) return;
  __threadfence();

  // The last CTA of the row: pairwise merges of the sorted lists (a power of two of them, padded
  // with empty lists), each entry placed at its position in the merge by a binary search in the
  // partner list (stable: the left list first on equal entries, which only the empty ones are).
  int lists = 1;
  while (lists < chunks) lists <<= 1;
  unsigned long long* src = s.merge.a;
  unsigned long long* dst = s.merge.b;
  for (int i = t; i < lists * k; i += kThreads) src[i] = i < chunks * k ? __ldcg(part + i) : kEmpty;
  __syncthreads();
  for (; lists > 1; lists >>= 1) {
    for (int i = t; i < lists * k; i += kThreads) {
      const int list = i / k, pos = i - list * k;
      const unsigned long long x = src[i];
      const unsigned long long* other = src + (list ^ 1) * k;
      const bool right = list & 1;
      int lo = 0, hi = k;  // entries of other before x: < x (left list), <= x (right list)
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (right ? other[mid] <= x : other[mid] < x) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      if (pos + lo < k) dst[(list >> 1) * k + pos + lo] = x;
    }
    __syncthreads();
    unsigned long long* tmp = src;
    src = dst;
    dst = tmp;
  }
  write_row(src, row_logits, k, multiplier, softcap, ids + static_cast<int64_t>(row) * k,
            unary + static_cast<int64_t>(row) * k);
  if (t == 0) counters[row] = 0;  // ready for the next launch (stream-ordered)
}

// ---------------------------------------------------------------------------------------------
// Launch shape: a function of (rows, vocab, k) only

struct Plan {
  int64_t chunks, chunk_len;
};

bool valid_shape(int64_t vocab, int64_t k) { return k >= 1 && k <= kTopkMaxK && k <= vocab && vocab <= kTopkMaxVocab; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// About kTargetCtas CTAs in all (chunks of kMinChunk..kMaxChunk elements, a multiple of 4 so
// every chunk of a row has the same alignment), with lists x K <= kMaxMerge for the merge.
Plan plan_of(int64_t rows, int64_t vocab, int64_t k) {
  int64_t max_lists = 1;
  while (max_lists * 2 * k <= kMaxMerge) max_lists *= 2;
  const int64_t fewest = ceil_div(vocab, kMaxChunk);
  const int64_t most = std::max(fewest, std::min(max_lists, ceil_div(vocab, kMinChunk)));
  const int64_t want = ceil_div(kTargetCtas, rows);
  int64_t chunks = std::min(std::max(want, fewest), most);
  const int64_t len = ceil_div(ceil_div(vocab, chunks), 4) * 4;
  chunks = ceil_div(vocab, len);
  return Plan{chunks, len};
}

}  // namespace

size_t topk_workspace_bytes(int64_t rows, int64_t vocab, int64_t k) {
  if (rows <= 0 || !valid_shape(vocab, k)) return 0;
  const Plan p = plan_of(rows, vocab, k);
  return p.chunks > 1 ? static_cast<size_t>(rows * p.chunks * k) * sizeof(unsigned long long) : 0;
}

cudaError_t topk_candidates(const float* logits, int64_t rows, int64_t vocab, int64_t k, float multiplier,
                            float softcap, int32_t* ids, float* unary, void* workspace, size_t workspace_bytes,
                            int32_t* counters, cudaStream_t stream) {
  if (rows < 0 || !valid_shape(vocab, k) || counters == nullptr) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (logits == nullptr || ids == nullptr || unary == nullptr || (reinterpret_cast<uintptr_t>(logits) & 3) != 0) {
    return cudaErrorInvalidValue;
  }
  const Plan p = plan_of(rows, vocab, k);
  const size_t need = topk_workspace_bytes(rows, vocab, k);
  const bool ws_ok = workspace != nullptr && (reinterpret_cast<uintptr_t>(workspace) & 7) == 0;
  if (need > workspace_bytes || (need > 0 && !ws_ok)) return cudaErrorInvalidValue;
  if (rows * p.chunks > INT_MAX) return cudaErrorInvalidValue;
  const cudaError_t e =
      detail::launch(&topk_kernel, dim3(static_cast<unsigned>(rows * p.chunks)), dim3(kThreads), 0, stream, logits,
                     static_cast<int>(vocab), static_cast<int>(k), static_cast<int>(p.chunks),
                     static_cast<int>(p.chunk_len), multiplier, softcap, ids, unary,
                     static_cast<unsigned long long*>(workspace), counters);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
