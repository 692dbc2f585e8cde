// The portable builds' vectors (avx512, avx2, portable: funcspec/kernels/build.py's BUILDS): GCC / Clang
// vector extensions of the ISA's native width W (16 fp32 lanes with AVX-512, 8 with AVX, else 4: SSE2, NEON).
// Every lane op is an ordinary IEEE op on that lane, so a kernel computes each output by the same sequence of
// operations whichever lane or register holds it; only the horizontal sums (hsum) depend on W, in one fixed
// order per build.
#pragma once

#include <stdint.h>
#include <string.h>

namespace funcspec::simd {

#if defined(__AVX512F__)
constexpr int W = 16;     // fp32 lanes of a register
constexpr int REGS = 32;  // vector registers
#elif defined(__AVX__)
constexpr int W = 8;
constexpr int REGS = 16;
#elif defined(__aarch64__)
constexpr int W = 4;
constexpr int REGS = 32;
#else
constexpr int W = 4;
constexpr int REGS = 16;
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));

inline vf load(const float* p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}
inline vu load_u32(const void* p) {
  vu v;
  memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { memcpy(p, &v, sizeof v); }
inline vf splat(float f) { return vf{} + f; }
inline vf as_float(vu u) { return (vf)u; }  // the same bits
inline vf cvt(vu u) { return __builtin_convertvector((vi)u, vf); }  // values < 2^31

// The sum of the W lanes in one fixed order (a tree).
inline float hsum(vf v) {
  float t[W];
  memcpy(t, &v, sizeof t);
  for (int w = W / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}

// exp(x) for x <= 0 (scores minus their max): 2^n * 2^f, f in [-0.5, 0.5], 2^f by its degree-7 Taylor
// polynomial (relative error ~5e-9), 2^n built in the exponent bits (n >= -126 after the clamp).
inline vf exp_neg(vf x) {
  const vi low = x < -87.0f;  // lanes of all ones where true (bit ops: older Clang has no vector ?:)
  x = (vf)(((vi)x & ~low) | ((vi)splat(-87.0f) & low));  // e^-87 ~ 1.6e-38: tiny but normal
  const vf t = x * 1.44269504088896341f;
  const vf n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23)
  const vf f = (t - n) * 0.693147180559945309f;
  vf p = splat(1.0f / 5040);
  p = p * f + 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * (vf)e;
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
