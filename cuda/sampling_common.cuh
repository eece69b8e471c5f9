// Per-row sampling machinery shared by sample (sampling.cu), accept_drafts (accept.cu),
// accept_candidates (accept_candidates.cu) and sample_drafts (sample_drafts.cu): one block of
// kThreads threads works on one row of fp32 logits [V] in a few passes over it.
//   1. max pass: the row's max logit, and the first token of the CPU order other than an
//      excluded one (the draft being judged).
//   2. the kept set of top-k, then top-p on the top-k renormalised distribution, in the CPU's
//      order (logit desc, id asc; cpu_sampling.cpp), found exactly and deterministically:
//      a histogram of y = (max - logit) * scale (bin 0: y < 2^-10; bins 1..2048: 1/128 binade of
//      y in [2^-10, 64); bin 2049: y >= 64, or -inf) weighted by 1 (top-k) or by
//      exp(z - z_max) in 2^-40 fixed point (top-p; integer atomics, so the sums do not depend
//      on the order of the additions) finds the bin holding the cut; the tokens of all bins up
//      to it (or of that bin alone) are compacted into shared memory, sorted (bitonic) and cut
//      exactly there. A bin of more than kListCap tokens falls back to an exact radix select
//      on the logit's bits (11/11/10) and a scan by id through the tied logits.
//   3. Gumbel-max over the kept set: score = z + g, z = (logit - max) / T,
//      g = -log(-log(u)), u = philox_uniform(seed, position, token, kStreamTargetSample),
//      ties to the lower id. Only tokens with z >= s_ref - kGumbelMax can win (s_ref: the score
//      of the most likely kept token; g is bounded for u < 1), so Philox runs on few tokens.
// Passes over the row: greedy 1; T > 0 without filters 2; top-k and/or top-p 3 in the common
// case (the kept tokens fit in shared memory), 4 when only the cut's bin fits, more in the
// fallback.
#pragma once

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "common/philox.h"
#include "cuda/kernels.h"

