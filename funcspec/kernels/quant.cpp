// Quantized linear layers for decode on x86 CPUs with AVX-512 and AVX512-VNNI.
//
// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows of x [M, K] (bf16 or fp32) and a
// quantized weight w [N, K]: 8- or 4-bit unsigned values q, with one scale s (and, asymmetric, one
// offset o) per output and group of G consecutive k (G a multiple of 32, G = K for per-channel; or
// 16 for 8-bit weights, GGUF's Q6_K sub-blocks):
//
//   w[n, k] = s[n, g] * (q[n, k] - zero)   symmetric: zero = 128 (8-bit) or 8 (4-bit)
//   w[n, k] = s[n, g] * q[n, k] - o[n, g]  asymmetric (GGUF Q4_K's mins, GPTQ/AWQ zero points)
//
// The activations are quantized per row and block of 32 k, as llama.cpp's Q8 activations are:
// xq = round(x / d) in [-127, 127] with d = max|x| / 127, and the block sum of xq. A block's dot
// is then one integer sum (vpdpbusd: 4 u8 x s8 products into each int32 lane), exact, and
//
//   out[m, n] += d[m, b] * s[n, g] * (sum_k xq q - zero * sum_k xq)        symmetric
//   out[m, n] += d[m, b] * (s[n, g] * sum_k xq q - o[n, g] * sum_k xq)     asymmetric
//
// in fp32, block after block in order: a row's result does not depend on the rows beside it, so
// AR (1 row) and verification (K+1 rows) agree bit for bit, at every row count.
//
// Layout (funcspec/kernels/quant.py packs it), in column blocks of 32 outputs, each one stream:
//   8-bit: q [N/32][K/4][32][4]   a step of 4 k: 32 outputs x 4 bytes (2 zmm)
//   4-bit: q [N/32][K/8][32][4]   a step of 8 k: byte j of an output holds k = 8s + j in its low
//                                 nibble and k = 8s + 4 + j in its high one (2 zmm, split in registers)
//   s, o  [N/32][K/G][32] fp16
//
// Plain C ABI, called through ctypes; OpenMP binds to torch's own libgomp.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include <omp.h>

#include "bf16.h"

