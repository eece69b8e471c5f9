// Acceptance of drafts drawn from the drafter's proposal rows (exact rejection sampling with a
// proposal q; host reference accept_candidates_request in backend/cpu/host_candidates.cpp).
// Row j < n of request r at T > 0: p = the target row's temperature / top-k / top-p distribution
// (sampling_common.cuh's kept set), q = softmax(realized[r, j, :] / T) over cand_ids[r, j, :]
// (K <= kMaxCand candidates) or over the whole vocabulary (cand_ids == nullptr, K == V). The draft
// x is accepted iff q(x) > 0 and u q(x) < p(x), u = philox_uniform(seed, position + j, 0,
// kStreamAccept); on rejection the correction is the Gumbel-max draw (target-sampling stream) from
// norm(max(p - q, 0)) over the kept set, from p when that is all zero; row n draws the bonus from
// p. T <= 0 rows: accept_drafts' greedy rule. As in accept.cu each row's outcome is a pure
// function of the row, so few requests run a cluster of kCluster blocks per request (rows in
// parallel, then a walk in order through distributed shared memory) and many requests one block
// per request (rows in order up to the first rejection).
//
// Scores live in log space relative to the target row's max, z_i = (logit_i - max) / T, so
// log p_i = z_i - log S with S = sum of exp(z) over the kept set. With c_i = log q_i + log S
// (q's mass in the same units), the test u q(x) < p(x) reads log u + c_x < z_x and the residual's
// log mass is log(S max(p_i - q_i, 0)) = z_i + log(-expm1(c_i - z_i)) when c_i < z_i (-inf
// otherwise): accurate when p_i and q_i nearly cancel, and free of underflow for tiny p_i. A
// token with q_i = 0 keeps z_i. Since the residual's log mass never exceeds z_i, the pruning of
// sampling_common.cuh (only tokens with z >= s - kGumbelMax can beat a score s) stays exact with s
// taken from actual residual scores: the likeliest token's, then each thread's best so far.
#include <cooperative_groups.h>

#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/sampling_common.cuh"

