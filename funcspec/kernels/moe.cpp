// Routed experts of a mixture-of-experts layer for decode, on every build of the kernels (build.py).
//
// out[t] = sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j], for a few tokens x [T, H]
// and experts far beyond the caches: each selected expert's weights are read from memory once per call,
// for every token routed to it (a grouped product over the union of the selected experts).
//
// The experts come packed by funcspec/kernels/moe.py (pack_gate_up, pack_down), each one stream.h's
// column blocks of 64 outputs:
//   gate_up [E][I'/32][H'/P][64][P]  block b holds gate rows 32b..32b+31, then up rows 32b..32b+31
//   down    [E][H'/64][I'/P][64][P]  (P = 2 for bf16, 1 for fp32; I' = I rounded up to 32, zero rows
//                                     and columns; H' = H rounded up to P for gate_up, to 64 for down)
// so a gate_up block gives the gate and up of the same 32 intermediate units, and the thread that
// computed it applies silu(gate) * up there: no pass over the intermediate of its own.
//
// A call groups the slots (t, j) by expert (a counting sort: within an expert, in token order), then runs
// one list of work items in one parallel region: the union's gate_up blocks, then its down blocks, expert
// after expert, handed out as the threads free up (stream.h's take), so a run of items is one contiguous
// stream. A down block waits only until its own expert's gate_up blocks are done, not for a barrier: with
// other processes on the cores, a barrier stalls whenever one thread waits for a core. The weighted sums
// over each token's slots (T·k·H multiply-adds) follow the join.
//
// Rounding follows the torch reference (funcspec/kernels/moe.py): gate, up, silu(gate), the product
// and each expert's output are rounded to the weights' dtype; the weighted sum over a token's slots is
// fp32, rounded once. Every output of a product sums over k in one fixed order whatever rows share its
// pass (stream.h), and a token's slot sum runs j = 0..k-1: a token's result does not depend on which
// tokens share the call, so AR (1 token) and verification (K+1) agree bit for bit.
//
// Quantized experts (qexperts, below) take the same plan with quant.h's tiles in place of stream.h's.
//
// Ids outside [0, E) select nothing (their slot adds nothing), as in the reference.
//
// Plain C ABI, called through ctypes; OpenMP binds to torch's own libgomp.
#include <math.h>
#include <stdint.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include <omp.h>

#include "quant.h"
#include "stream.h"

namespace {

using funcspec::from_float;
using funcspec::to_float;
using namespace funcspec::streaming;

constexpr int64_t HALF = BLOCK / 2;  // intermediate units per gate_up block
constexpr int64_t SERIAL_MACS = 1 << 18;  // slot sums of fewer multiply-adds run on one thread

// The slots (t, j) grouped by expert: rows[r] is the slot of row r, experts in id order, each expert's
// rows in slot order; row_of[s] is slot s's row (-1: its id selects no expert).
struct Groups {
  std::vector<int64_t> rows, row_of, experts, start;  // start[u]: first row of the union's u-th expert
  int64_t most = 0;                                   // the largest group
};

Groups group(const int64_t* ids, int64_t slots, int64_t E) {
  Groups g;
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t s = 0; s < slots; ++s)
    if (ids[s] >= 0 && ids[s] < E) ++count[ids[s] + 1];
  for (int64_t e = 0; e < E; ++e) {
    if (count[e + 1]) {
      g.experts.push_back(e);
      g.start.push_back(count[e]);
      g.most = std::max(g.most, count[e + 1]);
    }
    count[e + 1] += count[e];
  }
  g.start.push_back(count[E]);
  g.rows.resize(count[E]);
  g.row_of.assign(slots, -1);
  for (int64_t s = 0; s < slots; ++s)
    if (ids[s] >= 0 && ids[s] < E) {
      g.row_of[s] = count[ids[s]]++;
      g.rows[g.row_of[s]] = s;
    }
  return g;
}

// act[r, 32b + c] = silu(gate) * up for the 32 units of gate_up block b, from its outputs h[r, 64b + c]
// (gate) and h[r, 64b + 32 + c] (up), each step rounded to T as torch rounds it.
template <class T>
void activate(const T* h, T* act, int64_t rows, int64_t hw, int64_t iw, int64_t b) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < HALF; ++c) {
      const float g = to_float<T>(h[r * hw + BLOCK * b + c]), u = to_float<T>(h[r * hw + BLOCK * b + HALF + c]);
      const float silu = to_float<T>(from_float<T>(g / (1.0f + expf(-g))));
      act[r * iw + HALF * b + c] = from_float<T>(silu * u);
    }
}

