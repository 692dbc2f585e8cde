// Attention of a few query tokens over a KV cache, for decode, on every build of the kernels (build.py).
//
// out[b, t, h] = softmax_j(q[b, t, h] . k[b, h / G, j] * scale over visible j) @ v[b, h / G, :]
// where visible[b, t, j] (causal, tree, window: the caller's mask) and G = H / H_kv.
//
// A decode or verify step has 1-65 query tokens and reads 128-4096+ cached
// positions, so it should cost what streaming K and V once costs; SDPA's CPU
// flash kernel spends several times that at these shapes. This reads q, K and V in place
// (any batch / head / token strides, each row of D contiguous), skips positions
// a query cannot see, and runs the query heads of one KV head together (RG at
// a time), so each K and V row is loaded once for them. Scores, softmax and the
// sums are fp32; on the avx512bf16 build, bf16 multiplies raw pairs with vdpbf16ps (q . k exactly per
// pair; p rounded to bf16 for p . v, as SDPA's bf16 kernels do); the other builds (simd.h's vectors) take
// K and V to fp32 and keep p in fp32.
//
// Every query row is computed by the same instructions in the same order
// whatever the other rows are: AR (1 token) and verification (K+1) agree bit
// for bit. Plain C ABI, called through ctypes (funcspec/kernels/attention.py).
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16.h"
#include "simd.h"

namespace {

// [lo, hi): the positions from the first visible one to past the last in vis [TR] (lo == hi: none). The passes
// over positions stay inside it, so a step's cost follows its context, not the cache's length (max_model_len).
// Whole 8-byte words are tested first: a causal row's invisible tail is most of a long cache.
inline void visible_span(const uint8_t* vis, int64_t TR, int64_t* lo, int64_t* hi) {
  int64_t a = 0, b = TR;
  uint64_t w;
  while (a + 8 <= TR && (memcpy(&w, vis + a, 8), w == 0)) a += 8;
  while (a < TR && !vis[a]) ++a;
  while (b - 8 >= a && (memcpy(&w, vis + b - 8, 8), w == 0)) b -= 8;
  while (b > a && !vis[b - 1]) --b;
  *lo = a;
  *hi = b;
}

// n floats of this thread's scratch, kept between calls (uninitialized: each pass writes what it reads).
inline float* scratch_floats(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// q [B, T, H, D] at strides qst (b, t, h) and k, v [B, H_kv, TR, D] at strides kst, vst (b, KV head, token),
// each with D contiguous; out [B, T, H, D] contiguous, vis [B, T, TR]. Threads take (b, KV head) pairs; each
// runs its G query heads at each token, RG at a time: rows(q rows, R, K, V, visible row, out rows, scratch)
// with one scratch per thread, made by make().
template <int RG, class T, class Make, class Rows>
void for_head_groups(const T* q, const T* k, const T* v, const uint8_t* vis, T* out, int64_t B, int64_t Tq,
                     int64_t H, int64_t HKV, int64_t D, int64_t TR, const int64_t qst[3], const int64_t kst[3],
                     const int64_t vst[3], int threads, Make make, Rows rows) {
  const int64_t G = H / HKV;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    auto scratch = make();
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * HKV; ++bh) {
      const int64_t b = bh / HKV, hk = bh % HKV;
      const T* kb = k + b * kst[0] + hk * kst[1];
      const T* vb = v + b * vst[0] + hk * vst[1];
      for (int64_t t = 0; t < Tq; ++t)
        for (int64_t g0 = 0; g0 < G; g0 += RG) {
          const int R = (int)(G - g0 < RG ? G - g0 : RG);
          const T* qs[RG];
          T* os[RG];
          for (int r = 0; r < R; ++r) {
            const int64_t h = hk * G + g0 + r;
            qs[r] = q + b * qst[0] + t * qst[1] + h * qst[2];
            os[r] = out + ((b * Tq + t) * H + h) * D;
          }
          rows(qs, R, kb, vb, vis + (b * Tq + t) * TR, os, scratch);
        }
    }
  }
}

}  // namespace

#if defined(FUNCSPEC_ISA_AVX512BF16)
#include <immintrin.h>


