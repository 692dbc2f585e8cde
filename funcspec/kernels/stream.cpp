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
// them by the broadcast x[m, k] (or k pair) of several rows at once: the
// accumulators are outputs, with no horizontal sums. Each thread takes whole
// column blocks (runs of them, handed out as the threads free up) and walks
// them front to back, in chunks of KC steps (64 KB).
//
// Rows per pass. Up to 6 rows take all 64 columns in one pass (6 x 4
// accumulators + 4 weights = 28 zmm). 7 to 12 rows take the chunk's columns in
// two halves of 32 (12 x 2 + 2 = 26 zmm): the second half reads the chunk from
// L2. 13 to 24 rows take two such passes. More rows (prefill) are compute-bound
// and take passes of up to 6 rows over all 64 columns, which issue fewer loads
// per multiply-add (at 128 rows, 0.73x the time of 12-row half passes; at 32
// rows 0.89x).
//
// Prefetch. At 1-4 rows the hardware prefetcher alone streams the blocks best
// (40 GB/s on a 2-core Zen 4 EPYC, against 30-33 GB/s with software prefetches
// 1-4 KB ahead: the loads compete for the same ports). With more rows, the
// multiply-adds hold the loads back and the memory sits idle while the chunk
// is computed (and wholly idle during the L2 passes), so the first pass over a
// chunk of 6 rows or more also prefetches the next chunk into L2, at the pace
// it consumes this one. Over the 65 fused products of a Llama-3.2-1B shape,
// interleaved with the kernel before it (6-row passes, no prefetch), 8 rows
// took 0.52-0.72x the time, 6 rows 0.73-0.94x and 16 rows 0.80x. At 5 rows it
// swung between 0.81x and 1.09x with the VM's memory speed, so 5 rows (a K = 4
// verify) keep the hardware prefetcher alone.
//
// out[m, n] is one fp32 accumulator over k in order (its partial sums parked
// exactly in fp32 between chunks and halves), whatever M is and however the
// rows are split into passes: a row's result does not depend on the rows
// beside it, so AR (1 row) and verification (K+1 rows) agree bit for bit.
//
// Plain C ABI, called through ctypes; OpenMP binds to torch's own libgomp, so
// it runs on torch's threads.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include <omp.h>

#include "bf16.h"

namespace {

constexpr int64_t BLOCK = 64;     // outputs per column block: 4 zmm of fp32 accumulators
constexpr int64_t STEP_BYTES = 256;  // weight bytes per k step (BLOCK outputs)
constexpr int FULL_MB = 6;        // rows of a pass over all 64 columns: 6 x 4 accumulators + 4 weights = 28 zmm
constexpr int HALF_MB = 12;       // rows of a pass in two halves of 32 columns: 12 x 2 + 2 = 26 zmm
constexpr int HALF_ROWS = 24;     // products of up to this many rows take half passes, more take full ones
constexpr int PREFETCH_MB = 6;    // passes of this many rows or more prefetch the next chunk
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

// acc[m][16 J0 : 16 (J0 + NJ)] += sum over steps s in [s0, s1) of x[m, s*P : s*P+P] . w_block[s]
// for MB rows of x (row stride K): NJ of the step's 4 zmm of weights, starting at zmm J0. With pf
// and at least PREFETCH_MB rows, each step also prefetches NJ lines at pf + 64 NJ (s - s0) into L2
// (the next chunk, at the pace this one is read).
template <class E, int MB, int J0, int NJ>
inline void tile(const typename E::T* x, int64_t K, const typename E::T* wb, int64_t s0, int64_t s1, float* acc,
                 const char* pf) {
  using T = typename E::T;
  constexpr int64_t step = STEP_BYTES / sizeof(T);  // elements per step
  constexpr int64_t zmm = step / 4;                 // elements per zmm of weights
  __m512 a[MB][NJ];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) a[m][j] = _mm512_loadu_ps(acc + m * BLOCK + 16 * (J0 + j));
  for (int64_t s = s0; s < s1; ++s) {
    if (MB >= PREFETCH_MB && pf) {
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) _mm_prefetch(pf + 64 * (NJ * (s - s0) + j), _MM_HINT_T1);
    }
    __m512i w[NJ];
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) w[j] = _mm512_loadu_si512(wb + s * step + (J0 + j) * zmm);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = E::broadcast(x + m * K + s * E::P);
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) a[m][j] = E::dot(a[m][j], xv, w[j]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) _mm512_storeu_ps(acc + m * BLOCK + 16 * (J0 + j), a[m][j]);
}