// Spins until `count` reaches `target` (another thread's release increments), yielding the core after a while:
// the thread it waits for may be waiting for a core.
inline void wait(const std::atomic<int64_t>& count, int64_t target) {
  for (int spins = 0; count.load(std::memory_order_acquire) < target; ++spins) {
    if (spins < 4096) funcspec::simd::pause();
    else std::this_thread::yield();
  }
}

// out[c] = sum over j = 0..k-1 of w[j] * y[row[j], c] (rows of y [R, H]; row -1 adds nothing), in fp32, rounded once.
template <class T>
void slot_sum(const T* y, const int64_t* row, const float* w, T* out, int64_t k, int64_t H) {
  std::vector<float> sum(H, 0.0f);
  for (int64_t j = 0; j < k; ++j)
    if (row[j] >= 0)
      for (int64_t c = 0; c < H; ++c) sum[c] += w[j] * to_float<T>(y[row[j] * H + c]);
  for (int64_t c = 0; c < H; ++c) out[c] = from_float<T>(sum[c]);
}

template <class E>
void experts(const typename E::T* x, const int64_t* ids, const float* w, const typename E::T* gate_up,
             const typename E::T* down, typename E::T* out, int64_t T, int64_t k, int64_t H, int64_t NE,
             int64_t I, int threads) {
  using V = typename E::T;
  const Groups g = group(ids, T * k, NE);
  const int64_t U = g.experts.size(), R = g.rows.size();
  const int64_t hp = H + H % E::P;  // gate_up's k, x's padded row
  const int64_t nb1 = I / HALF, nb2 = (H + BLOCK - 1) / BLOCK;
  const int64_t hw = nb1 * BLOCK;  // gate_up's outputs per row
  const int64_t up_elems = nb1 * BLOCK * hp, down_elems = nb2 * BLOCK * I;  // one expert's packed weights
  // x's rows in group order [R, H'], gate_up's outputs [R, 2I'], the intermediate [R, I'], the experts'
  // outputs [R, H]: scratch of a few hundred KB for a decode step.
  std::unique_ptr<V[]> xs(new V[R * hp]), h(new V[R * hw]), act(new V[R * I]), y(new V[R * H]);
  for (int64_t r = 0; r < R; ++r) {
    memcpy(xs.get() + r * hp, x + g.rows[r] / k * H, H * sizeof(V));
    if (hp > H) xs[r * hp + H] = from_float<V>(0.0f);
  }
  // Phase 1's items (the union's gate_up blocks) then phase 2's (its down blocks), expert after expert, in
  // one list: a down block waits only for its own expert's gate_up blocks (ready[u]), not for the whole
  // of phase 1.
  const int64_t n1 = U * nb1, n2 = U * nb2;
  std::unique_ptr<std::atomic<int64_t>[]> ready(new std::atomic<int64_t>[U]);
  for (int64_t u = 0; u < U; ++u) ready[u].store(0, std::memory_order_relaxed);
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t team = omp_get_num_threads();
    std::vector<float> acc(g.most * BLOCK);
    for (int64_t i0, i1; take(taken, n1 + n2, team, &i0, &i1);)
      for (int64_t i = i0; i < i1; ++i) {
        const bool first = i < n1;
        const int64_t nb = first ? nb1 : nb2, u = (first ? i : i - n1) / nb, b = (first ? i : i - n1) % nb;
        const int64_t r0 = g.start[u], rows = g.start[u + 1] - r0;
        const bool follows = i + 1 < i1 && b + 1 < nb;
        if (first) {
          const V* wb = gate_up + g.experts[u] * up_elems + b * BLOCK * hp;
          block<E>(xs.get() + r0 * hp, wb, nullptr, h.get() + r0 * hw, rows, hw, hp, b * BLOCK, acc.data(), follows);
          activate<V>(h.get() + r0 * hw, act.get() + r0 * I, rows, hw, I, b);
          ready[u].fetch_add(1, std::memory_order_release);
        } else {
          wait(ready[u], nb1);
          const V* wb = down + g.experts[u] * down_elems + b * BLOCK * I;
          block<E>(act.get() + r0 * I, wb, nullptr, y.get() + r0 * H, rows, H, I, b * BLOCK, acc.data(), follows);
        }
      }
  }
  // NOTE: the slot sums after the join, on one thread unless large: T·k·H multiply-adds, a few us at decode
  // sizes, where one more barrier costs as much and stalls whenever another process holds a core.
  const bool wide = T * k * H >= SERIAL_MACS;
#pragma omp parallel for num_threads(threads) if (wide && threads > 1) schedule(static)
  for (int64_t t = 0; t < T; ++t) slot_sum<V>(y.get(), g.row_of.data() + t * k, w + t * k, out + t * H, k, H);
}