namespace {

constexpr int MAX_CHUNKS = 16;  // head_dim up to 256, in zmm chunks of 16

// exp(x) for x <= 0 (scores minus their max): 2^n * 2^f, f in [-0.5, 0.5], 2^f by its degree-7
// Taylor polynomial (relative error ~5e-9, below fp32's), 2^n by vscalefps.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // e^-87 ~ 1.6e-38: tiny but normal, never a slow denormal
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));  // f ln 2
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// out [D] = x[0:D] (chunks of 16, the last one masked by tail).
inline void store_row(float* out, const __m512* x, int chunks, __mmask16 tail) {
  for (int c = 0; c < chunks; ++c) _mm512_mask_storeu_ps(out + 16 * c, c == chunks - 1 ? tail : 0xffff, x[c]);
}
inline void store_row(uint16_t* out, const __m512* x, int chunks, __mmask16 tail) {
  alignas(64) float tmp[16];
  for (int c = 0; c < chunks; ++c) {
    _mm512_store_ps(tmp, x[c]);
    const int n = c == chunks - 1 ? __builtin_popcount(tail) : 16;
    for (int i = 0; i < n; ++i) out[16 * c + i] = funcspec::float_to_bf16(tmp[i]);
  }
}

// The lane sums of a, b, c, d in lanes 0, 4, 8, 12. Each vector's lanes are added in one
// order whatever its position and the other three: a row's score does not depend on its group.
inline __m512 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));
  return _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
}

constexpr int RG = 4;  // query rows (heads of one KV head) per pass: one reduce4 per visible position

// q . k_j as a vector of partial sums. bf16 multiplies raw pairs (vdpbf16ps: exact products,
// fp32 sums); fp32 uses FMA. Chunks of W elements, each with its load mask (the tail's zeros).
template <class T>
struct Dot;
template <>
struct Dot<uint16_t> {
  static constexpr int W = 32;
  using Q = __m512i;
  using M = __mmask32;
  static M mask(int64_t n) { return n >= 32 ? (M)0xffffffffu : n <= 0 ? (M)0 : (M)((1u << n) - 1); }
  static Q load(const uint16_t* p, M m) { return _mm512_maskz_loadu_epi16(m, p); }
  static __m512 step(__m512 acc, Q q, const uint16_t* k, M m) {
    return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)load(k, m));
  }
};
template <>
struct Dot<float> {
  static constexpr int W = 16;
  using Q = __m512;
  using M = __mmask16;
  static M mask(int64_t n) { return n >= 16 ? (M)0xffff : n <= 0 ? (M)0 : (M)((1u << n) - 1); }
  static Q load(const float* p, M m) { return _mm512_maskz_loadu_ps(m, p); }
  static __m512 step(__m512 acc, Q q, const float* k, M m) { return _mm512_fmadd_ps(q, load(k, m), acc); }
};

// The 16-lane mask of 4 interleaved keys (4 rows each) from their 4 visibility bits.
inline __mmask16 lanes4(unsigned bits) {
  static constexpr uint16_t LUT[16] = {0x0000, 0x000f, 0x00f0, 0x00ff, 0x0f00, 0x0f0f, 0x0ff0, 0x0fff,
                                       0xf000, 0xf00f, 0xf0f0, 0xf0ff, 0xff00, 0xff0f, 0xfff0, 0xffff};
  return LUT[bits & 15];
}