// One pass of MB rows over steps [s0, s1): all 64 columns at once, or (above FULL_MB rows) two halves of 32.
template <class E, int MB>
inline void pass(const typename E::T* x, int64_t K, const typename E::T* wb, int64_t s0, int64_t s1, float* acc,
                 const char* pf) {
  if constexpr (MB <= FULL_MB) {
    tile<E, MB, 0, 4>(x, K, wb, s0, s1, acc, pf);
  } else {
    tile<E, MB, 0, 2>(x, K, wb, s0, s1, acc, pf);
    tile<E, MB, 2, 2>(x, K, wb, s0, s1, acc, pf ? pf + 128 * (s1 - s0) : nullptr);
  }
}

// pass<E, mb> for a runtime mb in [1, MB].
template <class E, int MB = HALF_MB>
inline void pass_rows(int64_t mb, const typename E::T* x, int64_t K, const typename E::T* wb, int64_t s0, int64_t s1,
                      float* acc, const char* pf) {
  if constexpr (MB > 1) {
    if (mb < MB) return pass_rows<E, MB - 1>(mb, x, K, wb, s0, s1, acc, pf);
  }
  pass<E, MB>(x, K, wb, s0, s1, acc, pf);
}

// One column block [n0, n0 + 64) for all M rows; acc is [M][64] scratch. follows: the thread's next
// block comes right after this one, so its last chunk prefetches that block's first.
template <class E>
void block(const typename E::T* x, const typename E::T* wb, const typename E::T* bias, typename E::T* out, int64_t M,
           int64_t N, int64_t K, int64_t n0, float* acc, bool follows) {
  const int64_t steps = K / E::P;
  // Rows spread evenly over the fewest passes (5 rows: one pass of 5, not 4 + 1; 14 rows: 7 + 7).
  const int64_t most = M <= FULL_MB || M > HALF_ROWS ? FULL_MB : HALF_MB;
  const int64_t passes = (M + most - 1) / most;
  constexpr int64_t step = STEP_BYTES / sizeof(typename E::T);
  memset(acc, 0, sizeof(float) * M * BLOCK);
  for (int64_t s0 = 0; s0 < steps; s0 += KC) {
    const int64_t s1 = s0 + KC < steps ? s0 + KC : steps;
    const char* next = s1 < steps || follows ? reinterpret_cast<const char*>(wb + s1 * step) : nullptr;
    for (int64_t p = 0, m0 = 0; p < passes; ++p) {
      const int64_t mb = M / passes + (p < M % passes);
      pass_rows<E>(mb, x + m0 * K, K, wb, s0, s1, acc + m0 * BLOCK, p == 0 ? next : nullptr);
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
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t team = omp_get_num_threads();
    std::vector<float> acc(M * BLOCK);
    // Guided self-scheduling: each thread takes runs of contiguous blocks, a share of what is left that shrinks
    // to one block at the end. On a VM the cores' speeds differ from moment to moment, and equal static shares
    // left the faster one waiting at the join (libgomp's spin took 13% of a bf16 decode's samples).
    for (;;) {
      int64_t b0 = taken.load(std::memory_order_relaxed), run = 0;
      do {
        run = std::max<int64_t>(1, (blocks - b0) / (2 * team));
      } while (b0 < blocks && !taken.compare_exchange_weak(b0, b0 + run, std::memory_order_relaxed));
      if (b0 >= blocks) break;
      const int64_t b1 = std::min(b0 + run, blocks);
      for (int64_t b = b0; b < b1; ++b)
        block<E>(x, w + b * block_elems, bias, out, M, N, K, b * BLOCK, acc.data(), b + 1 < b1);
    }
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