namespace {

constexpr int64_t QB = 32;    // outputs per column block: 2 zmm of fp32 accumulators
constexpr int64_t AB = 32;    // k per activation block (one scale and one sum per row)
constexpr int64_t STEP = 128;  // weight bytes per step (QB outputs x 4 bytes)

using funcspec::from_float;
using funcspec::to_float;

// Row m of x [M, K] as int8 blocks of 32: xq [K], d [K/32], and the sums of each half block, sums [K/16].
template <class T>
void quantize_row(const T* x, int64_t K, int8_t* xq, float* d, int32_t* sums) {
  for (int64_t b = 0; b < K / AB; ++b) {
    float v[AB], amax = 0.0f;
    for (int64_t i = 0; i < AB; ++i) {
      v[i] = to_float<T>(x[b * AB + i]);
      amax = std::max(amax, fabsf(v[i]));
    }
    const float scale = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum[2] = {0, 0};
    for (int64_t i = 0; i < AB; ++i) {
      const int32_t q = (int32_t)nearbyintf(v[i] * inv);  // round half to even, as torch.round
      xq[b * AB + i] = (int8_t)std::min(127, std::max(-127, q));
      sum[i / 16] += xq[b * AB + i];
    }
    d[b] = scale;
    sums[2 * b] = sum[0];
    sums[2 * b + 1] = sum[1];
  }
}

inline __m512 load_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// acc [MB][32] (fp32) += the rows' products with one column block, over every k, in units of U k (32, or 16
// for 8-bit weights in groups of 16: GGUF's Q6_K), each one integer sum per row and output.
template <int BITS, bool ASYM, int U, int MB>
void tile(const int8_t* xq, const float* d, const int32_t* sums, int64_t K, int64_t G, const uint8_t* wb,
          const uint16_t* sb, const uint16_t* ob, float* acc) {
  const int64_t units = K / U, per_group = G / U, blocks = K / AB;
  const __m512i low = _mm512_set1_epi8(0x0F);
  constexpr int32_t zero = BITS == 8 ? 128 : 8;
  __m512 af[MB][2];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) af[m][0] = af[m][1] = _mm512_setzero_ps();
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, o0 = s0, o1 = s0;
  for (int64_t u = 0; u < units; ++u) {
    if (u % per_group == 0) {
      const int64_t g = u / per_group;
      s0 = load_half(sb + g * QB);
      s1 = load_half(sb + g * QB + 16);
      if (ASYM) {
        o0 = load_half(ob + g * QB);
        o1 = load_half(ob + g * QB + 16);
      }
    }
    __m512i ai[MB][2];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) ai[m][0] = ai[m][1] = _mm512_setzero_si512();
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
    } else {
      const uint8_t* w = wb + u * 4 * STEP;
#pragma GCC unroll 4
      for (int o = 0; o < 4; ++o) {
        const __m512i v0 = _mm512_loadu_si512(w + o * STEP), v1 = _mm512_loadu_si512(w + o * STEP + 64);
        const __m512i lo0 = _mm512_and_si512(v0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
        const __m512i lo1 = _mm512_and_si512(v1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          int32_t va, vb;
          memcpy(&va, xq + m * K + u * U + o * 8, 4);
          memcpy(&vb, xq + m * K + u * U + o * 8 + 4, 4);
          const __m512i xa = _mm512_set1_epi32(va), xb = _mm512_set1_epi32(vb);
          ai[m][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ai[m][0], lo0, xa), hi0, xb);
          ai[m][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ai[m][1], lo1, xa), hi1, xb);
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const float dm = d[m * blocks + u * U / AB];
      const int32_t* half = sums + m * 2 * blocks + u * U / 16;
      const int32_t sum = U == 16 ? half[0] : half[0] + half[1];
      if (ASYM) {
        const __m512 sx = _mm512_set1_ps((float)sum), dv = _mm512_set1_ps(dm);
        const __m512 t0 = _mm512_fnmadd_ps(o0, sx, _mm512_mul_ps(_mm512_cvtepi32_ps(ai[m][0]), s0));
        const __m512 t1 = _mm512_fnmadd_ps(o1, sx, _mm512_mul_ps(_mm512_cvtepi32_ps(ai[m][1]), s1));
        af[m][0] = _mm512_fmadd_ps(t0, dv, af[m][0]);
        af[m][1] = _mm512_fmadd_ps(t1, dv, af[m][1]);
      } else {
        const __m512i corr = _mm512_set1_epi32(zero * sum);
        const __m512 dv = _mm512_set1_ps(dm);
        af[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ai[m][0], corr)), _mm512_mul_ps(s0, dv),
                                   af[m][0]);
        af[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ai[m][1], corr)), _mm512_mul_ps(s1, dv),
                                   af[m][1]);
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
// their unpacked nibbles and offsets, so 4 rows. 5 rows (a K = 4 verify) then take one pass (3 + 2 took 1.5x the
// time at 4 bits).
template <int BITS, bool ASYM>
constexpr int max_rows() {
  return BITS == 4 && ASYM ? 4 : 6;
}
constexpr int MAX_MB = 6;

// tile<BITS, ASYM, U, mb> for a runtime mb in [1, MB].
template <int BITS, bool ASYM, int U, int MB = max_rows<BITS, ASYM>()>
inline void tile_rows(int64_t mb, const int8_t* xq, const float* d, const int32_t* sums, int64_t K, int64_t G,
                      const uint8_t* wb, const uint16_t* sb, const uint16_t* ob, float* acc) {
  if constexpr (MB > 1) {
    if (mb < MB) return tile_rows<BITS, ASYM, U, MB - 1>(mb, xq, d, sums, K, G, wb, sb, ob, acc);
  }
  tile<BITS, ASYM, U, MB>(xq, d, sums, K, G, wb, sb, ob, acc);
}

