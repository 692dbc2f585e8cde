// The portable builds' vectors (avx512, avx2, portable: funcspec/kernels/build.py's BUILDS): GCC / Clang
// vector extensions of 16 fp32 lanes, which the compiler lowers to the ISA it is given (one zmm, two ymm,
// four xmm or four NEON registers). Every lane op is an ordinary IEEE op on that lane, so a kernel written
// with them computes each output by the same sequence of operations on every build of the same flags.
#pragma once

#include <stdint.h>
#include <string.h>

namespace funcspec::simd {

constexpr int L = 16;  // lanes
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline f32x16 load(const float* p) {
  f32x16 v;
  memcpy(&v, p, sizeof v);
  return v;
}
inline u32x16 load_u32(const void* p) {
  u32x16 v;
  memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, f32x16 v) { memcpy(p, &v, sizeof v); }
inline f32x16 splat(float f) { return f32x16{} + f; }
inline f32x16 as_float(u32x16 u) { return (f32x16)u; }  // the same bits
inline f32x16 cvt(u32x16 u) { return __builtin_convertvector((i32x16)u, f32x16); }  // values < 2^31

// The sum of the 16 lanes in one fixed order (a tree).
inline float hsum(f32x16 v) {
  float t[L];
  memcpy(t, &v, sizeof t);
  for (int w = L / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}

// exp(x) for x <= 0 (scores minus their max): 2^n * 2^f, f in [-0.5, 0.5], 2^f by its degree-7 Taylor
// polynomial (relative error ~5e-9), 2^n built in the exponent bits (n >= -126 after the clamp).
inline f32x16 exp_neg(f32x16 x) {
  x = x < -87.0f ? splat(-87.0f) : x;  // e^-87 ~ 1.6e-38: tiny but normal
  const f32x16 t = x * 1.44269504088896341f;
  const f32x16 n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23)
  const f32x16 f = (t - n) * 0.693147180559945309f;
  f32x16 p = splat(1.0f / 5040);
  p = p * f + 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;
  return p * (f32x16)e;
}

// IEEE half to float, exactly (scales and offsets of the quantized weights).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
    float f = (float)man * (1.0f / 16777216.0f);
    memcpy(&u, &f, 4);
    u |= sign;
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// A spin-wait's pause (x86's pause, ARM's yield).
inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
  __asm__ __volatile__("yield");
#endif
}

}  // namespace funcspec::simd