// ----------------------------------------------------------------------------- quantized experts
//
// The same grouping, work list and rounding with experts quantized as funcspec/kernels/quant.py packs a linear
// (quant.h's tiles): gate_up [E][2 I/32][...] holds an expert's gate column blocks, then its up blocks; down
// [E][H'/32][...]. A gate_up item b multiplies the expert's rows by gate block b and up block b (32 units)
// and applies silu(gate) * up there; the thread that finishes an expert's last gate_up item quantizes its
// intermediate rows (int8 per 32, as any quantized product's input) before its down items start.

// One stacked quantized weight: values, scales, offsets (null: symmetric), bits, group, k.
struct QStack {
  const uint8_t* q;
  const uint16_t* s;
  const uint16_t* o;
  int bits;
  int64_t G, K;
  int64_t block_bytes() const { return K * bits / 8 * funcspec::quantized::QB; }
  int64_t block_scales() const { return K / G * funcspec::quantized::QB; }
};

// Rows of one activation buffer quantized per 32 k: xq [R][K], d [R][K/32], sums [R][K/16].
struct QRows {
  std::vector<int8_t> xq;
  std::vector<float> d;
  std::vector<int32_t> sums;
  int64_t K;
  QRows(int64_t R, int64_t K) : xq(R * K), d(R * K / 32), sums(R * K / 16), K(K) {}
  template <class T>
  void quantize(const T* x, int64_t r) {  // row r from x [K]
    funcspec::quantized::quantize_row<T>(x, K, xq.data() + r * K, d.data() + r * K / 32, sums.data() + r * K / 16);
  }
  void copy_row(const QRows& from, int64_t s, int64_t r) {  // row r = row s of `from` (same K)
    memcpy(xq.data() + r * K, from.xq.data() + s * K, K);
    memcpy(d.data() + r * K / 32, from.d.data() + s * K / 32, K / 32 * sizeof(float));
    memcpy(sums.data() + r * K / 16, from.sums.data() + s * K / 16, K / 16 * sizeof(int32_t));
  }
};

// acc [rows][32] = rows r0.. of `in` times column block `blk` of stacked weight w's expert e, in passes.
inline void qblock(const QStack& w, int64_t e, int64_t blocks, int64_t blk, const QRows& in, int64_t r0,
                   int64_t rows, float* acc) {
  using namespace funcspec::quantized;
  const int64_t item = e * blocks + blk;
  const uint8_t* wb = w.q + item * w.block_bytes();
  const uint16_t* sb = w.s + item * w.block_scales();
  const uint16_t* ob = w.o ? w.o + item * w.block_scales() : nullptr;
  const int64_t most = rows_per_pass(w.bits, w.o != nullptr), passes = (rows + most - 1) / most, K = in.K;
  for (int64_t p = 0, m = r0; p < passes; ++p) {
    const int64_t mb = rows / passes + (p < rows % passes);
    tile_any(w.bits, mb, in.xq.data() + m * K, in.d.data() + m * K / 32, in.sums.data() + m * K / 16, K, w.G,
             wb, sb, ob, acc + (m - r0) * QB);
    m += mb;
  }
}

