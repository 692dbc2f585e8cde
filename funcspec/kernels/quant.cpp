// Quantized linear layers for decode, on every build of the kernels (build.py): VNNI on avx512bf16.
//
// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows of x [M, K] (bf16 or fp32) and a
// quantized weight w [N, K]: 8-, 6- or 4-bit unsigned values q, with one scale s (and, asymmetric, one
// offset o) per output and group of G consecutive k (G a multiple of 32, G = K for per-channel; or
// 16 for 8- and 6-bit weights, GGUF's Q6_K sub-blocks; 6-bit weights are symmetric):
//
//   w[n, k] = s[n, g] * (q[n, k] - zero)   symmetric: zero = 128 (8-bit), 32 (6-bit) or 8 (4-bit)
//   w[n, k] = s[n, g] * q[n, k] - o[n, g]  asymmetric (GGUF Q4_K's mins, GPTQ/AWQ zero points)
//
// The activations are quantized per row and block of 32 k, as llama.cpp's Q8 activations are:
// xq = round(x / d) in [-127, 127] with d = max|x| / 127, and the block sum of xq. A block's dot
// is then one integer sum (vpdpbusd: 4 u8 x s8 products into each int32 lane; the other builds sum the
// same integer products in fp32 lanes, exactly), and
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
//   6-bit: q [N/32][3K/16][32][4] a unit of 16 k in 3 steps: the low 4 bits of its k as two 4-bit steps,
//                                 then byte j of an output holds the high 2 bits of k = 4i + j at bits 2i
//                                 (put back together in registers); llama.cpp's Q6_K streams as few bits
//   s, o  [N/32][K/G][32] fp16
//
// Plain C ABI, called through ctypes; OpenMP binds to torch's own libgomp.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include <omp.h>

#include "quant.h"

namespace {

using namespace funcspec::quantized;

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
  if (bits == 6) {
    qlinear<T, 6, false, 16>(x, q, s, o, bias, out, M, N, K, G, threads);
    return;
  }
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
// a multiple of 32 dividing K, or 16 for 8- and 6-bit weights.
void funcspec_qlinear_bf16(const uint16_t* x, const uint8_t* q, const uint16_t* s, const uint16_t* o,
                           const uint16_t* bias, uint16_t* out, int64_t M, int64_t N, int64_t K, int64_t G, int bits,
                           int threads) {
  dispatch<uint16_t>(x, q, s, o, bias, out, M, N, K, G, bits, threads);
}

void funcspec_qlinear_f32(const float* x, const uint8_t* q, const uint16_t* s, const uint16_t* o, const float* bias,
                          float* out, int64_t M, int64_t N, int64_t K, int64_t G, int bits, int threads) {
  dispatch<float>(x, q, s, o, bias, out, M, N, K, G, bits, threads);
}

// How far ahead the quantized tiles prefetch their weights (quant.h's prefetch_ahead), for the whole library.
void funcspec_set_quant_prefetch(int64_t bytes) { funcspec::quantized::prefetch_ahead() = bytes; }
}