// R (<= RG) query rows q[r] (the heads of one KV head, at one token) over keys/vals [TR, D]
// (token strides ks, vs) where vis [TR]. Scores live interleaved, s[4 j + r] ([TR + 16][RG] scratch),
// so a zmm holds 4 keys of the 4 rows and each step of the softmax serves every row at once.
// CH = ceil(D / 16): compile-time chunk counts keep the queries and accumulators in registers.
// Rows past R are zero queries whose results are dropped.
template <class T, int CH>
void attend_rows(const T* const* q, int R, const T* k, const T* v, const uint8_t* vis, T* const* out, int64_t D,
                 int64_t TR, int64_t ks, int64_t vs, float scale, float* s) {
  uint32_t* pairs = reinterpret_cast<uint32_t*>(s + RG * (TR + 16));  // [TR/2 + 8][RG] bf16 pairs of p
  using D_ = Dot<T>;
  constexpr int QC = (CH * 16 + D_::W - 1) / D_::W;
  typename D_::M qm[QC];
  __mmask16 vm[CH];
  for (int c = 0; c < QC; ++c) qm[c] = D_::mask(D - c * D_::W);
  for (int c = 0; c < CH; ++c) vm[c] = Dot<float>::mask(D - c * 16);
  typename D_::Q qv[RG][QC];
  for (int r = 0; r < RG; ++r)
    for (int c = 0; c < QC; ++c) qv[r][c] = r < R ? D_::load(q[r] + c * D_::W, qm[c]) : typename D_::Q{};
  // scaled scores of the visible positions
  const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m128 scale4 = _mm_set1_ps(scale);
  int64_t lo, hi;
  visible_span(vis, TR, &lo, &hi);
  const int64_t lo16 = lo / 16 * 16;  // the 16-key steps below keep their lanes: a key's lane is j % 16
  int64_t seen = 0;
  for (int64_t j = lo; j < hi; ++j) {
    if (!vis[j]) continue;
    ++seen;
    const T* kj = k + j * ks;
    __m512 d[RG];
#pragma GCC unroll 4
    for (int r = 0; r < RG; ++r) {
      d[r] = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int c = 0; c < QC; ++c) d[r] = D_::step(d[r], qv[r][c], kj + c * D_::W, qm[c]);
    }
    const __m512 x = _mm512_permutexvar_ps(pick, reduce4(d[0], d[1], d[2], d[3]));
    _mm_storeu_ps(s + 4 * j, _mm_mul_ps(_mm512_castps512_ps128(x), scale4));
  }
  if (seen == 0) {  // sees nothing (never a real row): zeros
    __m512 zero[CH];
    for (int c = 0; c < CH; ++c) zero[c] = _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) store_row(out[r], zero, CH, vm[CH - 1]);
    return;
  }
  // each row's max, then p = exp(s - max) over visible positions (0 elsewhere) and each row's sum
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = lo16; j < hi; j += 16) {
    const __mmask16 keys = Dot<float>::mask(TR - j);
    const unsigned bits = _mm_mask_test_epi8_mask(keys, _mm_maskz_loadu_epi8(keys, vis + j), _mm_set1_epi8(1));
    for (int i = 0; i < 4; ++i)
      mx = _mm512_mask_max_ps(mx, lanes4(bits >> 4 * i), mx, _mm512_loadu_ps(s + 4 * (j + 4 * i)));
  }
  __m128 m4 = _mm_max_ps(_mm_max_ps(_mm512_extractf32x4_ps(mx, 0), _mm512_extractf32x4_ps(mx, 1)),
                         _mm_max_ps(_mm512_extractf32x4_ps(mx, 2), _mm512_extractf32x4_ps(mx, 3)));
  const __m512 mv = _mm512_broadcast_f32x4(m4);
  __m512 sum = _mm512_setzero_ps();
  const __m256i PAIR_ORDER = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                              0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
  for (int64_t j = lo16; j < hi; j += 16) {  // p = 0 written up to the step past hi: the pairs below read it
    const __mmask16 keys = Dot<float>::mask(TR - j);
    const unsigned bits = _mm_mask_test_epi8_mask(keys, _mm_maskz_loadu_epi8(keys, vis + j), _mm_set1_epi8(1));
    for (int i = 0; i < 4; ++i) {
      float* sj = s + 4 * (j + 4 * i);
      const __mmask16 lanes = lanes4(bits >> 4 * i);
      const __m512 p = _mm512_maskz_mov_ps(lanes, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, sj), mv)));
      _mm512_storeu_ps(sj, p);
      sum = _mm512_add_ps(sum, p);
      if constexpr (std::is_same_v<T, uint16_t>) {
        // p in bf16, as the pairs the weighted sum of V multiplies: keys (j', j' + 1) of each row in turn
        const __m256i p16 = (__m256i)_mm512_cvtneps_pbh(p);  // keys j'..j'+3, rows 0-3 interleaved
        _mm256_storeu_si256((__m256i*)(pairs + 2 * (j + 4 * i)), _mm256_shuffle_epi8(p16, PAIR_ORDER));
      }
    }
  }
  alignas(16) float inv[4];
  const __m128 sum4 = _mm_add_ps(_mm_add_ps(_mm512_extractf32x4_ps(sum, 0), _mm512_extractf32x4_ps(sum, 1)),
                                 _mm_add_ps(_mm512_extractf32x4_ps(sum, 2), _mm512_extractf32x4_ps(sum, 3)));
  _mm_store_ps(inv, _mm_div_ps(_mm_set1_ps(1.0f), sum4));
  // sum_j p_j v_j, two chunks of 16 at a time, each piece of v_j loaded once for the RG rows;
  // the 8 accumulators stay in registers (GCC spills a whole [RG][CH] array).
  __m512 res[RG][CH];
  for (int c0 = 0; c0 < CH; c0 += 2) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    const bool two = c0 + 1 < CH;
    if constexpr (std::is_same_v<T, uint16_t>) {
      // NOTE: bf16 takes the keys in pairs through vdpbf16ps: (v_j[d], v_j+1[d]) . (p_j, p_j+1) with
      // p rounded to bf16 (as SDPA's bf16 kernels do), half the instructions of converting v to fp32. The
      // pairs come from unpacklo/hi, which pair within 128-bit lanes: a and b each hold half of both chunks'
      // d (put in order below), so both run whether or not a second chunk exists.
      const __mmask32 dm = Dot<uint16_t>::mask(D - 16 * c0);
      for (int64_t j = lo16; j < hi; j += 2) {
        const bool see0 = vis[j], see1 = j + 1 < TR && vis[j + 1];
        if (!see0 && !see1) continue;
        // an unseen position's v is read as zeros (its p is 0): stale entries never reach the sum
        const uint16_t* vj = v + j * vs + 16 * c0;
        const __m512i x0 = _mm512_maskz_loadu_epi16(see0 ? dm : 0, vj);
        const __m512i x1 = _mm512_maskz_loadu_epi16(see1 ? dm : 0, vj + vs);
        const __m512i lo = _mm512_unpacklo_epi16(x0, x1), hi = _mm512_unpackhi_epi16(x0, x1);
        const uint32_t* pj = pairs + 2 * j;  // (p_r,j, p_r,j+1) in bf16, rows 0-3
        const __m512bh q0 = (__m512bh)_mm512_set1_epi32(pj[0]), q1 = (__m512bh)_mm512_set1_epi32(pj[1]);
        const __m512bh q2 = (__m512bh)_mm512_set1_epi32(pj[2]), q3 = (__m512bh)_mm512_set1_epi32(pj[3]);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)lo, q0), a1 = _mm512_dpbf16_ps(a1, (__m512bh)lo, q1);
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)lo, q2), a3 = _mm512_dpbf16_ps(a3, (__m512bh)lo, q3);
        b0 = _mm512_dpbf16_ps(b0, (__m512bh)hi, q0), b1 = _mm512_dpbf16_ps(b1, (__m512bh)hi, q1);
        b2 = _mm512_dpbf16_ps(b2, (__m512bh)hi, q2), b3 = _mm512_dpbf16_ps(b3, (__m512bh)hi, q3);
      }
    } else {
      for (int64_t j = lo; j < hi; ++j) {
        if (!vis[j]) continue;
        const T* vj = v + j * vs + 16 * c0;
        const float* p = s + 4 * j;
        const __m512 p0 = _mm512_set1_ps(p[0]), p1 = _mm512_set1_ps(p[1]), p2 = _mm512_set1_ps(p[2]),
                     p3 = _mm512_set1_ps(p[3]);
        const __m512 x = _mm512_maskz_loadu_ps(vm[c0], vj);
        a0 = _mm512_fmadd_ps(p0, x, a0), a1 = _mm512_fmadd_ps(p1, x, a1);
        a2 = _mm512_fmadd_ps(p2, x, a2), a3 = _mm512_fmadd_ps(p3, x, a3);
        if (two) {
          const __m512 y = _mm512_maskz_loadu_ps(vm[c0 + 1], vj + 16);
          b0 = _mm512_fmadd_ps(p0, y, b0), b1 = _mm512_fmadd_ps(p1, y, b1);
          b2 = _mm512_fmadd_ps(p2, y, b2), b3 = _mm512_fmadd_ps(p3, y, b3);
        }
      }
    }
    if constexpr (std::is_same_v<T, uint16_t>) {
      // unpacklo/hi paired d in 128-bit lanes: a holds d 0-3, 8-11, 16-19, 24-27 and b the rest -> in order
      const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
      const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
      __m512 t;
      t = a0, a0 = _mm512_permutex2var_ps(t, first, b0), b0 = _mm512_permutex2var_ps(t, second, b0);
      t = a1, a1 = _mm512_permutex2var_ps(t, first, b1), b1 = _mm512_permutex2var_ps(t, second, b1);
      t = a2, a2 = _mm512_permutex2var_ps(t, first, b2), b2 = _mm512_permutex2var_ps(t, second, b2);
      t = a3, a3 = _mm512_permutex2var_ps(t, first, b3), b3 = _mm512_permutex2var_ps(t, second, b3);
    }
    res[0][c0] = _mm512_mul_ps(a0, _mm512_set1_ps(inv[0])), res[1][c0] = _mm512_mul_ps(a1, _mm512_set1_ps(inv[1]));
    res[2][c0] = _mm512_mul_ps(a2, _mm512_set1_ps(inv[2])), res[3][c0] = _mm512_mul_ps(a3, _mm512_set1_ps(inv[3]));
    if (two) {
      res[0][c0 + 1] = _mm512_mul_ps(b0, _mm512_set1_ps(inv[0]));
      res[1][c0 + 1] = _mm512_mul_ps(b1, _mm512_set1_ps(inv[1]));
      res[2][c0 + 1] = _mm512_mul_ps(b2, _mm512_set1_ps(inv[2]));
      res[3][c0 + 1] = _mm512_mul_ps(b3, _mm512_set1_ps(inv[3]));
    }
  }
  for (int r = 0; r < R; ++r) store_row(out[r], res[r], CH, vm[CH - 1]);
}

