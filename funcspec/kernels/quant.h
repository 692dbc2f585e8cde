// The quantized products' tiles of quant.cpp, shared with the routed-expert kernel (moe.cpp).
//
// Rows of x are quantized to int8 per block of 32 k (quantize_row); a column block of 32 outputs of a
// weight packed by funcspec/kernels/quant.py is multiplied by up to 6 of them (tile_any), each output
// one fp32 accumulator over the blocks in order: quant.cpp's header says why. 6-bit values are put back
// together in registers from their low nibbles and their 2 high bits (quant.cpp's layout). The avx512bf16 build's tiles
// are VNNI intrinsics. The others sum each block's integer products (unit_dots) with AVX-VNNI (avxvnni) or
// AVX2's byte products (avx512, avx2), or in fp32 lanes (portable: lane_dots; exact, every partial sum is an
// integer below 2^24); then all scale the sums the same way, with simd.h's vectors.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "bf16.h"
#include "simd.h"
#if defined(FUNCSPEC_ISA_AVX512BF16) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace funcspec::quantized {

constexpr int64_t QB = 32;    // outputs per column block: 2 zmm of fp32 accumulators
constexpr int64_t AB = 32;    // k per activation block (one scale and one sum per row)
constexpr int64_t STEP = 128;  // weight bytes per step (QB outputs x 4 bytes)

// How far ahead of the unit it reads (bytes) the avx512bf16 tile prefetches the weights into L1; 0: the hardware
// prefetcher alone. Set per CPU kind when the library loads (funcspec_set_quant_prefetch, build.py).
inline int64_t& prefetch_ahead() {
  static int64_t bytes = 0;
  return bytes;
}

// The symmetric formats' zero point: w = s (q - zero).
template <int BITS>
constexpr int32_t zero_point() {
  return BITS == 8 ? 128 : BITS == 6 ? 32 : 8;
}

using funcspec::from_float;
using funcspec::to_float;

// Row m of x [M, K] as int8 blocks of 32: xq [K], d [K/32], and the sums of each half block, sums [K/16].
// In simd.h's vectors on every build, lane by lane the scalar math: amax = the largest |x| (NaN skipped, as
// std::max(amax, |x|) skips it), d = amax / 127, xq = round-half-even(x * (127 / amax)) clamped to +-127.
template <class T>
void quantize_row(const T* x, int64_t K, int8_t* xq, float* d, int32_t* sums) {
  using namespace funcspec::simd;
  constexpr int NV = AB / W;  // vectors per block
  typedef int8_t vb __attribute__((vector_size(W)));
  const vi magnitude = vi{} + 0x7fffffff;
  for (int64_t b = 0; b < K / AB; ++b) {
    alignas(64) float v[AB];
    for (int64_t i = 0; i < AB; ++i) v[i] = to_float<T>(x[b * AB + i]);
    vf top = vf{};
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      const vf a = (vf)((vi)load(v + W * j) & magnitude);
      const vi more = top < a;  // false for NaN lanes: they never enter
      top = (vf)(((vi)a & more) | ((vi)top & ~more));
    }
    alignas(64) float lanes[W];
    store(lanes, top);
    float amax = 0.0f;
    for (int i = 0; i < W; ++i) amax = std::max(amax, lanes[i]);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    // Round half to even, as torch.round: vectorized where the ISA rounds (vroundps, vrndscaleps, frinti).
    // NOTE: not the 1.5 * 2^23 add-and-subtract trick, which FMA contraction would round once instead of twice.
    alignas(64) float t[AB];
    for (int64_t i = 0; i < AB; ++i) t[i] = nearbyintf(v[i] * inv);
    vi half[2] = {vi{}, vi{}};
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      vi q = __builtin_convertvector(load(t + W * j), vi);
      const vi lo = q < -127, hi = q > 127;
      q = (q & ~lo) | ((vi{} - 127) & lo);
      q = (q & ~hi) | ((vi{} + 127) & hi);
      const vb packed = __builtin_convertvector(q, vb);
      memcpy(xq + b * AB + W * j, &packed, W);
      half[j / (NV / 2)] += q;
    }
    d[b] = amax / 127.0f;
    for (int h = 0; h < 2; ++h) {
      int32_t lane[W], sum = 0;
      memcpy(lane, &half[h], sizeof lane);
      for (int i = 0; i < W; ++i) sum += lane[i];
      sums[2 * b + h] = sum;
    }
  }
}

