// The e4m3 (FP8, "e4m3fn": 4 exponent bits of bias 7, 3 mantissa bits, no infinities, 0x7F /
// 0xFF NaN, largest finite +-448) codec on the host, and the per-row quantization of DFlash2's
// FP8 candidate head (backend.h, Fp8Weight). The CPU backend's FP8 ops are these functions; the
// CUDA quantization kernel is tested bit for bit against them.
#pragma once

#include <cstdint>

namespace dflash {

// The e4m3 byte of x: round to nearest even onto the e4m3 grid (subnormals included, step 2^-9),
// saturating at +-448 (infinities too, as the GPU's cvt.satfinite); NaN -> 0x7F.
uint8_t fp8_e4m3_encode(float x);
// The value of an e4m3 byte (exact in fp32; 0x7F / 0xFF -> NaN).
float fp8_e4m3_decode(uint8_t b);

// One row w[H] -> q[H] e4m3 bytes and its scale: max |w| / 448 in fp32 (NaN entries ignored), 1
// when that is not positive (an all-zero row), q[k] = fp8_e4m3_encode(w[k] / scale).
float fp8_quantize_row(const float* w, int64_t h, uint8_t* q);

}  // namespace dflash
