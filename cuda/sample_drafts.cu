// Probabilistic DFlash drafts: one block of 1024 threads per row of the drafter's fp32 logits.
// T > 0: Gumbel-max over softmax(logits / T) with the noise on the draft-sampling Philox stream
// (kStreamDraftSample, keyed by (seed, position, token id)), pruned like sampling_common.cuh's
// gumbel_draw; NaN and -inf logits never win. T <= 0, or no finite maximum: argmax_finite (the
// lowest id of the max, NaN as -inf, 0 when every logit is -inf / NaN). Host reference:
// sample_draft_token (backend/cpu/host_candidates.cpp).
#include "cuda/kernels.h"
#include "cuda/sampling_common.cuh"

namespace dflash {
namespace cuda {

namespace {

// The host's argmax_finite: row_argmax (NaN never wins, lowest id on ties), and 0 when the max is
// -inf (every logit -inf or NaN), where row_argmax would give the first -inf.
__device__ inline int argmax_finite(const float* row, int vocab, sampling::SampleSmem& s) {
  const int t = sampling::row_argmax(row, vocab, s);
  return __ldg(row + t) > -INFINITY ? t : 0;
}

}  // namespace

// logits [rows, V], params [rows / n], drafts [rows].
// NOTE(sample_drafts): the host scores logit / T - log(-log(u)) in double; here the score is
// (logit - max) * (1 / T) + g in fp32 (the same order up to rounding), so a different token needs
// two scores within a few fp32 ulps of each other: astronomically rare on real logits.
static __global__ void __launch_bounds__(sampling::kThreads)
    sample_drafts_kernel(const float* logits, int vocab, int64_t n, const SampleRow* params,
                         int32_t* drafts) {
  __shared__ sampling::SampleSmem s;
  const int64_t i = blockIdx.x;
  const float* row = logits + i * vocab;
  const SampleRow p = params[i / n];
  int token = -1;
  if (p.temperature > 0.0f) {
    sampling::Row r{row, vocab, 0.0f, 1.0f / p.temperature};
    float lmax_top;
    int id_top;
    sampling::row_max(row, vocab, -1, &r.lmax, &lmax_top, &id_top, s);
    // A +inf logit wins outright on the host too (the first one), as does argmax_finite; with a
    // finite max, -inf and NaN logits fall below the pruning bound and never win.
    if (isfinite(r.lmax)) {
      const sampling::Kept all{sampling::keep_all(), -1};
      token = sampling::gumbel_draw(r, all, -1, lmax_top, id_top, sampling::seed_of(p),
                                    static_cast<uint64_t>(p.position + i % n), false, s,
                                    kStreamDraftSample)
                  .token;
    }
  }
  if (token < 0) token = argmax_finite(row, vocab, s);
  if (threadIdx.x == 0) drafts[i] = token;
}

cudaError_t sample_drafts(const float* logits, int64_t rows, int64_t n, int64_t vocab,
                          const SampleRow* params, int32_t* drafts, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (n <= 0 || vocab <= 0 || vocab > INT32_MAX / 2 || rows > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  sample_drafts_kernel<<<static_cast<unsigned>(rows), sampling::kThreads, 0, stream>>>(
      logits, static_cast<int>(vocab), n, params, drafts);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