#if defined(FUNCSPEC_ISA_AVX512BF16)

inline __m512 load_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// ai [MB][2] += each row's two quads of k at xk + m K (8 bytes) times 32 outputs' unpacked weights: the first
// quad's a0 (outputs 0-15) and a1 (16-31), the second's b0 and b1.
template <int MB>
inline void quad_pairs(__m512i (*ai)[2], const int8_t* xk, int64_t K, __m512i a0, __m512i a1, __m512i b0,
                       __m512i b1) {
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    int32_t va, vb;
    memcpy(&va, xk + m * K, 4);
    memcpy(&vb, xk + m * K + 4, 4);
    const __m512i xa = _mm512_set1_epi32(va), xb = _mm512_set1_epi32(vb);
    ai[m][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ai[m][0], a0, xa), b0, xb);
    ai[m][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ai[m][1], a1, xa), b1, xb);
  }
}

// acc [MB][32] (fp32) += the rows' products with one column block, over every k, in units of U k (32, or 16
// for 8-bit weights in groups of 16 and for 6-bit weights: GGUF's Q6_K), each one integer sum per row and output.
template <int BITS, bool ASYM, int U, int MB>
void tile(const int8_t* xq, const float* d, const int32_t* sums, int64_t K, int64_t G, const uint8_t* wb,
          const uint16_t* sb, const uint16_t* ob, float* acc) {
  const int64_t units = K / U, per_group = G / U, blocks = K / AB;
  const __m512i low = _mm512_set1_epi8(0x0F);
  constexpr int32_t zero = zero_point<BITS>();
  __m512 af[MB][2];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) af[m][0] = af[m][1] = _mm512_setzero_ps();
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, o0 = s0, o1 = s0;
  constexpr int64_t unit_bytes = U * BITS * QB / 8;
  const int64_t ahead = prefetch_ahead();
  for (int64_t u = 0; u < units; ++u) {
    if (ahead) {
#pragma GCC unroll 16
      for (int l = 0; l < unit_bytes / 64; ++l)
        _mm_prefetch((const char*)wb + u * unit_bytes + ahead + 64 * l, _MM_HINT_T0);
    }
    if (u % per_group == 0) {
      const int64_t g = u / per_group;
      s0 = load_half(sb + g * QB);
      s1 = load_half(sb + g * QB + 16);
      if (ASYM) {
        o0 = load_half(ob + g * QB);
        o1 = load_half(ob + g * QB + 16);
      }
    }
    // Each row's sums start, symmetric, at -zero * sum_k xq: they end as sum_k xq (q - zero), exactly.
    int32_t usum[MB];  // each row's sum of xq over the unit
    __m512i ai[MB][2];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const int32_t* half = sums + m * 2 * blocks + u * U / 16;
      usum[m] = U == 16 ? half[0] : half[0] + half[1];
      ai[m][0] = ai[m][1] = ASYM ? _mm512_setzero_si512() : _mm512_set1_epi32(-zero * usum[m]);
    }
    if (BITS == 8) {
      const uint8_t* w = wb + u * (U / 4) * STEP;
#pragma GCC unroll 8
      for (int q = 0; q < U / 4; ++q) {
        const __m512i w0 = _mm512_loadu_si512(w + q * STEP), w1 = _mm512_loadu_si512(w + q * STEP + 64);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          int32_t v;
          memcpy(&v, xq + m * K + u * U + q * 4, 4);
          const __m512i xv = _mm512_set1_epi32(v);
          ai[m][0] = _mm512_dpbusd_epi32(ai[m][0], w0, xv);
          ai[m][1] = _mm512_dpbusd_epi32(ai[m][1], w1, xv);
        }
      }
    } else if (BITS == 6) {  // units of 16 k: two nibble steps, then the step of high bits
      const uint8_t* w = wb + u * 3 * STEP;
      const __m512i h0 = _mm512_loadu_si512(w + 2 * STEP), h1 = _mm512_loadu_si512(w + 2 * STEP + 64);
      const __m512i top = _mm512_set1_epi8(0x30);
      // Quad j's (k = 4j .. 4j + 3) high bits, at bits 2j of each byte, moved to bits 4-5 (16-bit shifts: what
      // crosses into the next byte lands outside bits 4-5).
      const __m512i hs[4][2] = {{_mm512_slli_epi16(h0, 4), _mm512_slli_epi16(h1, 4)},
                                {_mm512_slli_epi16(h0, 2), _mm512_slli_epi16(h1, 2)},
                                {h0, h1},
                                {_mm512_srli_epi16(h0, 2), _mm512_srli_epi16(h1, 2)}};
#pragma GCC unroll 2
      for (int o = 0; o < 2; ++o) {
        const __m512i v0 = _mm512_loadu_si512(w + o * STEP), v1 = _mm512_loadu_si512(w + o * STEP + 64);
        // (high & 0x30) | nibble: vpternlogd's 0xEA is (a & b) | c.
        const __m512i a0 = _mm512_ternarylogic_epi32(hs[2 * o][0], top, _mm512_and_si512(v0, low), 0xEA);
        const __m512i a1 = _mm512_ternarylogic_epi32(hs[2 * o][1], top, _mm512_and_si512(v1, low), 0xEA);
        const __m512i b0 = _mm512_ternarylogic_epi32(hs[2 * o + 1][0], top,
                                                     _mm512_and_si512(_mm512_srli_epi16(v0, 4), low), 0xEA);
        const __m512i b1 = _mm512_ternarylogic_epi32(hs[2 * o + 1][1], top,
                                                     _mm512_and_si512(_mm512_srli_epi16(v1, 4), low), 0xEA);
        quad_pairs<MB>(ai, xq + u * U + o * 8, K, a0, a1, b0, b1);
      }
    } else {
      const uint8_t* w = wb + u * 4 * STEP;
#pragma GCC unroll 4
      for (int o = 0; o < 4; ++o) {
        const __m512i v0 = _mm512_loadu_si512(w + o * STEP), v1 = _mm512_loadu_si512(w + o * STEP + 64);
        const __m512i lo0 = _mm512_and_si512(v0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
        const __m512i lo1 = _mm512_and_si512(v1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
        quad_pairs<MB>(ai, xq + u * U + o * 8, K, lo0, lo1, hi0, hi1);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const float dm = d[m * blocks + u * U / AB];
      if (ASYM) {
        const __m512 sx = _mm512_set1_ps((float)usum[m]), dv = _mm512_set1_ps(dm);
        const __m512 t0 = _mm512_fnmadd_ps(o0, sx, _mm512_mul_ps(_mm512_cvtepi32_ps(ai[m][0]), s0));
        const __m512 t1 = _mm512_fnmadd_ps(o1, sx, _mm512_mul_ps(_mm512_cvtepi32_ps(ai[m][1]), s1));
        af[m][0] = _mm512_fmadd_ps(t0, dv, af[m][0]);
        af[m][1] = _mm512_fmadd_ps(t1, dv, af[m][1]);
      } else {
        const __m512 dv = _mm512_set1_ps(dm);
        af[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[m][0]), _mm512_mul_ps(s0, dv), af[m][0]);
        af[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[m][1]), _mm512_mul_ps(s1, dv), af[m][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    _mm512_storeu_ps(acc + m * QB, af[m][0]);
    _mm512_storeu_ps(acc + m * QB + 16, af[m][1]);
  }
}

// Rows per pass: 6 x (2 int32 + 2 fp32) accumulators + weights and scales; 4-bit asymmetric weights also hold
// their unpacked nibbles and offsets, so 4 rows. 5 rows (a K = 4 verify) then take one pass, faster than 3 + 2.
template <int BITS, bool ASYM>
constexpr int max_rows() {
  return BITS == 4 && ASYM ? 4 : 6;
}
constexpr int MAX_MB = 6;

#else  // the portable builds: simd.h's vectors

#if defined(__AVX2__)
// dots [MB][32] = each row's integer sums with one column block over unit u (U k): sum_k xq q, exactly.
// With AVX-VNNI (the avxvnni build) one vpdpbusd per 4 k, as the avx512bf16 tile on half its width. Else AVX2's
// byte products (avx512 and avx2 builds): vpmaddubsw multiplies unsigned by signed bytes into pairs of int16,
// which 255 * 127 * 2 would overflow, so 8-bit weights enter as q - 128 (|q - 128| times x signed as q - 128),
// and the rows' 128 * sum_k xq is added back; 4-bit pairs stay below 15 * 127 * 4, 6-bit ones below 63 * 127 * 4.
// Every way gives the same integers, so the same bits.
//
// ai [MB] += each row's two quads of k at xk + m K (8 bytes) times 8 outputs' unpacked weights of 4 or 6 bits,
// a (the first quad) and b (the second).
template <int MB>
inline void quad_pairs(__m256i* ai, const int8_t* xk, int64_t K, __m256i a, __m256i b) {
#if !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    int32_t va, vb;
    memcpy(&va, xk + m * K, 4);
    memcpy(&vb, xk + m * K + 4, 4);
#if defined(__AVXVNNI__)
    ai[m] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(ai[m], a, _mm256_set1_epi32(va)), b,
                                    _mm256_set1_epi32(vb));
#else
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(a, _mm256_set1_epi32(va)),
                                       _mm256_maddubs_epi16(b, _mm256_set1_epi32(vb)));
    ai[m] = _mm256_add_epi32(ai[m], _mm256_madd_epi16(p, ones));
#endif
  }
}