template <class V>
void qexperts(const V* x, const int64_t* ids, const float* w, const QStack& gu, const QStack& dn, V* out,
              int64_t T, int64_t k, int64_t H, int64_t NE, int64_t I, int threads) {
  const Groups g = group(ids, T * k, NE);
  const int64_t U = g.experts.size(), R = g.rows.size();
  const int64_t nb1 = I / HALF, nb2 = (H + HALF - 1) / HALF, hw = nb1 * BLOCK;
  QRows tokens(T, H), xs(R, H), acts(R, I);  // each token's input quantized once, then one row per slot
  for (int64_t t = 0; t < T; ++t) tokens.quantize<V>(x + t * H, t);
  for (int64_t r = 0; r < R; ++r) xs.copy_row(tokens, g.rows[r] / k, r);
  std::unique_ptr<V[]> h(new V[R * hw]), act(new V[R * I]), y(new V[R * H]);
  const int64_t n1 = U * nb1, n2 = U * nb2;
  std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[U]), ready(new std::atomic<int64_t>[U]);
  for (int64_t u = 0; u < U; ++u) {
    done[u].store(0, std::memory_order_relaxed);
    ready[u].store(0, std::memory_order_relaxed);
  }
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t team = omp_get_num_threads();
    std::vector<float> acc(2 * g.most * HALF);
    for (int64_t i0, i1; take(taken, n1 + n2, team, &i0, &i1);)
      for (int64_t i = i0; i < i1; ++i) {
        const bool first = i < n1;
        const int64_t nb = first ? nb1 : nb2, u = (first ? i : i - n1) / nb, b = (first ? i : i - n1) % nb;
        const int64_t e = g.experts[u], r0 = g.start[u], rows = g.start[u + 1] - r0;
        if (first) {
          float *ga = acc.data(), *ua = acc.data() + rows * HALF;
          qblock(gu, e, 2 * nb1, b, xs, r0, rows, ga);
          qblock(gu, e, 2 * nb1, nb1 + b, xs, r0, rows, ua);
          V* hr = h.get() + r0 * hw;
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < HALF; ++c) {
              hr[r * hw + BLOCK * b + c] = from_float<V>(ga[r * HALF + c]);
              hr[r * hw + BLOCK * b + HALF + c] = from_float<V>(ua[r * HALF + c]);
            }
          activate<V>(hr, act.get() + r0 * I, rows, hw, I, b);
          if (done[u].fetch_add(1, std::memory_order_acq_rel) + 1 == nb1) {  // the expert's last gate_up item
            for (int64_t r = r0; r < r0 + rows; ++r) acts.quantize<V>(act.get() + r * I, r);
            ready[u].store(1, std::memory_order_release);
          }
        } else {
          wait(ready[u], 1);
          qblock(dn, e, nb2, b, acts, r0, rows, acc.data());
          const int64_t n0 = b * HALF, cols = std::min(HALF, H - n0);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < cols; ++c) y[(r0 + r) * H + n0 + c] = from_float<V>(acc[r * HALF + c]);
        }
      }
  }
  const bool wide = T * k * H >= SERIAL_MACS;
#pragma omp parallel for num_threads(threads) if (wide && threads > 1) schedule(static)
  for (int64_t t = 0; t < T; ++t) slot_sum<V>(y.get(), g.row_of.data() + t * k, w + t * k, out + t * H, k, H);
}

}  // namespace

extern "C" {

// x [T, H], ids [T, k] int64, w [T, k] fp32, gate_up and down packed (moe.py) for E experts of I'
// (a multiple of 32) intermediate units, out [T, H].
void funcspec_experts_bf16(const uint16_t* x, const int64_t* ids, const float* w, const uint16_t* gate_up,
                           const uint16_t* down, uint16_t* out, int64_t T, int64_t k, int64_t H, int64_t E,
                           int64_t I, int threads) {
  experts<BF16>(x, ids, w, gate_up, down, out, T, k, H, E, I, threads);
}

void funcspec_experts_f32(const float* x, const int64_t* ids, const float* w, const float* gate_up,
                          const float* down, float* out, int64_t T, int64_t k, int64_t H, int64_t E, int64_t I,
                          int threads) {
  experts<F32>(x, ids, w, gate_up, down, out, T, k, H, E, I, threads);
}
// x [T, H], ids [T, k] int64, w [T, k] fp32, experts quantized and stacked (moe.py: stack_quantized): gate_up
// values / scales / offsets (null: symmetric) of `gu_bits` bits in groups of `gu_group` over H, down's over I
// (a multiple of 32), out [T, H].
void funcspec_qexperts_bf16(const uint16_t* x, const int64_t* ids, const float* w, const uint8_t* gu_q,
                            const uint16_t* gu_s, const uint16_t* gu_o, const uint8_t* dn_q, const uint16_t* dn_s,
                            const uint16_t* dn_o, uint16_t* out, int64_t T, int64_t k, int64_t H, int64_t E,
                            int64_t I, int64_t gu_bits, int64_t gu_group, int64_t dn_bits, int64_t dn_group,
                            int threads) {
  qexperts<uint16_t>(x, ids, w, {gu_q, gu_s, gu_o, (int)gu_bits, gu_group, H},
                     {dn_q, dn_s, dn_o, (int)dn_bits, dn_group, I}, out, T, k, H, E, I, threads);
}

void funcspec_qexperts_f32(const float* x, const int64_t* ids, const float* w, const uint8_t* gu_q,
                           const uint16_t* gu_s, const uint16_t* gu_o, const uint8_t* dn_q, const uint16_t* dn_s,
                           const uint16_t* dn_o, float* out, int64_t T, int64_t k, int64_t H, int64_t E, int64_t I,
                           int64_t gu_bits, int64_t gu_group, int64_t dn_bits, int64_t dn_group, int threads) {
  qexperts<float>(x, ids, w, {gu_q, gu_s, gu_o, (int)gu_bits, gu_group, H},
                  {dn_q, dn_s, dn_o, (int)dn_bits, dn_group, I}, out, T, k, H, E, I, threads);
}
}
