// Acceptance of draft tokens against the target's verify logits on the device, one block of
// 1024 threads per request, rows visited in order until the first rejection (the semantics of
// runtime/acceptance.cpp). Greedy: the longest prefix where draft == argmax, then the argmax.
// Sampling: draft d_j is accepted iff u_j < p_j(d_j), u_j = philox_uniform(seed, pos + j, 0,
// kStreamAccept), p_j the row's temperature / top-k / top-p distribution; on rejection the token
// is the Gumbel-max draw over p_j without d_j; after n accepts the bonus is drawn from row n.
#include "cuda/kernels.h"
#include "cuda/sampling_common.cuh"

namespace dflash {
namespace cuda {

// drafts [R, n], logits [R, n + 1, V], params [R], num_accepted [R], next_token [R].
static __global__ void __launch_bounds__(sampling::kThreads)
    accept_drafts_kernel(const int32_t* drafts, const float* logits, int64_t n, int vocab,
                         const SampleParams* params, int32_t* num_accepted, int32_t* next_token) {
  __shared__ sampling::SampleSmem s;
  const int64_t r = blockIdx.x;
  const SampleParams p = params[r];
  const int32_t* d = drafts + r * n;
  const float* rows = logits + r * (n + 1) * vocab;
  int64_t accepted = n;
  int token = 0;
  for (int64_t j = 0; j <= n; ++j) {
    const float* row = rows + j * vocab;
    const int draft = j < n ? d[j] : -1;
    if (!(p.temperature > 0.0f)) {
      const int best = sampling::row_argmax(row, vocab, s);
      if (j == n || draft != best) {
        accepted = j;
        token = best;
        break;
      }
      continue;
    }
    const int64_t position = p.position + j;
    const sampling::Draw draw = sampling::draw_row(row, vocab, p, position, draft, j < n, s);
    if (j < n) {
      const float u = philox_uniform(sampling::seed_of(p), static_cast<uint64_t>(position), 0,
                                     kStreamAccept);
      if (u < draw.p_excluded) continue;  // accepted with probability p(d)
    }
    accepted = j;
    // No candidate left only when the kept set is {d} (then p(d) = 1 and d was accepted
    // unless u == 1); keep d then.
    token = draw.token >= 0 ? draw.token : (draft >= 0 ? draft : sampling::row_argmax(row, vocab, s));
    break;
  }
  if (threadIdx.x == 0) {
    num_accepted[r] = static_cast<int32_t>(accepted);
    next_token[r] = token;
  }
}

cudaError_t accept_drafts(const int32_t* drafts, const float* logits, int64_t num_seqs, int64_t n,
                          int64_t vocab, const SampleParams* params, int32_t* num_accepted,
                          int32_t* next_token, cudaStream_t stream) {
  if (num_seqs <= 0) return cudaSuccess;
  if (n < 0 || vocab <= 0 || vocab > INT32_MAX / 2 || num_seqs > INT32_MAX) return cudaErrorInvalidValue;
  accept_drafts_kernel<<<static_cast<unsigned>(num_seqs), sampling::kThreads, 0, stream>>>(
      drafts, logits, n, static_cast<int>(vocab), params, num_accepted, next_token);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