template <int BITS, int U, int MB>
inline void unit_dots(const int8_t* xq, int64_t K, int64_t u, const int32_t* usum, const uint8_t* wb,
                      int32_t* dots) {
#if !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int g = 0; g < 4; ++g) {  // outputs 8g .. 8g + 7: 32 bytes of each step
    __m256i ai[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) ai[m] = _mm256_setzero_si256();
    if (BITS == 8) {
      const uint8_t* w = wb + u * (U / 4) * STEP + 32 * g;
#pragma GCC unroll 8
      for (int q = 0; q < U / 4; ++q) {  // 4 k a step: byte b of an output's 4 holds k = 4q + b
#if defined(__AVXVNNI__)
        const __m256i wq = _mm256_loadu_si256((const __m256i*)(w + q * STEP));
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          int32_t v;
          memcpy(&v, xq + m * K + u * U + 4 * q, 4);
          ai[m] = _mm256_dpbusd_avx_epi32(ai[m], wq, _mm256_set1_epi32(v));
        }
#else
        const __m256i ws = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + q * STEP)),
                                            _mm256_set1_epi8((char)0x80));
        const __m256i aw = _mm256_abs_epi8(ws);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          int32_t v;
          memcpy(&v, xq + m * K + u * U + 4 * q, 4);
          const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(v), ws));
          ai[m] = _mm256_add_epi32(ai[m], _mm256_madd_epi16(p, ones));
        }