namespace dflash {
namespace cuda {

namespace {

constexpr int kCluster = 8;          // blocks per request in the cluster kernel
constexpr int kRowsPerBlock = 4;     // so up to kCluster * kRowsPerBlock = 32 rows (n <= 31)
constexpr int kClusterMaxSeqs = 16;  // 128 blocks: one wave on an H200's 132 SMs
constexpr int kMaxCand = 64;         // candidates per row (kTopkMaxK)
constexpr int kHashSlots = 256;      // open-addressing table of a row's candidate ids (load <= 1/4)

using sampling::kNoToken;
using sampling::kThreads;

struct AcceptSmem {
  sampling::SampleSmem s;
  int32_t cand_id[kMaxCand];      // the row's candidate ids
  float cand_logq[kMaxCand];      // log q of each candidate
  int32_t slot_id[kHashSlots];    // hash table: token id ...
  int32_t slot_cand[kHashSlots];  // ... -> candidate index + 1 (0: empty slot)
  int found;
};

// The proposal q of one row: log q_i = (realized_i - rmax) / T - log_norm (NaN: -inf), or a
// one-hot at index one_hot when the row has no finite max (the host's `proposal`). Dense rows
// (K == V, column i = token i) read realized; candidate rows keep log q in AcceptSmem.
struct Proposal {
  const float* realized;  // [K]
  int k;
  float inv_t;
  float rmax;
  float log_norm;
  int one_hot;  // >= 0: q is one-hot at this index; -1 otherwise
};

struct Outcome {
  int token;  // the token emitted when the walk stops at this row
  int ends;   // 1: the walk stops here (mismatch / rejection / the bonus row)
};

__device__ __forceinline__ int hash_slot(int id) {
  return static_cast<int>((static_cast<uint32_t>(id) * 2654435761u) >> 24);  // kHashSlots = 2^8
}

// The index of candidate `id` in the row's candidates (the first if repeated), -1 if none.
__device__ __forceinline__ int cand_index(const AcceptSmem& sm, int id) {
  for (int h = hash_slot(id);; h = (h + 1) & (kHashSlots - 1)) {
    const int c = sm.slot_cand[h];
    if (c == 0) return -1;
    if (sm.slot_id[h] == id) return c - 1;
  }
}

// log q of token `id` (-inf where q is 0).
template <bool kDense>
__device__ __forceinline__ float log_q(const Proposal& q, const AcceptSmem& sm, int id) {
  if (kDense) {
    if (id < 0 || id >= q.k) return -INFINITY;
    if (q.one_hot >= 0) return id == q.one_hot ? 0.0f : -INFINITY;
    const float x = __ldg(q.realized + id);
    return isnan(x) ? -INFINITY : (x - q.rmax) * q.inv_t - q.log_norm;
  }
  const int c = cand_index(sm, id);
  return c < 0 ? -INFINITY : sm.cand_logq[c];
}

struct Stats {
  float max;  // max over the non-NaN entries (-inf if none)
  float sum;  // sum of exp((x - max) * inv_t) over them (meaningful when max is finite)
  int top;    // the lowest index of the max (NaN never wins; 0 when every entry is NaN)
};

// One pass over row [vocab]: max, argmax and the online softmax normaliser. Block-wide.
__device__ inline Stats row_stats(const float* row, int vocab, float inv_t,
                                 sampling::SampleSmem& s) {
  float m = -INFINITY, sum = 0.0f;
  int top = kNoToken;
  sampling::for_each_logit(row, vocab, [&](int i, float x, bool ok) {
    if (!ok) return;
    if (x > m) {
      sum = sum * expf((m - x) * inv_t) + 1.0f;  // m = -inf: 0 * 0
      m = x, top = i;
    } else if (x == m) {
      if (x > -INFINITY) sum += 1.0f;
      if (i < top) top = i;
    } else if (x > -INFINITY) {
      sum += expf((x - m) * inv_t);
    }
  });
  float bm = m;
  int bt = top;
  sampling::block_argmax(&bm, &bt, s);
  const float mine = m == bm ? sum : (m > -INFINITY ? sum * expf((m - bm) * inv_t) : 0.0f);
  return Stats{bm, sampling::block_add(mine, s), bt == kNoToken ? 0 : bt};
}

// The dense proposal of row realized [V].
__device__ inline Proposal dense_proposal(const float* realized, int vocab, float inv_t,
                                          sampling::SampleSmem& s) {
  const Stats st = row_stats(realized, vocab, inv_t, s);
  Proposal q{realized, vocab, inv_t, st.max, 0.0f, -1};
  if (isfinite(st.max)) {
    q.log_norm = logf(st.sum);
  } else {
    q.one_hot = st.top;  // argmax_finite: the first +inf, or 0 when every entry is -inf / NaN
  }
  return q;
}

// The candidate proposal of row ids [K], realized [K] (K <= kMaxCand): log q and the id table
// into shared memory. Block-wide.
__device__ inline Proposal cand_proposal(const int32_t* ids, const float* realized, int k,
                                         float inv_t, AcceptSmem& sm) {
  __syncthreads();  // the previous row's table may still be read
  for (int h = threadIdx.x; h < kHashSlots; h += kThreads) sm.slot_cand[h] = 0;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float x[2];
    float m = -INFINITY;
    float bv = -INFINITY;
    int bi = kNoToken;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = lane + 32 * h;
      x[h] = c < k ? __ldg(realized + c) : NAN;
      m = fmaxf(m, x[h]);  // NaN ignored
      const float v = isnan(x[h]) ? -INFINITY : x[h];
      if (c < k && sampling::better(v, c, bv, bi)) bv = v, bi = c;
      if (c < k) sm.cand_id[c] = __ldg(ids + c);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (sampling::better(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    if (isfinite(m)) {
      float e = 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) e += isnan(x[h]) ? 0.0f : expf((x[h] - m) * inv_t);
      const float log_norm = logf(detail::warp_sum(e));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = lane + 32 * h;
        if (c < k) sm.cand_logq[c] = isnan(x[h]) ? -INFINITY : (x[h] - m) * inv_t - log_norm;
      }
    } else {  // no finite max: one-hot at argmax_finite (the first +inf, or index 0)
      const int hot = bi == kNoToken ? 0 : bi;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = lane + 32 * h;
        if (c < k) sm.cand_logq[c] = c == hot ? 0.0f : -INFINITY;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int c = 0; c < k; ++c) {
      const int id = sm.cand_id[c];
      int h = hash_slot(id);
      while (sm.slot_cand[h] != 0 && sm.slot_id[h] != id) h = (h + 1) & (kHashSlots - 1);
      if (sm.slot_cand[h] == 0) sm.slot_id[h] = id, sm.slot_cand[h] = c + 1;
    }
  }
  __syncthreads();
  return Proposal{realized, k, inv_t, 0.0f, 0.0f, -1};
}

__device__ __forceinline__ bool keeps_all(const sampling::Kept& kept) {
  return kept.list_size < 0 && kept.cut.key == 0u && kept.cut.id == kNoToken;
}

// S = sum of exp(z) over the kept set (sum_all: the same over the whole row).
__device__ inline float kept_sum(const sampling::Row& r, const sampling::Kept& kept, float sum_all,
                                 sampling::SampleSmem& s) {
  if (keeps_all(kept)) return sum_all;
  float sum = 0.0f;
  if (kept.list_size >= 0) {
    for (int j = threadIdx.x; j < kept.list_size; j += kThreads) {
      sum += expf((sampling::okey_value(sampling::list_key(s.list[j])) - r.lmax) * r.inv_t);
    }
  } else {
    sampling::for_each_logit(r.logits, r.vocab, [&](int i, float l, bool ok) {
      if (ok && sampling::is_kept(kept.cut, sampling::okey(l), i)) {
        sum += expf((l - r.lmax) * r.inv_t);
      }
    });
  }
  return sampling::block_add(sum, s);
}

// z of token x when the kept set holds it, else -inf. Block-wide (the same value in every thread).
__device__ inline float kept_z(const sampling::Row& r, const sampling::Kept& kept, int x,
                               AcceptSmem& sm) {
  if (x < 0 || x >= r.vocab) return -INFINITY;
  const float l = __ldg(r.logits + x);
  if (kept.list_size >= 0) {
    __syncthreads();  // sm.found may still be read
    if (threadIdx.x == 0) sm.found = 0;
    __syncthreads();
    for (int j = threadIdx.x; j < kept.list_size; j += kThreads) {
      if (sampling::list_id(sm.s.list[j]) == x) sm.found = 1;
    }
    __syncthreads();
    if (sm.found == 0) return -INFINITY;
  } else if (!sampling::is_kept(kept.cut, sampling::okey(l), x)) {
    return -INFINITY;
  }
  return (l - r.lmax) * r.inv_t;
}

// log(S max(p_i - q_i, 0)) of a kept token with z = z_i and c = log q_i + log S (see the header).
__device__ __forceinline__ float residual_log_mass(float z, float c) {
  if (!(c > -INFINITY)) return z;
  return c < z ? z + logf(-expm1f(c - z)) : -INFINITY;
}

// Gumbel-max over the kept set without `excluded` of the residual log mass + the target-sampling
// noise: the draw from norm(max(p - q, 0)); -1 when the residual is zero. (lmax_top, id_top):
// the likeliest token (kept).
template <bool kDense>
__device__ inline int residual_draw(const sampling::Row& r, const sampling::Kept& kept,
                                    int excluded, float lmax_top, int id_top, float log_s,
                                    const Proposal& q, uint64_t seed, uint64_t position,
                                    AcceptSmem& sm) {
  float bv = -INFINITY;
  int bi = kNoToken;
  auto score_of = [&](int i, float z) {
    if (i == excluded) return -INFINITY;
    const float a = residual_log_mass(z, log_q<kDense>(q, sm, i) + log_s);
    return a > -INFINITY ? a + sampling::gumbel_noise(seed, position, i) : -INFINITY;
  };
  auto visit = [&](int i, float z) {
    const float score = score_of(i, z);
    if (score > -INFINITY && sampling::better(score, i, bv, bi)) bv = score, bi = i;
  };
  if (kept.list_size >= 0) {
    for (int j = threadIdx.x; j < kept.list_size; j += kThreads) {
      const unsigned long long e = sm.s.list[j];
      visit(sampling::list_id(e), (sampling::okey_value(sampling::list_key(e)) - r.lmax) * r.inv_t);
    }
  } else {
    // The winner scores at least any actual residual score: the likeliest token's (if its
    // residual is not zero) and the thread's best so far. A token's score is at most
    // z + kGumbelMax, so only tokens with z >= that bound - kGumbelMax need their noise.
    float s_ref = id_top != kNoToken ? score_of(id_top, (lmax_top - r.lmax) * r.inv_t) : -INFINITY;
    if (!(s_ref < INFINITY)) s_ref = -INFINITY;
    sampling::for_each_logit(r.logits, r.vocab, [&](int i, float l, bool ok) {
      if (!ok || !sampling::is_kept(kept.cut, sampling::okey(l), i)) return;
      const float z = (l - r.lmax) * r.inv_t;
      if (z >= fmaxf(s_ref, bv) - sampling::kGumbelMax) visit(i, z);
    });
  }
  sampling::block_argmax(&bv, &bi, sm.s);
  return bi == kNoToken ? -1 : bi;
}

// The outcome of row j (< n) of a request at T > 0 (kDense: ids is null). Block-wide.
template <bool kDense>
__device__ inline Outcome sampled_row(const float* row, int vocab, const SampleRow& p, int64_t j,
                                      int draft, const int32_t* ids, const float* realized, int k,
                                      AcceptSmem& sm) {
  const float inv_t = 1.0f / p.temperature;
  const Stats st = row_stats(row, vocab, inv_t, sm.s);
  const sampling::Row r{row, vocab, st.max, inv_t};
  const Proposal q = kDense ? dense_proposal(realized, vocab, inv_t, sm.s)
                            : cand_proposal(ids, realized, k, inv_t, sm);
  const sampling::Kept kept = sampling::select_kept(r, p.top_k, p.top_p, sm.s);
  const float log_s = logf(kept_sum(r, kept, st.sum, sm.s));
  const uint64_t seed = sampling::seed_of(p);
  const uint64_t position = static_cast<uint64_t>(p.position + j);
  // Accept iff q(x) > 0 and u q(x) < p(x), i.e. log u + c_x < z_x.
  const float lq_x = log_q<kDense>(q, sm, draft);
  const float z_x = kept_z(r, kept, draft, sm);
  const float u = philox_uniform(seed, position, 0, kStreamAccept);
  if (lq_x > -INFINITY && logf(u) + (lq_x + log_s) < z_x) return Outcome{draft, 0};
  // Rejected: with q(x) > 0 the residual at x is zero (p(x) <= u q(x) < q(x)); exclude x
  // explicitly rather than through rounding. With q(x) = 0 (x not proposed) x keeps p(x).
  const int excluded = lq_x > -INFINITY ? draft : -1;
  int token =
      residual_draw<kDense>(r, kept, excluded, st.max, st.top, log_s, q, seed, position, sm);
  if (token < 0) {  // max(p - q, 0) is zero everywhere: draw from p
    token = sampling::gumbel_draw(r, kept, -1, st.max, st.top, seed, position, false, sm.s).token;
  }
  if (token < 0) token = sampling::row_argmax(row, vocab, sm.s);  // not reached
  return Outcome{token, 1};
}

// The outcome of row j (0..n) of request r (kDense: cand_ids is null). Block-wide.
template <bool kDense>
__device__ inline Outcome row_outcome(const int32_t* drafts, const int32_t* cand_ids,
                                      const float* realized, int k, const float* logits, int64_t r,
                                      int64_t j, int64_t n, int vocab, const SampleRow& p,
                                      AcceptSmem& sm) {
  const float* row = logits + (r * (n + 1) + j) * vocab;
  const int draft = j < n ? drafts[r * n + j] : -1;
  if (!(p.temperature > 0.0f)) {  // greedy, as accept_drafts
    const int best = sampling::row_argmax(row, vocab, sm.s);
    return Outcome{best, j == n || draft != best ? 1 : 0};
  }
  if (j == n) {  // the bonus, drawn from p
    int token = sampling::draw_row(row, vocab, p, p.position + n, -1, false, sm.s).token;
    if (token < 0) token = sampling::row_argmax(row, vocab, sm.s);  // not reached
    return Outcome{token, 1};
  }
  const int64_t q_row = (r * n + j) * k;
  return sampled_row<kDense>(row, vocab, p, j, draft, kDense ? nullptr : cand_ids + q_row,
                             realized + q_row, k, sm);
}

}  // namespace

// drafts [R, n], cand_ids [R, n, K] or null, realized [R, n, K], logits [R, n + 1, V], params [R],
// num_accepted [R], next_token [R]. One block per request: rows in order up to the first stop.
template <bool kDense>
static __global__ void __launch_bounds__(kThreads)
    accept_candidates_kernel(const int32_t* drafts, const int32_t* cand_ids, const float* realized,
                             int k, const float* logits, int64_t n, int vocab,
                             const SampleRow* params, int32_t* num_accepted,
                             int32_t* next_token) {
  __shared__ AcceptSmem sm;
  const int64_t r = blockIdx.x;
  const SampleRow p = params[r];
  int64_t j = 0;
  Outcome o{};
  for (;; ++j) {
    o = row_outcome<kDense>(drafts, cand_ids, realized, k, logits, r, j, n, vocab, p, sm);
    if (o.ends) break;
  }
  if (threadIdx.x == 0) {
    num_accepted[r] = static_cast<int32_t>(j);
    next_token[r] = o.token;
  }
}

// The same with a cluster of kCluster blocks per request (n + 1 <= kCluster * kRowsPerBlock):
// block c computes the outcomes of rows c, c + kCluster, ...; block 0 walks them in order.
template <bool kDense>
static __global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kThreads)
    accept_candidates_cluster_kernel(const int32_t* drafts, const int32_t* cand_ids,
                                     const float* realized, int k, const float* logits, int64_t n,
                                     int vocab, const SampleRow* params, int32_t* num_accepted,
                                     int32_t* next_token) {
  __shared__ AcceptSmem sm;
  __shared__ Outcome outcome[kRowsPerBlock];
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t r = blockIdx.x / kCluster;
  const SampleRow p = params[r];
  for (int64_t j = rank, i = 0; j <= n; j += kCluster, ++i) {
    const Outcome o =
        row_outcome<kDense>(drafts, cand_ids, realized, k, logits, r, j, n, vocab, p, sm);
    if (threadIdx.x == 0) outcome[i] = o;
  }
  cluster.sync();  // every outcome is written
  if (rank == 0 && threadIdx.x == 0) {
    int64_t j = 0;
    Outcome o{};
    for (;; ++j) {
      o = cluster.map_shared_rank(outcome, static_cast<unsigned>(j % kCluster))[j / kCluster];
      if (o.ends) break;
    }
    num_accepted[r] = static_cast<int32_t>(j);
    next_token[r] = o.token;
  }
  cluster.sync();  // the blocks' shared memory stays alive until block 0 has read it
}