template <class T, int BITS, bool ASYM, int U>
void qlinear(const T* x, const uint8_t* q, const uint16_t* s, const uint16_t* o, const T* bias, T* out, int64_t M,
             int64_t N, int64_t K, int64_t G, int threads) {
  const int64_t blocks = K / AB, nb = (N + QB - 1) / QB;
  std::vector<int8_t> xq(M * K);
  std::vector<float> d(M * blocks);
  std::vector<int32_t> sums(M * 2 * blocks);
#pragma omp parallel for num_threads(threads) if (threads > 1 && M > 1)
  for (int64_t m = 0; m < M; ++m) quantize_row<T>(x + m * K, K, xq.data() + m * K, d.data() + m * blocks,
                                                   sums.data() + m * 2 * blocks);
  const int64_t block_bytes = K * BITS / 8 * QB, groups = K / G;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> acc(MAX_MB * QB);
#pragma omp for schedule(guided)
    for (int64_t nbk = 0; nbk < nb; ++nbk) {
      const uint8_t* wb = q + nbk * block_bytes;
      const uint16_t* sb = s + nbk * groups * QB;
      const uint16_t* ob = ASYM ? o + nbk * groups * QB : nullptr;
      const int64_t n0 = nbk * QB, cols = std::min(QB, N - n0);
      // Rows spread evenly over the fewest passes (7 rows: 4 + 3, not 6 + 1): each pass re-reads the
      // block, from L2 after the first.
      constexpr int64_t most = max_rows<BITS, ASYM>();
      const int64_t passes = (M + most - 1) / most;
      for (int64_t p = 0, m0 = 0; p < passes; ++p) {
        const int64_t mb = M / passes + (p < M % passes);
        tile_rows<BITS, ASYM, U>(mb, xq.data() + m0 * K, d.data() + m0 * blocks, sums.data() + m0 * 2 * blocks,
                                 K, G, wb, sb, ob, acc.data());
        for (int64_t m = 0; m < mb; ++m)
          for (int64_t c = 0; c < cols; ++c)
            out[(m0 + m) * N + n0 + c] =
                from_float<T>(acc[m * QB + c] + (bias ? to_float<T>(bias[n0 + c]) : 0.0f));
        m0 += mb;
      }
    }
  }
}

template <class T>
void dispatch(const T* x, const uint8_t* q, const uint16_t* s, const uint16_t* o, const T* bias, T* out, int64_t M,
              int64_t N, int64_t K, int64_t G, int bits, int threads) {
  if (bits == 8 && G == 16) {
    if (o) qlinear<T, 8, true, 16>(x, q, s, o, bias, out, M, N, K, G, threads);
    else qlinear<T, 8, false, 16>(x, q, s, o, bias, out, M, N, K, G, threads);
    return;
  }
  if (bits == 8 && !o) qlinear<T, 8, false, 32>(x, q, s, o, bias, out, M, N, K, G, threads);
  if (bits == 8 && o) qlinear<T, 8, true, 32>(x, q, s, o, bias, out, M, N, K, G, threads);
  if (bits == 4 && !o) qlinear<T, 4, false, 32>(x, q, s, o, bias, out, M, N, K, G, threads);
  if (bits == 4 && o) qlinear<T, 4, true, 32>(x, q, s, o, bias, out, M, N, K, G, threads);
}

}  // namespace

extern "C" {

// x [M, K], q / s / o packed as above (o null: symmetric), bias [N] or null, out [M, N]; K a multiple of 32, G
// a multiple of 32 dividing K, or 16 for 8-bit weights.
void funcspec_qlinear_bf16(const uint16_t* x, const uint8_t* q, const uint16_t* s, const uint16_t* o,
                           const uint16_t* bias, uint16_t* out, int64_t M, int64_t N, int64_t K, int64_t G, int bits,
                           int threads) {
  dispatch<uint16_t>(x, q, s, o, bias, out, M, N, K, G, bits, threads);
}

void funcspec_qlinear_f32(const float* x, const uint8_t* q, const uint16_t* s, const uint16_t* o, const float* bias,
                          float* out, int64_t M, int64_t N, int64_t K, int64_t G, int bits, int threads) {
  dispatch<float>(x, q, s, o, bias, out, M, N, K, G, bits, threads);
}
}