namespace dflash {
namespace cuda {
namespace sampling {

constexpr int kThreads = 1024;  // one block per row; the block functions assume exactly this
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 2050;
constexpr int kBinsPerThread = (kBins + kThreads - 1) / kThreads;
constexpr int kListCap = 2048;  // tokens sorted in shared memory (a power of two)
constexpr int kLoadUnroll = 4;  // float4 loads in flight per thread (8 in the argmax pass)
// -log(-log(u)) <= 16.64 for u <= 1 - 2^-24 (philox_uniform's values below 1): a token with
// z < s - kGumbelMax scores below s.
constexpr float kGumbelMax = 16.7f;
constexpr float kMassScale = 1099511627776.0f;  // 2^40: fixed point of exp(z - z_max) <= 1
constexpr int kNoToken = 0x7fffffff;

struct SampleSmem {
  union {
    unsigned long long mass[kBins];  // histogram weights (also the radix histograms)
    struct {  // the same weights while a pass accumulates them: native 32-bit atomics, with
      unsigned int lo[kBins];  // the carry of the low word added to the high word (64-bit
      unsigned int hi[kBins];  // shared-memory atomics compile to compare-and-swap loops)
    } part;
  } w;
  unsigned int count[kBins];  // histogram token counts (top-p)
  unsigned long long list[kListCap];  // sort keys (~key << 32 | id), ascending = CPU order
  unsigned long long red64[kWarps + 1];
  float redf[kWarps];
  float arg_v[kWarps];
  int arg_i[kWarps];
  int cross_bin;
  unsigned long long cross_above, cross_count_before, cross_count_bin;
  int list_size;
  int found;
};

// The kept set when list_size < 0: tokens with key > cut.key, or key == cut.key and
// id <= cut.id (key = ordered bits of the logit). When list_size >= 0: list[0, list_size).
struct Cut {
  uint32_t key;
  int32_t id;
};
__device__ __forceinline__ Cut keep_all() { return Cut{0u, kNoToken}; }

struct Kept {
  Cut cut;
  int list_size;
};

struct Row {
  const float* logits;  // [vocab]
  int vocab;
  float lmax;   // max logit
  float inv_t;  // 1 / temperature
};

struct Draw {
  int token;         // -1: no candidate (the kept set held only the excluded token)
  float p_excluded;  // p(excluded) under the kept distribution (0 when not kept or not asked)
};

// ---------------------------------------------------------------------------------------------
// Keys, bins, weights

// Monotone map of a float to uint32 (-0 counted as +0, as the CPU's == does).
__device__ __forceinline__ uint32_t okey(float x) {
  const uint32_t b = __float_as_uint(x + 0.0f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float okey_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ bool is_kept(const Cut& c, uint32_t key, int id) {
  return key > c.key || (key == c.key && id <= c.id);
}

__device__ __forceinline__ unsigned long long sort_key(uint32_t key, int id) {
  return (static_cast<unsigned long long>(~key) << 32) | static_cast<uint32_t>(id);
}
__device__ __forceinline__ int list_id(unsigned long long e) { return static_cast<int>(static_cast<uint32_t>(e)); }
__device__ __forceinline__ uint32_t list_key(unsigned long long e) { return ~static_cast<uint32_t>(e >> 32); }

// Histogram bin of a logit: non-decreasing as the logit decreases.
__device__ __forceinline__ int y_bin(float lmax, float logit, float scale) {
  const float y = (lmax - logit) * scale;
  if (!(y < 64.0f)) return kBins - 1;
  if (y < 0.0009765625f) return 0;                                        // 2^-10
  return 1 + static_cast<int>((__float_as_uint(y) - 0x3A800000u) >> 16);  // bits(2^-10)
}

__device__ __forceinline__ unsigned long long mass_weight(const Row& r, float logit) {
  return __float2ull_rn(expf((logit - r.lmax) * r.inv_t) * kMassScale);
}

// -log(-log(u)), u = philox_uniform(seed, position, id, stream) (the target-sampling stream unless
// asked otherwise: sample_drafts draws on kStreamDraftSample).
__device__ __forceinline__ float gumbel_noise(uint64_t seed, uint64_t position, int id,
                                             uint32_t stream = kStreamTargetSample) {
  const float u = philox_uniform(seed, position, static_cast<uint32_t>(id), stream);
  return -logf(-logf(u));
}

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

// ---------------------------------------------------------------------------------------------
// Block-wide reductions and scans (every thread calls them; results go to every thread)

__device__ __forceinline__ float block_max(float v, SampleSmem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) s.redf[warp] = v;
  __syncthreads();
  v = s.redf[lane];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ unsigned long long block_add(unsigned long long v, SampleSmem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) s.red64[warp] = v;
  __syncthreads();
  v = s.red64[lane];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float block_add(float v, SampleSmem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) s.redf[warp] = v;
  __syncthreads();
  v = s.redf[lane];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Exclusive prefix sum over the threads in order; *total = the sum of all.
__device__ __forceinline__ unsigned long long block_exclusive_sum(unsigned long long v,
                                                                  unsigned long long* total,
                                                                  SampleSmem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  __syncthreads();
  if (lane == 31) s.red64[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const unsigned long long w = s.red64[lane];
    unsigned long long wi = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long t = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += t;
    }
    s.red64[lane] = wi - w;
    if (lane == 31) s.red64[kWarps] = wi;
  }
  __syncthreads();
  *total = s.red64[kWarps];
  return s.red64[warp] + incl - v;
}

__device__ __forceinline__ void block_argmax(float* v, int* i, SampleSmem& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float bv = *v;
  int bi = *i;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  __syncthreads();
  if (lane == 0) s.arg_v[warp] = bv, s.arg_i[warp] = bi;
  __syncthreads();
  bv = s.arg_v[lane];
  bi = s.arg_i[lane];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  *v = bv;
  *i = bi;
}

// Adds w to bin b of the histogram being accumulated (exact: the thread whose addition wraps the
// low word carries into the high word).
__device__ __forceinline__ void add_weight(unsigned int* lo_words, unsigned int* hi_words, int b,
                                           unsigned long long w) {
  const unsigned int lo = static_cast<unsigned int>(w);
  const unsigned int old = atomicAdd(&lo_words[b], lo);
  const unsigned int hi = static_cast<unsigned int>(w >> 32) + (old + lo < old ? 1u : 0u);
  if (hi != 0) atomicAdd(&hi_words[b], hi);
}

__device__ __forceinline__ void clear_weights(SampleSmem& s, int num_bins) {
  for (int b = threadIdx.x; b < num_bins; b += kThreads) s.w.part.lo[b] = 0, s.w.part.hi[b] = 0;
}

// Turns the accumulated lo/hi words of bins [0, num_bins) into s.w.mass (in place).
__device__ __forceinline__ void combine_weights(SampleSmem& s, int num_bins) {
  unsigned long long v[kBinsPerThread];
  __syncthreads();  // the accumulation is complete
#pragma unroll
  for (int k = 0; k < kBinsPerThread; ++k) {
    const int b = threadIdx.x + k * kThreads;
    v[k] = b < num_bins ? (static_cast<unsigned long long>(s.w.part.hi[b]) << 32) | s.w.part.lo[b] : 0;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kBinsPerThread; ++k) {
    const int b = threadIdx.x + k * kThreads;
    if (b < num_bins) s.w.mass[b] = v[k];
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// Passes over a row

// Calls f(token, logit, valid) on every logit of the row, 16-byte loads when the row allows;
// every thread makes the same number of calls (valid = false past the end), so f may use
// warp-wide intrinsics.
template <int kUnroll = kLoadUnroll, typename F>
__device__ __forceinline__ void for_each_logit(const float* row, int vocab, F&& f) {
  if ((reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    const int n4 = vocab >> 2;
    const float4* r4 = reinterpret_cast<const float4*>(row);
    for (int base = 0; base < n4; base += kThreads * kUnroll) {
      float4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = base + u * kThreads + static_cast<int>(threadIdx.x);
        v[u] = j < n4 ? __ldg(r4 + j) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = base + u * kThreads + static_cast<int>(threadIdx.x);
        const bool ok = j < n4;
        f(4 * j, v[u].x, ok);
        f(4 * j + 1, v[u].y, ok);
        f(4 * j + 2, v[u].z, ok);
        f(4 * j + 3, v[u].w, ok);
      }
    }
    if (4 * n4 < vocab) {  // the last vocab % 4 logits
      const int i = 4 * n4 + static_cast<int>(threadIdx.x);
      f(i, i < vocab ? __ldg(row + i) : 0.0f, i < vocab);
    }
  } else {
    for (int base = 0; base < vocab; base += kThreads) {
      const int i = base + static_cast<int>(threadIdx.x);
      f(i, i < vocab ? __ldg(row + i) : 0.0f, i < vocab);
    }
  }
}

// argmax with the lowest id among equal maxima (std::max_element).
__device__ inline int row_argmax(const float* row, int vocab, SampleSmem& s) {
  float bv = -INFINITY;
  int bi = kNoToken;
  for_each_logit<8>(row, vocab, [&](int i, float l, bool ok) {
    if (ok && better(l, i, bv, bi)) bv = l, bi = i;
  });
  block_argmax(&bv, &bi, s);
  return bi == kNoToken ? 0 : bi;
}

// The max logit, and the first token of the CPU order other than `excluded` (argmax, lowest id).
__device__ inline void row_max(const float* row, int vocab, int excluded, float* lmax,
                               float* lmax_other, int* id_other, SampleSmem& s) {
  float m = -INFINITY, mo = -INFINITY;
  int io = kNoToken;
  for_each_logit(row, vocab, [&](int i, float l, bool ok) {
    if (!ok) return;
    m = fmaxf(m, l);
    if (i != excluded && better(l, i, mo, io)) mo = l, io = i;
  });
  *lmax = block_max(m, s);
  block_argmax(&mo, &io, s);
  *lmax_other = mo;
  *id_other = io;
}

// Histogram of the tokens kept by `cut` over the kBins bins of y = (max - logit) * scale,
// weighted by 1 (by_mass = false: w.mass[] holds counts) or by mass_weight (count[] holds
// counts). Bins 0 and kBins - 1 (ties at the max, the far tail) are summed in registers, the
// others with shared-memory atomics. Returns the total weight.
__device__ inline unsigned long long histogram(const Row& r, const Cut& cut, bool by_mass,
                                               float scale, SampleSmem& s) {
  clear_weights(s, kBins);
  for (int b = threadIdx.x; b < kBins; b += kThreads) s.count[b] = 0;
  __syncthreads();
  unsigned long long m_first = 0, m_last = 0, total = 0;
  unsigned int c_first = 0, c_last = 0;
  for_each_logit(r.logits, r.vocab, [&](int i, float l, bool ok) {
    if (!ok || !is_kept(cut, okey(l), i)) return;
    const int b = y_bin(r.lmax, l, scale);
    const unsigned long long w = by_mass ? mass_weight(r, l) : 1ull;
    total += w;
    if (b == 0) {
      m_first += w, ++c_first;
    } else if (b == kBins - 1) {
      m_last += w, ++c_last;
    } else {
      add_weight(s.w.part.lo, s.w.part.hi, b, w);
      if (by_mass) atomicAdd(&s.count[b], 1u);
    }
  });
  m_first = block_add(m_first, s);
  m_last = block_add(m_last, s);
  const unsigned long long cf = block_add(static_cast<unsigned long long>(c_first), s);
  const unsigned long long cl = block_add(static_cast<unsigned long long>(c_last), s);
  total = block_add(total, s);
  combine_weights(s, kBins);
  if (threadIdx.x == 0) {
    s.w.mass[0] = m_first;
    s.w.mass[kBins - 1] = m_last;
    s.count[0] = static_cast<unsigned int>(cf);
    s.count[kBins - 1] = static_cast<unsigned int>(cl);
  }
  __syncthreads();
  return total;
}

struct Crossing {
  int bin;                         // -1: the total weight is below the target
  unsigned long long above;        // weight of the bins before it
  unsigned long long count_before;  // tokens in the bins before it
  unsigned long long count_bin;    // tokens in it
};

// The first bin b of mass[0, num_bins) where the cumulative weight reaches target.
// Counts come from count[] (with_counts, top-p) or equal the weights (top-k, radix levels).
__device__ inline Crossing find_crossing(int num_bins, unsigned long long target, bool with_counts,
                                         SampleSmem& s) {
  unsigned long long m[kBinsPerThread], c[kBinsPerThread], msum = 0, csum = 0;
  const int b0 = threadIdx.x * kBinsPerThread;
#pragma unroll
  for (int k = 0; k < kBinsPerThread; ++k) {
    const int b = b0 + k;
    m[k] = b < num_bins ? s.w.mass[b] : 0;
    c[k] = b < num_bins ? (with_counts ? s.count[b] : s.w.mass[b]) : 0;
    msum += m[k];
    csum += c[k];
  }
  unsigned long long mtotal, ctotal;
  unsigned long long before = block_exclusive_sum(msum, &mtotal, s);
  unsigned long long cbefore = block_exclusive_sum(csum, &ctotal, s);
  if (threadIdx.x == 0) s.cross_bin = -1;
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kBinsPerThread; ++k) {
    if (before < target && before + m[k] >= target) {
      s.cross_bin = b0 + k;
      s.cross_above = before;
      s.cross_count_before = cbefore;
      s.cross_count_bin = c[k];
    }
    before += m[k];
    cbefore += c[k];
  }
  __syncthreads();
  return Crossing{s.cross_bin, s.cross_above, s.cross_count_before, s.cross_count_bin};
}

__device__ inline unsigned long long top_p_target(float top_p, unsigned long long total) {
  double t = ceil(static_cast<double>(top_p) * static_cast<double>(total));
  if (t > static_cast<double>(total)) t = static_cast<double>(total);
  return t < 1.0 ? 1ull : static_cast<unsigned long long>(t);
}

// The histogram bin where the cumulative weight of the kept tokens reaches target (top-p: the
// target is top_p of the total weight). *total: the total weight.
__device__ inline Crossing locate(const Row& r, const Cut& cut, bool by_mass, float scale,
                                  float top_p, unsigned long long target, unsigned long long* total,
                                  SampleSmem& s) {
  *total = histogram(r, cut, by_mass, scale, s);
  if (by_mass) target = top_p_target(top_p, *total);
  return find_crossing(kBins, target, by_mass, s);
}

// Appends the sort keys of the tokens kept by `cut` with bin in [lo_bin, hi_bin] to s.list
// (warp-aggregated slots; the order is undone by the sort). Returns their number.
__device__ inline int compact(const Row& r, const Cut& cut, float scale, int lo_bin, int hi_bin,
                              SampleSmem& s) {
  __syncthreads();  // s.list_size may still be read
  if (threadIdx.x == 0) s.list_size = 0;
  __syncthreads();
  const unsigned lane = threadIdx.x & 31;
  for_each_logit(r.logits, r.vocab, [&](int i, float l, bool ok) {
    const uint32_t key = okey(l);
    bool take = false;
    if (ok && is_kept(cut, key, i)) {
      const int b = y_bin(r.lmax, l, scale);
      take = b >= lo_bin && b <= hi_bin;
    }
    const unsigned mask = __ballot_sync(0xffffffffu, take);
    if (mask == 0) return;
    int base = 0;
    if (lane == 0) base = atomicAdd(&s.list_size, __popc(mask));
    base = __shfl_sync(0xffffffffu, base, 0);
    if (take) {
      const int pos = base + __popc(mask & ((1u << lane) - 1u));
      if (pos < kListCap) s.list[pos] = sort_key(key, i);
    }
  });
  __syncthreads();
  return min(s.list_size, kListCap);
}

// Sorts s.list[0, n) ascending (bitonic over the next power of two, padded with ~0).
__device__ inline void sort_list(int n, SampleSmem& s) {
  int p = 1;
  while (p < n) p <<= 1;
  for (int i = n + threadIdx.x; i < p; i += kThreads) s.list[i] = ~0ull;
  __syncthreads();
  for (int k = 2; k <= p; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < p; i += kThreads) {
        const int ixj = i ^ j;
        if (ixj > i) {
          const unsigned long long a = s.list[i], b = s.list[ixj];
          if ((a > b) == ((i & k) == 0)) s.list[i] = b, s.list[ixj] = a;
        }
      }
      __syncthreads();
    }
  }
}

// The first index j of the sorted list[0, n) where start + the cumulative mass reaches target
// (n - 1 if it never does).
__device__ inline int list_mass_crossing(const Row& r, int n, unsigned long long start,
                                         unsigned long long target, SampleSmem& s) {
  const int i0 = 2 * threadIdx.x;
  const unsigned long long w0 = i0 < n ? mass_weight(r, okey_value(list_key(s.list[i0]))) : 0;
  const unsigned long long w1 = i0 + 1 < n ? mass_weight(r, okey_value(list_key(s.list[i0 + 1]))) : 0;
  unsigned long long total;
  const unsigned long long before = start + block_exclusive_sum(w0 + w1, &total, s);
  if (threadIdx.x == 0) s.found = n - 1;
  __syncthreads();
  if (i0 < n && before < target && before + w0 >= target) s.found = i0;
  if (i0 + 1 < n && before + w0 < target && before + w0 + w1 >= target) s.found = i0 + 1;
  __syncthreads();
  return s.found;
}

// The total mass of the sorted list[0, n).
__device__ inline unsigned long long list_mass(const Row& r, int n, SampleSmem& s) {
  unsigned long long m = 0;
  for (int i = threadIdx.x; i < n; i += kThreads) m += mass_weight(r, okey_value(list_key(s.list[i])));
  return block_add(m, s);
}


// The id of the need-th token (in id order) with ordered key `key` kept by `prev`.
__device__ inline int tie_id(const Row& r, uint32_t key, const Cut& prev, unsigned long long need,
                             SampleSmem& s) {
  __syncthreads();  // s.found may still be read
  if (threadIdx.x == 0) s.found = kNoToken;
  unsigned long long run = 0;
  for (int base = 0; base < r.vocab; base += kThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    bool f = false;
    if (i < r.vocab) {
      const uint32_t k = okey(__ldg(r.logits + i));
      f = k == key && is_kept(prev, k, i);
    }
    unsigned long long total;
    const unsigned long long before = block_exclusive_sum(f ? 1ull : 0ull, &total, s);
    if (f && run + before + 1 == need) s.found = i;
    run += total;
    if (run >= need) break;  // uniform: total is the same in every thread
  }
  __syncthreads();
  return s.found;
}

// Fallback of the cut inside one histogram bin holding more than kListCap tokens: radix select
// on the ordered logit bits among the tokens kept by `prev` in `bin`, then ties by id.
__device__ inline Cut radix_cut(const Row& r, const Cut& prev, float scale, int bin, bool by_mass,
                                unsigned long long above, unsigned long long target, SampleSmem& s) {
  uint32_t prefix = 0, mask = 0;
  unsigned long long eq_weight = 0;
  for (int level = 0; level < 3; ++level) {
    const int shift = level == 0 ? 21 : (level == 1 ? 10 : 0);  // digits of 11, 11, 10 bits
    const int nb = level == 2 ? 1024 : 2048;
    clear_weights(s, nb);
    __syncthreads();
    for_each_logit(r.logits, r.vocab, [&](int i, float l, bool ok) {
      if (!ok) return;
      const uint32_t key = okey(l);
      if ((key & mask) != prefix || !is_kept(prev, key, i) || y_bin(r.lmax, l, scale) != bin) return;
      const int digit = static_cast<int>((key >> shift) & static_cast<uint32_t>(nb - 1));
      add_weight(s.w.part.lo, s.w.part.hi, nb - 1 - digit, by_mass ? mass_weight(r, l) : 1ull);  // larger keys first
    });
    combine_weights(s, nb);
    const Crossing c = find_crossing(nb, target - above, false, s);
    if (c.bin < 0) return prev;  // not reached: cannot happen when the bin holds the cut
    eq_weight = s.w.mass[c.bin];
    above += c.above;
    prefix |= static_cast<uint32_t>(nb - 1 - c.bin) << shift;
    mask |= static_cast<uint32_t>(nb - 1) << shift;
    __syncthreads();  // s.mass is cleared by the next level
  }
  const unsigned long long w = by_mass ? mass_weight(r, okey_value(prefix)) : 1ull;
  const unsigned long long need = (target - above + w - 1) / w;  // tied tokens to keep, >= 1
  if (need >= eq_weight / w) return Cut{prefix, prefix == prev.key ? prev.id : kNoToken};
  return Cut{prefix, tie_id(r, prefix, prev, need, s)};
}

// The kept set of top-k then top-p (see the file comment).
__device__ inline Kept select_kept(const Row& r, int top_k, float top_p, SampleSmem& s) {
  Kept kept{keep_all(), -1};
  if (top_k > 0 && top_k < r.vocab) {
    const unsigned long long k = static_cast<unsigned long long>(top_k);
    unsigned long long total;
    const Crossing c = locate(r, keep_all(), false, 1.0f, 1.0f, k, &total, s);
    if (c.bin >= 0) {
      if (c.count_before + c.count_bin <= kListCap) {
        sort_list(compact(r, keep_all(), 1.0f, 0, c.bin, s), s);
        kept.list_size = top_k;
      } else if (c.count_bin <= kListCap) {
        sort_list(compact(r, keep_all(), 1.0f, c.bin, c.bin, s), s);
        const unsigned long long e = s.list[k - c.above - 1];
        kept.cut = Cut{list_key(e), list_id(e)};
      } else {
        kept.cut = radix_cut(r, keep_all(), 1.0f, c.bin, false, c.above, k, s);
      }
    }
  }
  if (top_p < 1.0f) {
    if (kept.list_size >= 0) {
      const unsigned long long target = top_p_target(top_p, list_mass(r, kept.list_size, s));
      kept.list_size = list_mass_crossing(r, kept.list_size, 0, target, s) + 1;
    } else {
      unsigned long long total;
      const Crossing c = locate(r, kept.cut, true, r.inv_t, top_p, 0, &total, s);
      const unsigned long long target = top_p_target(top_p, total);
      if (c.bin >= 0) {
        if (c.count_before + c.count_bin <= kListCap) {
          const int n = compact(r, kept.cut, r.inv_t, 0, c.bin, s);
          sort_list(n, s);
          kept.list_size = list_mass_crossing(r, n, 0, target, s) + 1;
        } else if (c.count_bin <= kListCap) {
          const int n = compact(r, kept.cut, r.inv_t, c.bin, c.bin, s);
          sort_list(n, s);
          const unsigned long long e = s.list[list_mass_crossing(r, n, c.above, target, s)];
          kept.cut = Cut{list_key(e), list_id(e)};
        } else {
          kept.cut = radix_cut(r, kept.cut, r.inv_t, c.bin, true, c.above, target, s);
        }
      }
    }
  }
  return kept;
}

// Gumbel-max over the kept set without `excluded` (-1: none); with_p: also p(excluded).
// (lmax_other, id_other): the first token of the CPU order other than `excluded`. The noise is
// drawn on `stream` (the target-sampling stream but for sample_drafts).
__device__ inline Draw gumbel_draw(const Row& r, const Kept& kept, int excluded, float lmax_other,
                                   int id_other, uint64_t seed, uint64_t position, bool with_p,
                                   SampleSmem& s, uint32_t stream = kStreamTargetSample) {
  float bv = -INFINITY, sum = 0.0f, e_excluded = 0.0f;
  int bi = kNoToken;
  auto visit = [&](int i, float l, bool maybe_best) {
    const float z = (l - r.lmax) * r.inv_t;
    if (with_p) {
      const float e = expf(z);
      sum += e;
      if (i == excluded) e_excluded = e;
    }
    if (i != excluded && maybe_best) {
      const float score = z + gumbel_noise(seed, position, i, stream);
      if (better(score, i, bv, bi)) bv = score, bi = i;
    }
  };
  if (kept.list_size >= 0) {
    for (int j = threadIdx.x; j < kept.list_size; j += kThreads) {
      const unsigned long long e = s.list[j];
      visit(list_id(e), okey_value(list_key(e)), true);
    }
  } else {
    // Token id_other is kept whenever the set holds a token other than `excluded` (the kept set
    // is a prefix of the order), so the winner scores at least its score s_ref, and at least the
    // best score seen so far: only tokens with z >= that - kGumbelMax need their noise.
    float s_ref = -INFINITY;
    if (id_other != kNoToken) {
      s_ref = (lmax_other - r.lmax) * r.inv_t + gumbel_noise(seed, position, id_other, stream);
      if (!(s_ref < INFINITY)) s_ref = -INFINITY;  // u == 1: no pruning
    }
    for_each_logit(r.logits, r.vocab, [&](int i, float l, bool ok) {
      if (ok && is_kept(kept.cut, okey(l), i)) {
        visit(i, l, (l - r.lmax) * r.inv_t >= fmaxf(s_ref, bv) - kGumbelMax);
      }
    });
  }
  block_argmax(&bv, &bi, s);
  Draw d{bi == kNoToken ? -1 : bi, 0.0f};
  if (with_p) {
    sum = block_add(sum, s);
    e_excluded = block_add(e_excluded, s);
    d.p_excluded = sum > 0.0f ? e_excluded / sum : 0.0f;
  }
  return d;
}

__device__ __forceinline__ uint64_t seed_of(const SampleRow& p) {
  return (static_cast<uint64_t>(p.seed_hi) << 32) | p.seed_lo;  // SampleRow::seed() on the device
}

// One draw from row `logits` [vocab] at temperature > 0 with top-k / top-p, without `excluded`.
__device__ inline Draw draw_row(const float* logits, int vocab, const SampleRow& p,
                                int64_t position, int excluded, bool with_p, SampleSmem& s) {
  Row r{logits, vocab, 0.0f, 1.0f / p.temperature};
  float lmax_other;
  int id_other;
  row_max(logits, vocab, excluded, &r.lmax, &lmax_other, &id_other, s);
  const Kept kept = select_kept(r, p.top_k, p.top_p, s);
  return gumbel_draw(r, kept, excluded, lmax_other, id_other, seed_of(p),
                     static_cast<uint64_t>(position), with_p, s);
}

}  // namespace sampling
}  // namespace cuda
}  // namespace dflash