#endif
      }
#if !defined(__AVXVNNI__)
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) ai[m] = _mm256_add_epi32(ai[m], _mm256_set1_epi32(128 * usum[m]));
#endif
    } else if (BITS == 6) {  // units of 16 k: two nibble steps, then the step of high bits
      const uint8_t* w = wb + u * 3 * STEP + 32 * g;
      const __m256i h = _mm256_loadu_si256((const __m256i*)(w + 2 * STEP));
      const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
      const __m256i hs[4] = {_mm256_slli_epi16(h, 4), _mm256_slli_epi16(h, 2), h, _mm256_srli_epi16(h, 2)};
#pragma GCC unroll 2
      for (int o = 0; o < 2; ++o) {  // quads 2o and 2o + 1: the low and the high nibbles of step o
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + o * STEP));
        const __m256i a = _mm256_or_si256(_mm256_and_si256(hs[2 * o], top), _mm256_and_si256(v, low));
        const __m256i b = _mm256_or_si256(_mm256_and_si256(hs[2 * o + 1], top),
                                          _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
        quad_pairs<MB>(ai, xq + u * U + 8 * o, K, a, b);
      }
    } else {
      const uint8_t* w = wb + u * 4 * STEP + 32 * g;
      const __m256i low = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
      for (int o = 0; o < 4; ++o) {  // 8 k a step: byte b holds k = 8o + b (low nibble) and 8o + 4 + b (high)
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + o * STEP));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        quad_pairs<MB>(ai, xq + u * U + 8 * o, K, lo, hi);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) _mm256_storeu_si256((__m256i*)(dots + m * QB + 8 * g), ai[m]);
  }
}
#else
// ai [MB][16 / W] = each row's integer sums with outputs 16h .. 16h + 15 of one column block over unit u (U k),
// sum_k xq q, in fp32 lanes (exact: every partial sum is an integer below 2^24).
template <int BITS, int U, int MB>
inline void lane_dots(const int8_t* xq, int64_t K, int64_t u, int h, const uint8_t* wb,
                      funcspec::simd::vf (*ai)[16 / funcspec::simd::W]) {
  using namespace funcspec::simd;
  constexpr int NV = 16 / W;
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) ai[m][j] = vf{};
  if (BITS == 8) {
    const uint8_t* w = wb + u * (U / 4) * STEP + 64 * h;
    for (int q = 0; q < U / 4; ++q) {  // 4 k a step: byte b of an output's 4 holds k = 4q + b
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) {
        const vu v = load_u32(w + q * STEP + 4 * W * j);
#pragma GCC unroll 4
        for (int b = 0; b < 4; ++b) {
          const vf wk = cvt((v >> (8 * b)) & 0xffu);
#pragma GCC unroll 8
          for (int m = 0; m < MB; ++m) ai[m][j] = ai[m][j] + (float)xq[m * K + u * U + 4 * q + b] * wk;
        }
      }
    }
  } else if (BITS == 6) {
    const uint8_t* w = wb + u * 3 * STEP + 64 * h;
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const vu high = load_u32(w + 2 * STEP + 4 * W * j);  // byte b: quad i's high bits at bits 2i
      for (int o = 0; o < 2; ++o) {  // 8 k a step: byte b holds k = 8o + b (low nibble) and 8o + 4 + b (high)
        const vu v = load_u32(w + o * STEP + 4 * W * j);
#pragma GCC unroll 8
        for (int b = 0; b < 8; ++b) {
          const int quad = 2 * o + b / 4, byte = b % 4;
          const vf wk = cvt(((v >> (8 * byte + 4 * (b / 4))) & 0xfu) | (((high >> (8 * byte + 2 * quad)) & 3u) << 4));
#pragma GCC unroll 8
          for (int m = 0; m < MB; ++m) ai[m][j] = ai[m][j] + (float)xq[m * K + u * U + 8 * o + b] * wk;
        }
      }
    }
  } else {
    const uint8_t* w = wb + u * 4 * STEP + 64 * h;
    for (int o = 0; o < 4; ++o) {  // 8 k a step: byte b holds k = 8o + b (low nibble) and 8o + 4 + b (high)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) {
        const vu v = load_u32(w + o * STEP + 4 * W * j);
#pragma GCC unroll 8
        for (int b = 0; b < 8; ++b) {
          const vf wk = cvt((v >> (8 * (b % 4) + 4 * (b / 4))) & 0xfu);
#pragma GCC unroll 8
          for (int m = 0; m < MB; ++m) ai[m][j] = ai[m][j] + (float)xq[m * K + u * U + 8 * o + b] * wk;
        }
      }
    }
  }
}
#endif