template <class T>
using RowsFn = void (*)(const T* const*, int, const T*, const T*, const uint8_t*, T* const*, int64_t, int64_t,
                        int64_t, int64_t, float, float*);

template <class T, int... CH>
RowsFn<T> rows_for(int64_t chunks, std::integer_sequence<int, CH...>) {
  RowsFn<T> fns[] = {attend_rows<T, CH + 1>...};
  return fns[chunks - 1];
}

// The kernel for D's chunk count, over for_head_groups.
template <class T>
void attend(const T* q, const T* k, const T* v, const uint8_t* vis, T* out, int64_t B, int64_t Tq, int64_t H,
            int64_t HKV, int64_t D, int64_t TR, const int64_t qst[3], const int64_t kst[3], const int64_t vst[3],
            float scale, int threads) {
  const RowsFn<T> rows = rows_for<T>((D + 15) / 16, std::make_integer_sequence<int, MAX_CHUNKS>{});
  for_head_groups<RG>(
      q, k, v, vis, out, B, Tq, H, HKV, D, TR, qst, kst, vst, threads,
      // interleaved scores, padded to whole 16-key steps (bf16: and p's bf16 pairs after them)
      [&] { return scratch_floats((std::is_same_v<T, uint16_t> ? RG + 2 : RG) * (TR + 16)); },
      [&](const T* const* qs, int R, const T* kb, const T* vb, const uint8_t* vr, T* const* os, float* s) {
        rows(qs, R, kb, vb, vr, os, D, TR, kst[2], vst[2], scale, s);
      });
}

}  // namespace

