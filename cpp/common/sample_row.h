// SampleRow: how one row of logits is sampled (temperature, top-k, top-p, the request's seed and
// the position of the token drawn): the one definition read by the host samplers
// (backend/cpu/host_sampling.h), the CPU and CUDA backends' device-side ops (a tensor of R rows,
// dtype kU8, R * sizeof(SampleRow) bytes) and the kernels (cuda/, the Triton lattice walk reads
// its bytes: temperature at 0, top_k 4, top_p 8, seed 12 (low word) and 16 (high word), position
// 24). The request's SamplingParams (include/dflash/sampling_params.h) become one SampleRow per
// sampled position. Plain C++, so the nvcc and host compilers include it alike.
#pragma once

#include <cstdint>

namespace dflash {

struct SampleRow {
  float temperature = 0.0f;  // <= 0: greedy (argmax)
  int32_t top_k = 0;         // 0: off
  float top_p = 1.0f;        // 1: off
  // The 64-bit seed as two words, so the layout has no padding before position; the random
  // stream is keyed by (seed, position), so a request samples the same tokens alone or in any batch.
  uint32_t seed_lo = 0, seed_hi = 0;
  uint32_t unused = 0;
  int64_t position = 0;  // absolute position of the token being sampled (the Philox counter)

  SampleRow() = default;
  SampleRow(float temperature_, int32_t top_k_, float top_p_, uint64_t seed, int64_t position_)
      : temperature(temperature_),
        top_k(top_k_),
        top_p(top_p_),
        seed_lo(static_cast<uint32_t>(seed)),
        seed_hi(static_cast<uint32_t>(seed >> 32)),
        position(position_) {}
  uint64_t seed() const { return (static_cast<uint64_t>(seed_hi) << 32) | seed_lo; }
};
static_assert(sizeof(SampleRow) == 32, "SampleRow's byte layout is read by the kernels");

}  // namespace dflash