// acc [MB][32] (fp32) = the rows' products with one column block, as the avx512bf16 tile computes them: per
// unit of U k (32, or 16 for GGUF's Q6_K), one exact sum of integer products per row and output (unit_dots
// with AVX2 or AVX-VNNI, else lane_dots), then scaled, unit after unit.
template <int BITS, bool ASYM, int U, int MB>
void tile(const int8_t* xq, const float* d, const int32_t* sums, int64_t K, int64_t G, const uint8_t* wb,
          const uint16_t* sb, const uint16_t* ob, float* acc) {
  using namespace funcspec::simd;
  constexpr int NV = 16 / W;  // registers per 16 outputs
  const int64_t units = K / U, per_group = G / U, blocks = K / AB;
  constexpr float zero = zero_point<BITS>();
  alignas(64) float sf[QB], of[QB];
  for (int i = 0; i < MB * QB; ++i) acc[i] = 0.0f;
  for (int64_t u = 0; u < units; ++u) {
    if (u % per_group == 0) {
      const int64_t g = u / per_group;
      for (int c = 0; c < QB; ++c) sf[c] = half_to_float(sb[g * QB + c]);
      if (ASYM)
        for (int c = 0; c < QB; ++c) of[c] = half_to_float(ob[g * QB + c]);
    }
    int32_t usum[MB];  // each row's sum of xq over the unit
    for (int m = 0; m < MB; ++m) {
      const int32_t* half = sums + m * 2 * blocks + u * U / 16;
      usum[m] = U == 16 ? half[0] : half[0] + half[1];
    }
#if defined(__AVX2__)
    alignas(32) int32_t dots[MB * QB];
    unit_dots<BITS, U, MB>(xq, K, u, usum, wb, dots);
#endif
    for (int h = 0; h < 2; ++h) {  // outputs 16h .. 16h + 15
      vf ai[MB][NV];
#if defined(__AVX2__)
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) ai[m][j] = cvt(load_u32(dots + m * QB + 16 * h + W * j));
#else
      lane_dots<BITS, U, MB>(xq, K, u, h, wb, ai);
#endif
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const float dm = d[m * blocks + u * U / AB];
        const float sum = (float)usum[m];
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) {
          const int c = 16 * h + W * j;
          const vf s = load(sf + c);
          float* am = acc + m * QB + c;
          if (ASYM) {
            const vf t = ai[m][j] * s - load(of + c) * sum;
            store(am, load(am) + t * dm);
          } else {
            store(am, load(am) + (ai[m][j] - zero * sum) * (s * dm));
          }
        }
      }
    }
  }
}

