// The host e4m3 codec and the per-row FP8 quantization (see host_fp8.h).
#include "backend/cpu/host_fp8.h"

#include <cmath>

namespace dflash {

uint8_t fp8_e4m3_encode(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  // Above 448 everything rounds to 448 or to 480 (the NaN code): saturate.
  if (a > 448.0f) return sign | 0x7E;
  if (a < 0.015625f) {  // below 2^-6: subnormal codes m * 2^-9, m = 0..8 (8 is 2^-6, code 0x08)
    const int m = static_cast<int>(std::nearbyint(a * 512.0f));  // exact scaling; round half to even
    return sign | static_cast<uint8_t>(m);
  }
  int e = 0;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): a = 1.xxx * 2^(e - 1)
  int exp = e - 1;    // -6 .. 8
  int r = static_cast<int>(std::nearbyint(std::ldexp(a, 3 - exp)));  // 8 .. 16, half to even
  if (r == 16) {
    r = 8;
    ++exp;
  }
  if (exp > 8 || (exp == 8 && r > 14)) return sign | 0x7E;
  return sign | static_cast<uint8_t>(((exp + 7) << 3) | (r - 8));
}

float fp8_e4m3_decode(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  float v;
  if (e == 15 && m == 7) {
    v = NAN;
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), -9);
  } else {
    v = std::ldexp(static_cast<float>(8 + m), e - 10);
  }
  return (b & 0x80) ? -v : v;
}

float fp8_quantize_row(const float* w, int64_t h, uint8_t* q) {
  float amax = 0.0f;
  for (int64_t k = 0; k < h; ++k) amax = std::fmax(amax, std::fabs(w[k]));  // fmax drops NaN
  float scale = amax / 448.0f;
  if (!(scale > 0.0f)) scale = 1.0f;
  for (int64_t k = 0; k < h; ++k) q[k] = fp8_e4m3_encode(w[k] / scale);
  return scale;
}

}  // namespace dflash
