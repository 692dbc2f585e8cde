// The weight-streaming tiles of stream.cpp, shared with the routed-expert kernel (moe.cpp).
//
// A column block of 64 outputs of a weight packed by funcspec/kernels/stream.py (pack_weight) is
// multiplied by M rows of x in passes of a few rows, each output one fp32 accumulator over k in order:
// stream.cpp's header says why. The avx512bf16 build's tiles are AVX-512 intrinsics (vdpbf16ps); the
// other builds' are simd.h's vectors, the same layout and order of k.
#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <atomic>

#include "bf16.h"
#include "simd.h"
#if defined(FUNCSPEC_ISA_AVX512BF16)
#include <immintrin.h>
#endif

namespace funcspec::streaming {

constexpr int64_t BLOCK = 64;     // outputs per column block: 4 zmm of fp32 accumulators
constexpr int64_t STEP_BYTES = 256;  // weight bytes per k step (BLOCK outputs)
constexpr int PREFETCH_MB = 6;    // passes of this many rows or more prefetch the next chunk
constexpr int64_t KC = 256;       // k steps per chunk: 64 KB of a block, L2-resident for the next pass

#if defined(FUNCSPEC_ISA_AVX512BF16)
constexpr int FULL_MB = 6;        // rows of a pass over all 64 columns: 6 x 4 accumulators + 4 weights = 28 zmm
constexpr int HALF_MB = 12;       // rows of a pass in two halves of 32 columns: 12 x 2 + 2 = 26 zmm
constexpr int HALF_ROWS = 24;     // products of up to this many rows take half passes, more take full ones

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

#else  // the portable builds: simd.h's vectors

// A pass keeps its accumulators in 3/4 of the registers (the rest: weights); 16 columns take NV of them.
constexpr int NV = 16 / funcspec::simd::W;
constexpr int ACC = funcspec::simd::REGS * 3 / 4;
constexpr int FULL_MB = ACC / NV < 6 ? ACC / NV : 6;  // rows a pass takes at most; its columns split to fit (pass)
constexpr int HALF_MB = FULL_MB;
constexpr int HALF_ROWS = 0;

struct BF16 {
  using T = uint16_t;
  static constexpr int64_t P = 2;
  static float bias(const T* b, int64_t n) { return funcspec::bf16_to_float(b[n]); }
  static T out(float f) { return funcspec::float_to_bf16(f); }
};

struct F32 {
  using T = float;
  static constexpr int64_t P = 1;
  static float bias(const T* b, int64_t n) { return b[n]; }
  static T out(float f) { return f; }
};

// acc[m][16 J0 : 16 (J0 + NJ)] += sum over steps s in [s0, s1) of x[m, s*P : s*P+P] . w_block[s], as the
// avx512bf16 tile: per output, k in order (bf16: the even k of a pair, then the odd one).
template <class E, int MB, int J0, int NJ>
inline void tile(const typename E::T* x, int64_t K, const typename E::T* wb, int64_t s0, int64_t s1, float* acc,
                 const char* pf) {
  using namespace funcspec::simd;
  using T = typename E::T;
  constexpr int64_t step = STEP_BYTES / sizeof(T);  // elements per step
  constexpr int64_t vec = W * 4 / sizeof(T);         // elements per register of weights
  constexpr int V = NJ * NV;                         // registers per row
  const int64_t c0 = 16 * J0;                        // first column
  vf a[MB][V];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) a[m][j] = load(acc + m * BLOCK + c0 + W * j);
  for (int64_t s = s0; s < s1; ++s) {
    if (MB >= PREFETCH_MB && pf) {
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) prefetch_l2(pf + 64 * (NJ * (s - s0) + j));
    }
    const T* ws = wb + s * step + c0 * E::P;
    if constexpr (E::P == 2) {
      float x0[MB], x1[MB];
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        x0[m] = funcspec::bf16_to_float(x[m * K + 2 * s]);
        x1[m] = funcspec::bf16_to_float(x[m * K + 2 * s + 1]);
      }
#pragma GCC unroll 16
      for (int j = 0; j < V; ++j) {
        const vu u = load_u32(ws + j * vec);
        const vf lo = as_float(u << 16), hi = as_float(u & 0xffff0000u);  // w[c, 2s], w[c, 2s + 1]
#pragma GCC unroll 16
        for (int m = 0; m < MB; ++m) {
          a[m][j] = a[m][j] + x0[m] * lo;
          a[m][j] = a[m][j] + x1[m] * hi;
        }
      }
    } else {
#pragma GCC unroll 16
      for (int j = 0; j < V; ++j) {
        const vf w = load(reinterpret_cast<const float*>(ws) + j * vec);
#pragma GCC unroll 16
        for (int m = 0; m < MB; ++m) a[m][j] = a[m][j] + reinterpret_cast<const float*>(x)[m * K + s] * w;
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) store(acc + m * BLOCK + c0 + W * j, a[m][j]);
}

// One pass of MB rows over steps [s0, s1): the 64 columns in the fewest parts of 64, 32 or 16 whose
// accumulators fit ACC (the later parts read the chunk from L1 / L2).
template <class E, int MB>
inline void pass(const typename E::T* x, int64_t K, const typename E::T* wb, int64_t s0, int64_t s1, float* acc,
                 const char* pf) {
  constexpr int NJ = MB * 4 * NV <= ACC ? 4 : MB * 2 * NV <= ACC ? 2 : 1;
  const int64_t part = 64 * NJ * (s1 - s0);  // prefetch bytes per part
  tile<E, MB, 0, NJ>(x, K, wb, s0, s1, acc, pf);
  if constexpr (NJ <= 2) tile<E, MB, NJ, NJ>(x, K, wb, s0, s1, acc, pf ? pf + part : nullptr);
  if constexpr (NJ == 1) {
    tile<E, MB, 2, 1>(x, K, wb, s0, s1, acc, pf ? pf + 2 * part : nullptr);
    tile<E, MB, 3, 1>(x, K, wb, s0, s1, acc, pf ? pf + 3 * part : nullptr);
  }
}

#endif

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

// Guided self-scheduling of `total` work items over a team of `team` threads: the next run [*b0, *b1) of
// contiguous items, a share of what is left that shrinks to one item at the end; false when none is left.
// NOTE: on a VM the cores' speeds differ from moment to moment, and equal static shares left the faster one
// waiting at the join (libgomp's spin).
inline bool take(std::atomic<int64_t>& taken, int64_t total, int64_t team, int64_t* b0, int64_t* b1) {
  int64_t start = taken.load(std::memory_order_relaxed), run = 0;
  do {
    run = std::max<int64_t>(1, (total - start) / (2 * team));
  } while (start < total && !taken.compare_exchange_weak(start, start + run, std::memory_order_relaxed));
  *b0 = start;
  *b1 = std::min(start + run, total);
  return start < total;
}

}  // namespace funcspec::streaming
