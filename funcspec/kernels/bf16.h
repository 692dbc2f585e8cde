// bf16 <-> fp32 helpers shared by the CPU kernels (stream.cpp, attention.cpp, quant.cpp).
#pragma once

#include <stdint.h>
#include <string.h>

#include <type_traits>

namespace funcspec {

inline float bf16_to_float(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN kept quiet: torch's float -> bfloat16.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// A kernel's element type T (float, or uint16_t holding bf16) to and from fp32.
template <class T>
inline float to_float(T v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return bf16_to_float(v);
}

template <class T>
inline T from_float(float f) {
  if constexpr (std::is_same_v<T, float>) return f;
  else return float_to_bf16(f);
}

}  // namespace funcspec
