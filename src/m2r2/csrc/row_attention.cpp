// Attention for a few query rows whose bits do not depend on where a row's keys sit in the cache.
//
// Why: lossless speculative decoding needs every row of a verify pass to get the bits a one-token
// decoding step gives it. A tree row at depth j attends the verified prefix plus its j ancestors,
// which a tree pass leaves scattered among the other tree rows; a BLAS reduction over keys depends
// on the keys' positions, so the Python path gathered each branch's keys into decoding's layout
// (a copy of the whole cache per branch and layer) and ran ~10 small torch ops per row and layer,
// which made a tree pass cost ~0.6 of a decoding step in attention alone. Here each (row, query head)
// visits its allowed keys in increasing cache position and accumulates sequentially in that order,
// skipping masked keys: decoding (keys 0..n-1) and a tree row (prefix, then its ancestors, which the
// tree lays out in increasing position) see the same sequence of keys and so the same bits, with no
// gather. Scores are float32 dot products over the head dimension (fixed order), the softmax uses a
// vectorized exp whose lanes are independent, the sum of exponentials and the weighted sum of values
// run key by key.
//
// Work items are (sequence, key head, group of up to 8 rows) and run in parallel, each one thread's.
// The rows of a verify pass all allow the verified prefix, so their key lists start alike: an item
// widens each block of keys they share once and scores it for all its rows' heads (transposed, keys in
// lanes, so the reduction tree needs no shuffles), and widens each shared value row once for tiles of
// 6 (row, head) vectors; only the few keys past the prefix are done row by row. Which work runs side by
// side never changes an output's operations, so a row's bits are those of a lone row whatever the rows
// around it and the number of threads. SmolLM2 shapes (9 query over 3 key heads, 64 dims, 300 keys of
// a 700-slot bfloat16 cache, rows adding 1-5 keys past the prefix; 1 thread, the other core busy, best
// of 2000 interleaved with the previous kernel, one item per (sequence, key head, row)): 1 row 21 ->
// 20 us, 4 rows 70 -> 50, 8 rows 138 -> 84, 16 rows 273 -> 168.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "simd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

// exp(x) for 16 lanes: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2 (Cephes' expf polynomial); every
// lane is computed alike, so a value's exp does not depend on its lane.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-103.972084045410f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

using m2r2::lanes;
using m2r2::load16;

constexpr int64_t MAX_G = 16;     // query heads per key head
constexpr int MAX_TILE = 6;       // query vectors whose weighted values accumulate together (6 x 4 chunks in registers)
constexpr int64_t VCHUNKS = 4;    // 16-lane chunks of a value row accumulated together
constexpr int64_t ROWS_PER_ITEM = 8;  // rows sharing an item's key and value loads (16 measured no faster)
constexpr int64_t TRANSPOSE_MIN_Q = 12;  // query vectors sharing a key block from which transposing it pays
constexpr int QT = 6;                    // query vectors per block_scores_t (a transposed row feeds 6 FMAs)

