// Token sampling from fp32 logits: one block of 1024 threads per row. Greedy rows
// (temperature <= 0) take the argmax (lowest id among ties); the others draw by Gumbel-max over
// the tokens kept by top-k / top-p at the row's temperature, keyed by (seed, position, token)
// on the target-sampling Philox stream, like the CPU backend (sampling_common.cuh).
#include "cuda/kernels.h"
#include "cuda/sampling_common.cuh"

namespace dflash {
namespace cuda {

// logits [R, V], params [R], tokens [R].
static __global__ void __launch_bounds__(sampling::kThreads)
    sample_kernel(const float* logits, int vocab, const SampleRow* params, int32_t* tokens) {
  __shared__ sampling::SampleSmem s;
  const float* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  const SampleRow p = params[blockIdx.x];
  int token;
  if (p.temperature > 0.0f) {
    token = sampling::draw_row(row, vocab, p, p.position, -1, false, s).token;
    if (token < 0) token = sampling::row_argmax(row, vocab, s);  // not reached: the set is never empty
  } else {
    token = sampling::row_argmax(row, vocab, s);
  }
  if (threadIdx.x == 0) tokens[blockIdx.x] = token;
}

cudaError_t sample(const float* logits, int64_t rows, int64_t vocab, const SampleRow* params,
                   int32_t* tokens, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vocab <= 0 || vocab > INT32_MAX / 2 || rows > INT32_MAX) return cudaErrorInvalidValue;
  sample_kernel<<<static_cast<unsigned>(rows), sampling::kThreads, 0, stream>>>(
      logits, static_cast<int>(vocab), params, tokens);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dflash
