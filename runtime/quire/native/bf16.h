// bfloat16 <-> float32 for the native kernels (the .cpp files here and
// attention/cpu_kernels/paged_decode.cpp include it; the build cache keys on this file too).
#pragma once
#include <cstdint>
#include <cstring>

namespace quire_bf16 {

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  // branch-free (both computed, one picked), so that loops over rows vectorize
  const uint32_t nan = (bits >> 16) | 0x40u;
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

}  // namespace quire_bf16