cudaError_t accept_candidates(const int32_t* drafts, const int32_t* cand_ids, const float* realized,
                              int64_t k, const float* logits, int64_t num_seqs, int64_t n,
                              int64_t vocab, const SampleRow* params, int32_t* num_accepted,
                              int32_t* next_token, cudaStream_t stream) {
  if (num_seqs <= 0) return cudaSuccess;
  if (n < 0 || vocab <= 0 || vocab > INT32_MAX / 2 || num_seqs > INT32_MAX / kCluster) {
    return cudaErrorInvalidValue;
  }
  const bool k_ok = cand_ids != nullptr ? (k >= 1 && k <= kMaxCand) : k == vocab;
  if (n > 0 && (realized == nullptr || !k_ok)) return cudaErrorInvalidValue;
  const int v = static_cast<int>(vocab);
  const int kk = n > 0 ? static_cast<int>(k) : 0;
  const bool dense = cand_ids == nullptr;
  if (num_seqs <= kClusterMaxSeqs && n + 1 <= kCluster * kRowsPerBlock && n > 0) {
    const dim3 grid(static_cast<unsigned>(num_seqs * kCluster));
    if (dense) {
      accept_candidates_cluster_kernel<true><<<grid, kThreads, 0, stream>>>(
          drafts, cand_ids, realized, kk, logits, n, v, params, num_accepted, next_token);
    } else {
      accept_candidates_cluster_kernel<false><<<grid, kThreads, 0, stream>>>(
          drafts, cand_ids, realized, kk, logits, n, v, params, num_accepted, next_token);
    }
  } else {
    const dim3 grid(static_cast<unsigned>(num_seqs));
    if (dense) {
      accept_candidates_kernel<true><<<grid, kThreads, 0, stream>>>(
          drafts, cand_ids, realized, kk, logits, n, v, params, num_accepted, next_token);
    } else {
      accept_candidates_kernel<false><<<grid, kThreads, 0, stream>>>(
          drafts, cand_ids, realized, kk, logits, n, v, params, num_accepted, next_token);
    }
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
