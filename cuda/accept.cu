// Acceptance of draft tokens against the target's verify logits on the device, with the
// semantics of runtime/acceptance.cpp. Greedy: the longest prefix where draft == argmax, then
// the argmax. Sampling: draft d_j is accepted iff u_j < p_j(d_j), u_j = philox_uniform(seed,
// pos + j, 0, kStreamAccept), p_j the row's temperature / top-k / top-p distribution; on
// rejection the token is the Gumbel-max draw over p_j without d_j; after n accepts the bonus is
// drawn from row n (sampling_common.cuh). Each row's outcome is a pure function of the row, so:
//   * few requests (<= kClusterMaxSeqs): a cluster of kCluster blocks per request, block c
//     computing the outcomes of rows c, c + kCluster, ...; block 0 then walks them in order
//     through distributed shared memory (the rows are read by 8 SMs at once);
//   * many requests: one block per request, rows in order up to the first rejection.
#include <cooperative_groups.h>

#include "cuda/kernels.h"
#include "cuda/sampling_common.cuh"

namespace dflash {
namespace cuda {

namespace {
constexpr int kCluster = 8;          // blocks per request in the cluster kernel
constexpr int kRowsPerBlock = 4;     // so up to kCluster * kRowsPerBlock = 32 rows (n <= 31)
constexpr int kClusterMaxSeqs = 16;  // 128 blocks: one wave on an H200's 132 SMs
}  // namespace

// The outcome of row j of one request: the argmax (greedy), or the draw without the draft with
// p(draft) (j < n) / the bonus draw (j == n). Block-wide; the same value in every thread.
__device__ inline sampling::Draw row_outcome(const float* row, int vocab, const SampleRow& p,
                                             int64_t j, int64_t n, int draft,
                                             sampling::SampleSmem& s) {
  if (!(p.temperature > 0.0f)) return sampling::Draw{sampling::row_argmax(row, vocab, s), 0.0f};
  sampling::Draw d = sampling::draw_row(row, vocab, p, p.position + j, draft, j < n, s);
  // No candidate is left only when the kept set is {draft} (then p(draft) = 1 and the draft is
  // accepted unless u == 1): keep the draft then.
  if (d.token < 0) d.token = draft >= 0 ? draft : sampling::row_argmax(row, vocab, s);
  return d;
}

// True when row j's outcome ends the walk (mismatch / rejection / bonus row).
__device__ __forceinline__ bool row_ends(const SampleRow& p, int64_t j, int64_t n, int draft,
                                         const sampling::Draw& d) {
  if (j == n) return true;
  if (!(p.temperature > 0.0f)) return draft != d.token;
  const float u = philox_uniform(sampling::seed_of(p), static_cast<uint64_t>(p.position + j), 0,
                                 kStreamAccept);
  return !(u < d.p_excluded);  // accepted with probability p(d)
}

// drafts [R, n], logits [R, n + 1, V], params [R], num_accepted [R], next_token [R].
// One block per request.
static __global__ void __launch_bounds__(sampling::kThreads)
    accept_drafts_kernel(const int32_t* drafts, const float* logits, int64_t n, int vocab,
                         const SampleRow* params, int32_t* num_accepted, int32_t* next_token) {
  __shared__ sampling::SampleSmem s;
  const int64_t r = blockIdx.x;
  const SampleRow p = params[r];
  int64_t j = 0;
  sampling::Draw d{};
  for (;; ++j) {
    const int draft = j < n ? drafts[r * n + j] : -1;
    d = row_outcome(logits + (r * (n + 1) + j) * vocab, vocab, p, j, n, draft, s);
    if (row_ends(p, j, n, draft, d)) break;
  }
  if (threadIdx.x == 0) {
    num_accepted[r] = static_cast<int32_t>(j);
    next_token[r] = d.token;
  }
}

// The same with a cluster of kCluster blocks per request (n + 1 <= kCluster * kRowsPerBlock).
static __global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(sampling::kThreads)
    accept_drafts_cluster_kernel(const int32_t* drafts, const float* logits, int64_t n, int vocab,
                                 const SampleRow* params, int32_t* num_accepted,
                                 int32_t* next_token) {
  __shared__ sampling::SampleSmem s;
  __shared__ sampling::Draw outcome[kRowsPerBlock];
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t r = blockIdx.x / kCluster;
  const SampleRow p = params[r];
  for (int64_t j = rank, k = 0; j <= n; j += kCluster, ++k) {
    const int draft = j < n ? drafts[r * n + j] : -1;
    const sampling::Draw d = row_outcome(logits + (r * (n + 1) + j) * vocab, vocab, p, j, n, draft, s);
    if (threadIdx.x == 0) outcome[k] = d;
  }
  cluster.sync();  // every outcome is written
  if (rank == 0 && threadIdx.x == 0) {
    int64_t j = 0;
    sampling::Draw d{};
    for (;; ++j) {
      d = cluster.map_shared_rank(outcome, static_cast<unsigned>(j % kCluster))[j / kCluster];
      if (row_ends(p, j, n, j < n ? drafts[r * n + j] : -1, d)) break;
    }
    num_accepted[r] = static_cast<int32_t>(j);
    next_token[r] = d.token;
  }
  cluster.sync();  // the blocks' shared memory stays alive until block 0 has read it
}

cudaError_t accept_drafts(const int32_t* drafts, const float* logits, int64_t num_seqs, int64_t n,
                          int64_t vocab, const SampleRow* params, int32_t* num_accepted,
                          int32_t* next_token, cudaStream_t stream) {
  if (num_seqs <= 0) return cudaSuccess;
  if (n < 0 || vocab <= 0 || vocab > INT32_MAX / 2 || num_seqs > INT32_MAX / kCluster) {
    return cudaErrorInvalidValue;
  }
  const int v = static_cast<int>(vocab);
  if (num_seqs <= kClusterMaxSeqs && n + 1 <= kCluster * kRowsPerBlock && n > 0) {
    accept_drafts_cluster_kernel<<<static_cast<unsigned>(num_seqs * kCluster), sampling::kThreads,
                                   0, stream>>>(drafts, logits, n, v, params, num_accepted,
                                                next_token);
  } else {
    accept_drafts_kernel<<<static_cast<unsigned>(num_seqs), sampling::kThreads, 0, stream>>>(
        drafts, logits, n, v, params, num_accepted, next_token);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