#else  // the portable builds: simd.h's vectors

namespace {

using namespace funcspec::simd;

constexpr int RG = 4;  // query rows (heads of one KV head) per pass: each K and V row is converted once for them

// R (<= RG) query rows q[r] (the heads of one KV head, at one token) over keys/vals [TR, D] (token strides ks,
// vs) where vis [TR]. Scratch: qf [RG][DP], row [DP] (DP = D rounded up to W, the tail zero), s [RG][TR + W],
// acc [RG][DP]. Each row's scores, softmax and weighted sum are its own operations in a fixed order.
template <class T>
void attend_rows(const T* const* q, int R, const T* k, const T* v, const uint8_t* vis, T* const* out, int64_t D,
                 int64_t TR, int64_t ks, int64_t vs, float scale, float* qf, float* row, float* s, float* acc) {
  const int64_t CH = (D + W - 1) / W, DP = CH * W, SP = TR + W;
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < D; ++c) qf[r * DP + c] = funcspec::to_float<T>(q[r][c]);
  int64_t lo, hi;
  visible_span(vis, TR, &lo, &hi);
  const int64_t loW = lo / W * W;  // the W-key steps below keep their lanes: a key's lane is j % W
  int64_t seen = 0;
  for (int64_t j = lo; j < hi; ++j) {
    if (!vis[j]) continue;
    ++seen;
    for (int64_t c = 0; c < D; ++c) row[c] = funcspec::to_float<T>(k[j * ks + c]);
    for (int r = 0; r < R; ++r) {
      vf dot{};
      for (int64_t c = 0; c < CH; ++c) dot = dot + load(qf + r * DP + c * W) * load(row + c * W);
      s[r * SP + j] = hsum(dot) * scale;
    }
  }
  if (seen == 0) {  // sees nothing (never a real row): zeros
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < D; ++c) out[r][c] = funcspec::from_float<T>(0.0f);
    return;
  }
  float inv[RG];
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * SP;
    float mx = -INFINITY;
    for (int64_t j = lo; j < hi; ++j)
      if (vis[j]) mx = std::max(mx, sr[j]);
    vf sum{};
    for (int64_t j = loW; j < hi; j += W) {
      vf p = exp_neg(load(sr + j) - mx);  // past TR: scratch, dropped below
      for (int i = 0; i < W; ++i)
        if (j + i >= TR || !vis[j + i]) p[i] = 0.0f;
      store(sr + j, p);
      sum = sum + p;
    }
    inv[r] = 1.0f / hsum(sum);
  }
  for (int i = 0; i < R * DP; ++i) acc[i] = 0.0f;
  for (int64_t j = lo; j < hi; ++j) {
    if (!vis[j]) continue;
    for (int64_t c = 0; c < D; ++c) row[c] = funcspec::to_float<T>(v[j * vs + c]);
    for (int r = 0; r < R; ++r) {
      const float p = s[r * SP + j];
      for (int64_t c = 0; c < CH; ++c) store(acc + r * DP + c * W, load(acc + r * DP + c * W) + p * load(row + c * W));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < D; ++c) out[r][c] = funcspec::from_float<T>(acc[r * DP + c] * inv[r]);
}

