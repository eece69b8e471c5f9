// Counter-based random numbers (Philox-4x32-10). A draw is a pure function of
// (key = request seed, counter = (position, index, stream)), so sampling does not depend on
// what else runs in the batch, and the CPU and CUDA backends can share the stream definition.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DFLASH_HOST_DEVICE __host__ __device__
#else
#define DFLASH_HOST_DEVICE
#endif

namespace dflash {

// Streams separate the uses of one request's randomness.
enum RandomStream : uint32_t {
  kStreamTargetSample = 0,  // sampling a token from the target
  kStreamDraftSample = 1,   // sampling a draft token (speculative decoding)
  kStreamAccept = 2,        // acceptance uniforms (speculative decoding)
};

DFLASH_HOST_DEVICE inline void philox_round(uint32_t c[4], const uint32_t k[2]) {
  const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c[0];
  const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c[2];
  const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
  const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
  const uint32_t n0 = hi1 ^ c[1] ^ k[0];
  const uint32_t n2 = hi0 ^ c[3] ^ k[1];
  c[0] = n0;
  c[1] = lo1;
  c[2] = n2;
  c[3] = lo0;
}

// Returns the first 32-bit word of Philox-4x32-10(counter, key).
DFLASH_HOST_DEVICE inline uint32_t philox_u32(uint64_t seed, uint64_t position, uint32_t index,
                                              uint32_t stream) {
  uint32_t c[4] = {index, stream, static_cast<uint32_t>(position),
                   static_cast<uint32_t>(position >> 32)};
  uint32_t k[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  for (int r = 0; r < 10; ++r) {
    philox_round(c, k);
    k[0] += 0x9E3779B9u;
    k[1] += 0xBB67AE85u;
  }
  return c[0];
}

// Uniform in the open interval (0, 1): 23 random bits + 1/2, so the largest value is
// 1 - 2^-24 (with 24 bits, x + 0.5 can round up to exactly 1.0 in fp32).
DFLASH_HOST_DEVICE inline float philox_uniform(uint64_t seed, uint64_t position, uint32_t index,
                                               uint32_t stream) {
  return (static_cast<float>(philox_u32(seed, position, index, stream) >> 9) + 0.5f) *
         (1.0f / 8388608.0f);
}

}  // namespace dflash
