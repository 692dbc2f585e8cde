// Weight-streaming linear layers for decode, on every build of the kernels (funcspec/kernels/build.py).
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
// Rows per pass (avx512bf16). Up to 6 rows take all 64 columns in one pass (6 x 4
// accumulators + 4 weights = 28 zmm). 7 to 12 rows take the chunk's columns in
// two halves of 32 (12 x 2 + 2 = 26 zmm): the second half reads the chunk from
// L2. 13 to 24 rows take two such passes. More rows (prefill) are compute-bound
// and take passes of up to 6 rows over all 64 columns, which issue fewer loads
// per multiply-add. The other builds split the 64 columns to fit their registers.
//
// Prefetch. At 1-5 rows the hardware prefetcher alone streams the blocks best
// (software prefetches compete with the loads for the same ports). With more
// rows, the multiply-adds hold the loads back and the memory sits idle while
// the chunk is computed, so the first pass over a chunk of 6 rows or more also
// prefetches the next chunk into L2, at the pace it consumes this one.
//
// The measurements behind these choices: graphs/results/notes/kernels.md.
//
// out[m, n] is one fp32 accumulator over k in order (its partial sums parked
// exactly in fp32 between chunks and halves), whatever M is and however the
// rows are split into passes: a row's result does not depend on the rows
// beside it, so AR (1 row) and verification (K+1 rows) agree bit for bit.
//
// Plain C ABI, called through ctypes; OpenMP binds to torch's own libgomp, so
// it runs on torch's threads.
//
// The tiles, passes and column blocks are in stream.h (the routed-expert kernel, moe.cpp, streams its
// experts with them).
#include <stdint.h>

#include <atomic>
#include <vector>

#include <omp.h>

#include "stream.h"

namespace {

using namespace funcspec::streaming;

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
    // Each thread takes runs of contiguous blocks as it frees up (guided: see take).
    for (int64_t b0, b1; take(taken, blocks, team, &b0, &b1);)
      for (int64_t b = b0; b < b1; ++b)
        block<E>(x, w + b * block_elems, bias, out, M, N, K, b * BLOCK, acc.data(), b + 1 < b1);
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