// The horizontal sums of 16 vectors at once, lane j holding v[j]'s: a butterfly of 15 shuffle-and-add
// steps instead of 16 separate reductions, with each lane summed in exactly the tree a lone
// _mm512_reduce_add_ps uses (lanes i + i+8, then + i+4, + i+2, + i+1), so a score has one value
// whichever of the 16 slots its key falls in (float addition is commutative; the tree fixes the rest).
inline __m512 halve(__m512 a, __m512 b) {  // [a 0-7 + a 8-15, b 0-7 + b 8-15]
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline __m512 quarter(__m512 a, __m512 b) {  // 128-bit chunks [a0 + a1, a2 + a3, b0 + b1, b2 + b3]
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline __m512 sums16(const __m512* v) {
  __m512 w[4];
#pragma GCC unroll 4
  for (int n = 0; n < 4; ++n) w[n] = quarter(halve(v[n], v[n + 4]), halve(v[n + 8], v[n + 12]));
  // within each 128-bit chunk: lanes i + i+2, then i + i+1
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(w[2], w[3], _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(w[2], w[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(r, u, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(r, u, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Keys keys[0..m) widened to float32 in kf, chunk-major ([chunk of 16 dims][16 keys][16 lanes], zero
// past D: one base pointer and constant offsets address the 16 keys); slots past m repeat the last key
// (their scores are dropped).
template <typename KT>
inline void widen_block(const KT* kbase, int64_t ks, const int32_t* keys, int64_t m, int64_t D, float* kf) {
  for (int64_t j = 0; j < 16; ++j) {
    const KT* krow = kbase + keys[std::min(j, m - 1)] * ks;
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(kf + d * 16 + j * 16, load16(krow + d, lanes(d, D)));
  }
}

// One query vector's scores against a widened block of 16 keys: per key, fused multiply-adds over the
// chunks of 16 dims in order, then the reduction tree (sums16), times the scale.
inline __m512 block_scores(const float* qrow, const float* kf, int64_t D, __m512 sc) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16, kf += 256) {
    const __m512 qd = _mm512_maskz_loadu_ps(lanes(d, D), qrow + d);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kf + 16 * j), acc[j]);
  }
  return _mm512_mul_ps(sums16(acc), sc);
}

// A 16 x 16 block of floats transposed (rows of 16 at in, to rows of 16 at out).
inline void transpose16(const float* in, float* out) {
  __m512 r[16], t[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + 16 * i);
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  const auto lo = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  const auto hi = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = lo(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = hi(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = lo(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = hi(t[4 * i + 1], t[4 * i + 3]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    _mm512_storeu_ps(out + 16 * i, _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
    _mm512_storeu_ps(out + 16 * (i + 8), _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd));
  }
}

// The scores of R query vectors (zero-padded rows qp[r], C chunks of 16 dims) against a block of 16
// keys transposed (kT: [chunk][dim in chunk][16 keys]): the same operations as block_scores, keys in
// lanes. Lane l's partial sum of a key (its fused multiply-adds over the chunks in order) is here a
// vector of 16 keys, and the reduction tree (l + l+8, + l+4, + l+2, + l+1) adds such vectors, with no
// shuffles; one load of a transposed row serves R query vectors. (Inlined at its one call with R = QT;
// a call, or instances for the rest of the vectors, measured 10-25% slower at 8 rows.)
template <int R>
inline void block_scores_t(const float* const* qp, const float* kT, int64_t C, __m512 sc, __m512* out) {
  const auto P = [&](int l, __m512* a) {
    for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      const __m512 kv = _mm512_loadu_ps(kT + c * 256 + l * 16);
      for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(qp[r][16 * c + l]), kv, a[r]);
    }
  };
  const auto X = [&](int i, __m512* x) {
    __m512 a[R], b[R];
    P(i, a), P(i + 8, b);
    for (int r = 0; r < R; ++r) x[r] = _mm512_add_ps(a[r], b[r]);
  };
  const auto Y = [&](int i, __m512* y) {
    __m512 a[R], b[R];
    X(i, a), X(i + 4, b);
    for (int r = 0; r < R; ++r) y[r] = _mm512_add_ps(a[r], b[r]);
  };
  const auto Z = [&](int i, __m512* z) {
    __m512 a[R], b[R];
    Y(i, a), Y(i + 2, b);
    for (int r = 0; r < R; ++r) z[r] = _mm512_add_ps(a[r], b[r]);
  };
  __m512 z0[R], z1[R];
  Z(0, z0), Z(1, z1);
  for (int r = 0; r < R; ++r) out[r] = _mm512_mul_ps(_mm512_add_ps(z0[r], z1[r]), sc);
}

// The softmax-weighted values of GT query vectors (heads of any rows, exponentials e[g][i]) over keys
// keys[i0..i1): each output lane's sum and the sum of exponentials tot[g] run key by key in increasing
// position. The sums start at zero, or with ``resume`` at what o[g] holds (an earlier call's keys: a
// float32 kept in memory keeps its bits); with ``fin`` they are divided by the sum of exponentials (by
// 1 for a vector whose row has no keys, n[g] = 0) into the output, else stored as they are. The GT
// vectors and 4 chunks of 16 lanes run side by side on each value row's one load (compile-time counts
// keep the accumulators in registers); the sums of exponentials ride along in the first chunks' pass.
template <int GT, typename KT>
void weigh_values(const KT* vbase, int64_t vs, const int32_t* keys, int64_t i0, int64_t i1, int64_t D,
                  const float* const* e, float* const* o, float* tot, const int64_t* n, bool resume, bool fin) {
  for (int64_t d0 = 0; d0 < D; d0 += 16 * VCHUNKS) {
    __m512 acc[GT][VCHUNKS];
    __mmask16 lm[VCHUNKS];
    for (int c = 0; c < VCHUNKS; ++c) {
      lm[c] = d0 + 16 * c < D ? lanes(d0 + 16 * c, D) : static_cast<__mmask16>(0);
      for (int g = 0; g < GT; ++g)
        acc[g][c] = resume ? _mm512_maskz_loadu_ps(lm[c], o[g] + d0 + 16 * c) : _mm512_setzero_ps();
    }
    if (d0 == 0) {  // the sums of exponentials, in the first pass only (the same key order)
      float t[GT];
      for (int g = 0; g < GT; ++g) t[g] = tot[g];
      for (int64_t i = i0; i < i1; ++i) {
        const KT* vrow = vbase + keys[i] * vs;
        __m512 vv[VCHUNKS];
        for (int c = 0; c < VCHUNKS; ++c) vv[c] = load16(vrow + 16 * c, lm[c]);
        for (int g = 0; g < GT; ++g) {
          const float eg = e[g][i];
          t[g] += eg;
          const __m512 p = _mm512_set1_ps(eg);
          for (int c = 0; c < VCHUNKS; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
        }
      }
      for (int g = 0; g < GT; ++g) tot[g] = t[g];
    } else {
      for (int64_t i = i0; i < i1; ++i) {
        const KT* vrow = vbase + keys[i] * vs + d0;
        __m512 vv[VCHUNKS];
        for (int c = 0; c < VCHUNKS; ++c) vv[c] = load16(vrow + 16 * c, lm[c]);
        for (int g = 0; g < GT; ++g) {
          const __m512 p = _mm512_set1_ps(e[g][i]);
          for (int c = 0; c < VCHUNKS; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
        }
      }
    }
    for (int g = 0; g < GT; ++g) {
      const __m512 denom = _mm512_set1_ps(n[g] ? tot[g] : 1.0f);
      for (int c = 0; c < VCHUNKS; ++c)
        _mm512_mask_storeu_ps(o[g] + d0 + 16 * c, lm[c], fin ? _mm512_div_ps(acc[g][c], denom) : acc[g][c]);
    }
  }
}

// weigh_values over cnt query vectors, MAX_TILE at a time (each tile loads the value rows once).
template <typename KT>
void weigh_all(const KT* vbase, int64_t vs, const int32_t* keys, int64_t i0, int64_t i1, int64_t D, int64_t cnt,
               const float* const* e, float* const* o, float* tot, const int64_t* n, bool resume, bool fin) {
  for (int64_t a = 0; a < cnt; a += MAX_TILE) {
    const auto w = [&](auto gt) {
      weigh_values<decltype(gt)::value>(vbase, vs, keys, i0, i1, D, e + a, o + a, tot + a, n + a, resume, fin);
    };
    switch (std::min<int64_t>(MAX_TILE, cnt - a)) {
      case 1: w(std::integral_constant<int, 1>()); break;
      case 2: w(std::integral_constant<int, 2>()); break;
      case 3: w(std::integral_constant<int, 3>()); break;
      case 4: w(std::integral_constant<int, 4>()); break;
      case 5: w(std::integral_constant<int, 5>()); break;
      default: w(std::integral_constant<int, 6>());
    }
  }
}

// A thread's scratch memory, grown to the largest call seen (sizes in elements).
struct Scratch {
  std::vector<int32_t> keys, iota;  // [R][S + 16] each row's allowed keys in increasing position; 0, 1, 2, ...
  std::vector<float> s, kf, vf;     // scores, then exponentials [R * G][padded]; a widened key block; value rows
  std::vector<__m512> vmx;          // running maxima [R * G]
  std::vector<int64_t> n, qn;       // allowed keys per row, per query vector
  std::vector<float> tot;           // sums of exponentials [R * G]
  std::vector<const float*> e, es;  // exponentials of each query vector (es: from a chunk's first key)
  std::vector<float*> o;            // output row of each query vector
  std::vector<float> kt, qbuf;      // a transposed key block; zero-padded query rows
  std::vector<const float*> qpad;
  template <typename V>
  static void grow(V& v, int64_t size) {
    if (static_cast<int64_t>(v.size()) < size) v.resize(size);
  }
  void fit(int64_t R, int64_t G, int64_t S, int64_t D) {
    const int64_t DP = (D + 15) / 16 * 16;
    grow(keys, R * (S + 16)), grow(s, R * G * ((S + 15) / 16 * 16)), grow(kf, 16 * DP), grow(vf, 4096 + 16 * DP);
    grow(kt, 16 * DP), grow(qbuf, R * G * DP), grow(qpad, R * G), grow(vmx, R * G), grow(n, R), grow(qn, R * G), grow(tot, R * G), grow(e, R * G), grow(es, R * G), grow(o, R * G);
    if (iota.empty())
      for (int32_t i = 0; i < 256; ++i) iota.push_back(i);  // a chunk of common keys has at most 4096 / 16
  }
};

// The allowed keys of a mask row (positions of its true bytes, increasing), 64 bytes at a time; keys
// needs 16 slots of room past the count.
inline int64_t allowed_keys(const bool* m, int64_t S, int32_t* keys) {
  int64_t n = 0;
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t j0 = 0; j0 < S; j0 += 64) {
    const __mmask64 lm = S - j0 >= 64 ? ~0ull : (1ull << (S - j0)) - 1;
    const __m512i b = _mm512_maskz_loadu_epi8(lm, m + j0);
    uint64_t bits = _mm512_test_epi8_mask(b, b);
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(j0)),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (int q = 0; q < 4 && bits; ++q, bits >>= 16, idx = _mm512_add_epi32(idx, step)) {
      const __mmask16 sel = static_cast<__mmask16>(bits & 0xFFFF);
      _mm512_storeu_si512(keys + n, _mm512_maskz_compress_epi32(sel, idx));
      n += __builtin_popcount(sel);
    }
  }
  return n;
}

// One (sequence, key head, group of R rows) item. Rows of a pass mostly allow the same leading keys (a
// tree's verified prefix): when the first c entries of their key lists agree, every block of 16 within
// them is the same block in each row's own partition (blocks start at multiples of 16 of the row's own
// list), so it is widened once and scored for all R * G query vectors (transposed once and scored with
// keys in lanes when there are enough of them), and the value rows of those c keys are widened once
// per chunk and weighed for tiles of vectors of any rows. Each row then goes on alone over its keys
// past c: its own blocks from the last shared block boundary, and its value sums carried on from
// memory. Every output keeps a lone row's operations: a score's fused multiply-adds in chunk order, its
// reduction tree and scale, the max and exp per lane, the sum of exponentials and each value lane's
// weighted sum key by key in increasing position, the one final division.
template <typename KT>
void attend_rows(const float* qp, const KT* kbase, int64_t ks, const KT* vbase, int64_t vs, const bool* mrows,
                 int64_t R, int64_t S, int64_t G, int64_t D, int64_t qstride_h, float sc, float* orow0,
                 int64_t ostride_t, Scratch& w) {
  const int64_t KS = S + 16, NQ = R * G;
  int64_t* n = w.n.data();
  int32_t* keys = w.keys.data();
  int64_t c = 0, maxn = 0;
  for (int64_t r = 0; r < R; ++r) {
    n[r] = allowed_keys(mrows + r * S, S, keys + r * KS);
    maxn = std::max(maxn, n[r]);
    if (r == 0) c = n[0];
    c = std::min(c, n[r]);
    for (int64_t i = 0; i < c; i += 16) {  // the common leading keys
      const __mmask16 lm = lanes(i, c);
      const __mmask16 ne = _mm512_mask_cmpneq_epi32_mask(lm, _mm512_maskz_loadu_epi32(lm, keys + r * KS + i),
                                                         _mm512_maskz_loadu_epi32(lm, keys + i));
      if (ne) { c = i + __builtin_ctz(ne); break; }
    }
  }
  if (R == 1) c = 0;  // nothing to share: the row's own pass does it all
  const int64_t padded = (maxn + 15) / 16 * 16, shared = c / 16 * 16;
  float* s = w.s.data();
  __m512* vmx = w.vmx.data();
  const __m512 scv = _mm512_set1_ps(sc);
  for (int64_t q = 0; q < NQ; ++q) vmx[q] = _mm512_set1_ps(-INFINITY);
  // q [B, H, T, D]: head g of row r at qp + g * qstride_h + r * D
  const auto qrow = [&](int64_t q) { return qp + (q % G) * qstride_h + (q / G) * D; };
  const int64_t C = (D + 15) / 16;
  const bool tr = shared > 0 && NQ >= TRANSPOSE_MIN_Q;
  if (tr)  // zero-padded query rows
    for (int64_t q = 0; q < NQ; ++q) {
      w.qpad[q] = w.qbuf.data() + q * C * 16;
      for (int64_t d = 0; d < C * 16; d += 16) _mm512_storeu_ps(w.qbuf.data() + q * C * 16 + d, _mm512_maskz_loadu_ps(lanes(d, D), qrow(q) + d));
    }
  for (int64_t i0 = 0; i0 < shared; i0 += 16) {  // blocks every row has
    widen_block(kbase, ks, keys + i0, 16, D, w.kf.data());
    int64_t q0 = 0;
    if (tr) {
      for (int64_t c = 0; c < C; ++c) transpose16(w.kf.data() + c * 256, w.kt.data() + c * 256);
      for (; q0 + QT <= NQ; q0 += QT) {  // the rest (fewer than QT) as below
        __m512 x[QT];
        block_scores_t<QT>(w.qpad.data() + q0, w.kt.data(), C, scv, x);
        for (int r = 0; r < QT; ++r) {
          _mm512_storeu_ps(s + (q0 + r) * padded + i0, x[r]);
          vmx[q0 + r] = _mm512_max_ps(vmx[q0 + r], x[r]);
        }
      }
    }
    for (int64_t q = q0; q < NQ; ++q) {
      const __m512 x = block_scores(qrow(q), w.kf.data(), D, scv);
      _mm512_storeu_ps(s + q * padded + i0, x);
      vmx[q] = _mm512_max_ps(vmx[q], x);
    }
  }
  for (int64_t r = 0; r < R; ++r) {  // each row's own blocks
    for (int64_t i0 = shared; i0 < n[r]; i0 += 16) {
      const int64_t m = std::min<int64_t>(16, n[r] - i0);
      widen_block(kbase, ks, keys + r * KS + i0, m, D, w.kf.data());
      const __mmask16 valid = m == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << m) - 1);
      for (int64_t q = r * G; q < (r + 1) * G; ++q) {
        const __m512 x = block_scores(qrow(q), w.kf.data(), D, scv);
        _mm512_storeu_ps(s + q * padded + i0, x);
        vmx[q] = _mm512_mask_max_ps(vmx[q], valid, vmx[q], x);
      }
    }
  }
  for (int64_t q = 0; q < NQ; ++q) {
    const int64_t nq = n[q / G], pq = (nq + 15) / 16 * 16;
    float* sq = s + q * padded;  // past nq: exponentials of leftovers, never read
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx[q]));
    for (int64_t i = 0; i < pq; i += 16) _mm512_storeu_ps(sq + i, exp16(_mm512_sub_ps(_mm512_loadu_ps(sq + i), mx)));
    w.e[q] = sq;
    w.o[q] = orow0 + (q / G) * ostride_t + (q % G) * D;  // out [B, T, H, D]
    w.tot[q] = 0.0f;
    w.qn[q] = nq;
  }
  // the common keys for all rows' heads at once, finished there for a row without keys past them
  bool all_done = true;
  for (int64_t r = 0; r < R; ++r) all_done = all_done && n[r] == c;
  if (c > 0) {
    if constexpr (std::is_same_v<KT, float>) {
      weigh_all(vbase, vs, keys, 0, c, D, NQ, w.e.data(), w.o.data(), w.tot.data(), w.qn.data(), false, all_done);
    } else {  // value rows widened once per chunk of keys (the float32 rows stay in L1 for all tiles)
      const int64_t DP = (D + 15) / 16 * 16, KC = std::max<int64_t>(16, 4096 / DP);
      float* vf = w.vf.data();
      for (int64_t k0 = 0; k0 < c; k0 += KC) {
        const int64_t k1 = std::min(c, k0 + KC);
        for (int64_t i = k0; i < k1; ++i) {
          const KT* vrow = vbase + keys[i] * vs;
          for (int64_t d = 0; d < DP; d += 16) _mm512_storeu_ps(vf + (i - k0) * DP + d, load16(vrow + d, lanes(d, D)));
        }
        for (int64_t q = 0; q < NQ; ++q) w.es[q] = w.e[q] + k0;
        weigh_all(static_cast<const float*>(vf), DP, w.iota.data(), 0, k1 - k0, D, NQ, w.es.data(), w.o.data(),
                  w.tot.data(), w.qn.data(), k0 > 0, all_done && k1 == c);
      }
    }
  }
  if (all_done && c > 0) return;
  for (int64_t r = 0; r < R; ++r)
    weigh_all(vbase, vs, keys + r * KS, c, n[r], D, G, w.e.data() + r * G, w.o.data() + r * G, w.tot.data() + r * G,
              w.qn.data() + r * G, c > 0, true);
}

template <typename KT>
void run_items(const float* qp, const KT* kp, const KT* vp, const bool* mp, float* op, int64_t B, int64_t H,
               int64_t T, int64_t D, int64_t KVH, int64_t S, std::array<int64_t, 6> kv, int64_t mb, float sc) {
  const int64_t G = H / KVH;
  const auto [kb, kh, ks, vb, vh, vs] = kv;
  if (B * KVH * T == 0) return;  // an empty pass (no groups of rows to split)
  // rows split into groups of at most ROWS_PER_ITEM, and with several threads further while there are
  // fewer items than twice the threads (a row's bits do not depend on its group, so the split may)
  int64_t groups = (T + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
  const int64_t threads = at::get_num_threads();
  const int64_t want = threads > 1 ? (2 * threads + B * KVH - 1) / (B * KVH) : 1;
  groups = std::min(T, std::max(groups, want));
  const int64_t RG = (T + groups - 1) / groups;
  groups = (T + RG - 1) / RG;
  at::parallel_for(0, B * KVH * groups, 1, [&](int64_t i0, int64_t i1) {
    thread_local Scratch w;  // kept between calls: no allocation or zeroing per call
    w.fit(RG, G, S, D);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / (KVH * groups), h = item / groups % KVH, t0 = item % groups * RG;
      const int64_t R = std::min(RG, T - t0);
      attend_rows(qp + ((b * H + h * G) * T + t0) * D, kp + b * kb + h * kh, ks, vp + b * vb + h * vh, vs,
                  mp + b * mb + t0 * S, R, S, G, D, T * D, sc, op + ((b * T + t0) * H + h * G) * D, H * D, w);
    }
  });
}

}  // namespace

// q [B, H, T, D] float32 contiguous; k, v [B, KVH, S, D] float32 or bfloat16 (the cache as it is: a
// bfloat16 value widens to float32 exactly, so both give the same bits) with unit stride in D; mask
// bool [Bm, T, S] contiguous, Bm = 1 or B. Returns [B, T, H, D] float32.
torch::Tensor row_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 4, "q: contiguous float32 [B, H, T, D]");
  TORCH_CHECK((k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16) &&
                  v.scalar_type() == k.scalar_type() && k.dim() == 4 && v.dim() == 4,
              "k, v: float32 or bfloat16 [B, KVH, S, D], the same dtype");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.sizes() == v.sizes(), "k, v: same shape, unit stride in D");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 3, "mask: contiguous bool [B, T, S]");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t KVH = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && H % KVH == 0, "shapes do not match");
  TORCH_CHECK(H / KVH <= MAX_G, "at most 16 query heads per key head");
  TORCH_CHECK((mask.size(0) == 1 || mask.size(0) == B) && mask.size(1) == T && mask.size(2) == S, "mask shape");
  auto out = torch::empty({B, T, H, D}, q.options());
  const std::array<int64_t, 6> kv = {k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2)};
  const int64_t mb = mask.size(0) == 1 ? 0 : T * S;
  const float sc = static_cast<float>(scale);
  if (k.scalar_type() == at::kFloat)
    run_items(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), mask.data_ptr<bool>(),
              out.data_ptr<float>(), B, H, T, D, KVH, S, kv, mb, sc);
  else
    run_items(q.data_ptr<float>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), mask.data_ptr<bool>(),
              out.data_ptr<float>(), B, H, T, D, KVH, S, kv, mb, sc);
  return out;
}