// Rows per pass: the MB rows' sums of 16 outputs fit 3/4 of the registers, the unpacked weights the rest.
template <int BITS, bool ASYM>
constexpr int max_rows() {
  constexpr int rows = funcspec::simd::REGS * 3 / 4 / (16 / funcspec::simd::W);
  return rows < 6 ? rows : 6;
}
constexpr int MAX_MB = 6;

#endif

// tile<BITS, ASYM, U, mb> for a runtime mb in [1, MB].
template <int BITS, bool ASYM, int U, int MB = max_rows<BITS, ASYM>()>
inline void tile_rows(int64_t mb, const int8_t* xq, const float* d, const int32_t* sums, int64_t K, int64_t G,
                      const uint8_t* wb, const uint16_t* sb, const uint16_t* ob, float* acc) {
  if constexpr (MB > 1) {
    if (mb < MB) return tile_rows<BITS, ASYM, U, MB - 1>(mb, xq, d, sums, K, G, wb, sb, ob, acc);
  }
  tile<BITS, ASYM, U, MB>(xq, d, sums, K, G, wb, sb, ob, acc);
}

// Rows per pass of a weight of `bits` (asym: with offsets), at run time.
inline int rows_per_pass(int bits, bool asym) {
  return bits == 4 && asym ? max_rows<4, true>() : bits == 6 ? max_rows<6, false>() : max_rows<8, false>();
}

// tile_rows for a weight's format known at run time: `bits` 8, 6 (symmetric, units of 16 k) or 4, offsets `ob`
// (null: symmetric), group G (16: GGUF's Q6_K); mb <= rows_per_pass(bits, ob != null).
inline void tile_any(int bits, int64_t mb, const int8_t* xq, const float* d, const int32_t* sums, int64_t K,
                     int64_t G, const uint8_t* wb, const uint16_t* sb, const uint16_t* ob, float* acc) {
  if (bits == 6) {
    tile_rows<6, false, 16>(mb, xq, d, sums, K, G, wb, sb, ob, acc);
  } else if (bits == 8 && G == 16) {
    if (ob) tile_rows<8, true, 16>(mb, xq, d, sums, K, G, wb, sb, ob, acc);
    else tile_rows<8, false, 16>(mb, xq, d, sums, K, G, wb, sb, ob, acc);
  } else if (bits == 8) {
    if (ob) tile_rows<8, true, 32>(mb, xq, d, sums, K, G, wb, sb, ob, acc);
    else tile_rows<8, false, 32>(mb, xq, d, sums, K, G, wb, sb, ob, acc);
  } else {
    if (ob) tile_rows<4, true, 32>(mb, xq, d, sums, K, G, wb, sb, ob, acc);
    else tile_rows<4, false, 32>(mb, xq, d, sums, K, G, wb, sb, ob, acc);
  }
}

}  // namespace funcspec::quantized