// attend_rows over for_head_groups, each thread with its fp32 buffers.
template <class T>
void attend(const T* q, const T* k, const T* v, const uint8_t* vis, T* out, int64_t B, int64_t Tq, int64_t H,
            int64_t HKV, int64_t D, int64_t TR, const int64_t qst[3], const int64_t kst[3], const int64_t vst[3],
            float scale, int threads) {
  const int64_t DP = (D + W - 1) / W * W;
  struct Scratch {
    std::vector<float> qf, row, acc;
    float* s;
  };
  for_head_groups<RG>(
      q, k, v, vis, out, B, Tq, H, HKV, D, TR, qst, kst, vst, threads,
      [&] {
        return Scratch{std::vector<float>(RG * DP, 0.0f), std::vector<float>(DP, 0.0f),
                       std::vector<float>(RG * DP), scratch_floats(RG * (TR + W))};
      },
      [&](const T* const* qs, int R, const T* kb, const T* vb, const uint8_t* vr, T* const* os, Scratch& sc) {
        attend_rows<T>(qs, R, kb, vb, vr, os, D, TR, kst[2], vst[2], scale, sc.qf.data(), sc.row.data(), sc.s,
                       sc.acc.data());
      });
}

}  // namespace

#endif

extern "C" {

// k (and v) at element strides ksb, ksh, kst (batch, KV head, token); q at qsb, qst, qsh (batch, token, head).
void funcspec_attend_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint8_t* vis, uint16_t* out,
                          int64_t B, int64_t T, int64_t H, int64_t HKV, int64_t D, int64_t TR, int64_t ksb,
                          int64_t ksh, int64_t kst, int64_t vsb, int64_t vsh, int64_t vst, int64_t qsb, int64_t qst,
                          int64_t qsh, float scale, int threads) {
  const int64_t qs[3] = {qsb, qst, qsh}, ks[3] = {ksb, ksh, kst}, vs[3] = {vsb, vsh, vst};
  attend<uint16_t>(q, k, v, vis, out, B, T, H, HKV, D, TR, qs, ks, vs, scale, threads);
}

void funcspec_attend_f32(const float* q, const float* k, const float* v, const uint8_t* vis, float* out, int64_t B,
                         int64_t T, int64_t H, int64_t HKV, int64_t D, int64_t TR, int64_t ksb, int64_t ksh,
                         int64_t kst, int64_t vsb, int64_t vsh, int64_t vst, int64_t qsb, int64_t qst, int64_t qsh,
                         float scale, int threads) {
  const int64_t qs[3] = {qsb, qst, qsh}, ks[3] = {ksb, ksh, kst}, vs[3] = {vsb, vsh, vst};
  attend<float>(q, k, v, vis, out, B, T, H, HKV, D, TR, qs, ks, vs, scale, threads);
}
}
