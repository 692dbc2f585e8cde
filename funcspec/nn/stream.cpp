// Weight-streaming linear layers for decode on x86 CPUs with AVX-512 and AVX512-BF16.
//
// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows of x [M, K]
// and a big weight w [N, K] that is read from memory once per call.
//
// w comes packed by funcspec/nn/stream.py (see pack_weight there) into column
// blocks of 64 outputs, each one contiguous stream:
//   bf16: [N/64][K/2][64][2]  (each 64-output row of the block holds k pairs,
//                              the layout vdpbf16ps multiplies)
//   fp32: [N/64][K]  [64]
// so a step of k reads 256 contiguous bytes (4 zmm: 64 outputs) and multiplies
// them by the broadcast x[m, k] (or k pair) of up to MAX_MB rows at once: the
// accumulators are outputs, with no horizontal sums. Each thread takes whole
// column blocks and walks them front to back. No software prefetch: on a Zen 4
// EPYC the hardware prefetcher alone streamed the blocks at 40 GB/s against
// 30-33 GB/s with prefetches 1-4 KB ahead (the loads compete for the same
// ports). More rows than MAX_MB take several passes over a chunk of KC steps,
// which stays in L2.
//
// out[m, n] is one fp32 accumulator over k in order (its partial sums parked
// exactly in fp32 between chunks), whatever M is and however the rows are split
// into passes: a row's result does not depend on the rows beside it, so AR
// (1 row) and verification (K+1 rows) agree bit for bit.
//
// Plain C ABI, called through ctypes; OpenMP binds to torch's own libgomp, so
// it runs on torch's threads.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "bf16.h"

namespace {

constexpr int64_t BLOCK = 64;     // outputs per column block: 4 zmm of fp32 accumulators
constexpr int64_t STEP_BYTES = 256;  // weight bytes per k step (BLOCK outputs)
constexpr int64_t MAX_MB = 6;     // rows per pass: 6 x 4 accumulators + 4 weights = 28 zmm
constexpr int64_t KC = 256;       // k steps per chunk: 64 KB of a block, L2-resident for the next pass

struct BF16 {
  using T = uint16_t;
  static constexpr int64_t P = 2;  // k per step (a pair)
  // x[m, 2s], x[m, 2s + 1] in every 32-bit lane
  static __m512i broadcast(const T* x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm512_set1_epi32(v);
  }
  static __m512 dot(__m512 acc, __m512i x, __m512i w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
  static float bias(const T* b, int64_t n) { return funcspec::bf16_to_float(b[n]); }
  static T out(float f) { return funcspec::float_to_bf16(f); }
};

struct F32 {
  using T = float;
  static constexpr int64_t P = 1;
  static __m512i broadcast(const T* x) { return _mm512_castps_si512(_mm512_set1_ps(*x)); }
  static __m512 dot(__m512 acc, __m512i x, __m512i w) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(w), acc);
  }
  static float bias(const T* b, int64_t n) { return b[n]; }
  static T out(float f) { return f; }
};

// acc[m][0:64] += sum over steps s in [s0, s1) of x[m, s*P : s*P+P] . w_block[s]
// for MB rows of x (row stride K).
template <class E, int MB>
inline void tile(const typename E::T* x, int64_t K, const typename E::T* wb, int64_t s0, int64_t s1, float* acc) {
  using T = typename E::T;
  constexpr int64_t step = STEP_BYTES / sizeof(T);  // elements per step
  __m512 a[MB][4];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) a[m][j] = _mm512_loadu_ps(acc + m * BLOCK + 16 * j);
  for (int64_t s = s0; s < s1; ++s) {
    const T* w = wb + s * step;
    __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + step / 4),
            w2 = _mm512_loadu_si512(w + step / 2), w3 = _mm512_loadu_si512(w + 3 * step / 4);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = E::broadcast(x + m * K + s * E::P);
      a[m][0] = E::dot(a[m][0], xv, w0);
      a[m][1] = E::dot(a[m][1], xv, w1);
      a[m][2] = E::dot(a[m][2], xv, w2);
      a[m][3] = E::dot(a[m][3], xv, w3);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + m * BLOCK + 16 * j, a[m][j]);
}

template <class E>
inline void pass(const typename E::T* x, int64_t K, const typename E::T* wb, int64_t s0, int64_t s1, float* acc,
                 int64_t mb) {
  switch (mb) {
    case 6: tile<E, 6>(x, K, wb, s0, s1, acc); break;
    case 5: tile<E, 5>(x, K, wb, s0, s1, acc); break;
    case 4: tile<E, 4>(x, K, wb, s0, s1, acc); break;
    case 3: tile<E, 3>(x, K, wb, s0, s1, acc); break;
    case 2: tile<E, 2>(x, K, wb, s0, s1, acc); break;
    default: tile<E, 1>(x, K, wb, s0, s1, acc); break;
  }
}

// One column block [n0, n0 + 64) for all M rows; acc is [M][64] scratch.
template <class E>
void block(const typename E::T* x, const typename E::T* wb, const typename E::T* bias, typename E::T* out, int64_t M,
           int64_t N, int64_t K, int64_t n0, float* acc) {
  const int64_t steps = K / E::P;
  // Rows spread evenly over the fewest passes (5 rows: one pass of 5, not 4 + 1).
  const int64_t passes = (M + MAX_MB - 1) / MAX_MB;
  memset(acc, 0, sizeof(float) * M * BLOCK);
  for (int64_t s0 = 0; s0 < steps; s0 += KC) {
    const int64_t s1 = s0 + KC < steps ? s0 + KC : steps;
    for (int64_t p = 0, m0 = 0; p < passes; ++p) {
      const int64_t mb = M / passes + (p < M % passes);
      pass<E>(x + m0 * K, K, wb, s0, s1, acc + m0 * BLOCK, mb);
      m0 += mb;
    }
  }
  const int64_t cols = N - n0 < BLOCK ? N - n0 : BLOCK;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < cols; ++c)
      out[m * N + n0 + c] = E::out(acc[m * BLOCK + c] + (bias ? E::bias(bias, n0 + c) : 0.0f));
}

template <class E>
void linear(const typename E::T* x, const typename E::T* w, const typename E::T* bias, typename E::T* out,
            int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  const int64_t block_elems = BLOCK * K;  // K is a multiple of P (stream.py pads it)
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> acc(M * BLOCK);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b)
      block<E>(x, w + b * block_elems, bias, out, M, N, K, b * BLOCK, acc.data());
  }
}

}  // namespace

extern "C" {

// x [M, K], w packed [ceil(N/64)][K/2][64][2], bias [N] or null, out [M, N]; K even.
void funcspec_linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t M,
                          int64_t N, int64_t K, int threads) {
  linear<BF16>(x, w, bias, out, M, N, K, threads);
}

// x [M, K], w packed [ceil(N/64)][K][64], bias [N] or null, out [M, N].
void funcspec_linear_f32(const float* x, const float* w, const float* bias, float* out, int64_t M, int64_t N,
                         int64_t K, int threads) {
  linear<F32>(x, w, bias, out, M, N, K, threads);
}
}
