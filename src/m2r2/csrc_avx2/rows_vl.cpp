// The row attention of rows_avx2.cpp built for CPUs with AVX-512 (F, VL, BW: AMD Zen 4/5, Intel Skylake-X
// and later), chosen at run time by attention_rows where the CPU has it; the extension itself is built with
// AVX2 flags only and still loads on AVX2 CPUs.
//
// Why: the rows of a verify pass attend the same verified prefix, and on AVX2 each row widened every key
// and value chunk of it again for its own query vectors (16 registers hold no more than one row's three).
// Here two rows run as one: AVX-512VL's 32 registers hold the scores of four keys for both rows' six query
// vectors, so each key chunk is widened once for the two, and the weighted values run 16 lanes at a time
// with both rows' accumulators in registers. The keys past the rows' shared prefix (a tree row's own
// ancestors) follow for each row on its own.
//
// Same bits as rows_avx2.cpp's attend_row, row by row: a score is the same eight-lane sum of products in
// the same order (ymm, not zmm: the lanes a score's products are summed in are part of its bits) with the
// same horizontal sum; the maximum, the exponentials and each vector's sum of them are computed as there;
// each output lane adds its keys' terms in cache order (lanes are independent, so 16 at a time changes
// nothing), the shared prefix first and then the row's own keys, which lie after it in the cache.
//
// Everything from other headers is included before the target pragma (as in q4_vnni.cpp), so that no inline
// function shared with the AVX2-only translation units is compiled here for AVX-512.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "kernels2.h"
#include "simd2.h"

#pragma GCC target("avx512f,avx512vl,avx512bw")

namespace {

using namespace m2r2_avx2;

inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
// 16 lanes, or (HALF) the first 8 and zeros: no masked load, with which GCC kept the weighted sums in memory
template <bool HALF>
inline __m512 widen16(const float* p) {
  return HALF ? _mm512_castsi512_ps(_mm512_zextsi256_si512(_mm256_castps_si256(_mm256_loadu_ps(p)))) : _mm512_loadu_ps(p);
}
template <bool HALF>
inline __m512 widen16(const at::BFloat16* p) {
  const __m256i raw = HALF ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
                           : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Scores of four keys (k4) for GN query vectors (q, D apart) into e[j * es + 0..3]: rows_avx2.cpp's score4
// for up to two rows' vectors at once. GN <= 6: 24 sums, 6 query chunks and the widened key chunk fit the
// 32 registers.
template <int GN, typename KT>
inline void score4v(const float* q, const KT* const* k4, int64_t D, float sc, float* e, int64_t es) {
  __m256 acc[GN][4];
  for (int j = 0; j < GN; ++j)
    for (int c = 0; c < 4; ++c) acc[j][c] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qd[GN];
    for (int j = 0; j < GN; ++j) qd[j] = _mm256_loadu_ps(q + j * D + d);
    for (int c = 0; c < 4; ++c) {
      const __m256 kc = widen8(k4[c] + d);
      for (int j = 0; j < GN; ++j) acc[j][c] = _mm256_fmadd_ps(qd[j], kc, acc[j][c]);
    }
  }
  for (int j = 0; j < GN; ++j) _mm_storeu_ps(e + j * es, _mm_mul_ps(hsum4(acc[j]), _mm_set1_ps(sc)));
}

// Scores of keys [i0, i1) of `keys` for nv vectors (q, D apart) into their rows of e (es apart).
template <typename KT>
void score_keys(const float* q, int nv, const int32_t* keys, int64_t i0, int64_t i1, const KT* kb, int64_t ks,
                int64_t D, float sc, float* e, int64_t es) {
  for (int64_t i = i0; i < i1; i += 4) {  // four keys at a time; a short block repeats its last key
    const int64_t nb = std::min<int64_t>(4, i1 - i);
    const KT* k4[4];
    for (int64_t j = 0; j < 4; ++j) k4[j] = kb + keys[i + std::min(j, nb - 1)] * ks;
    for (int v0 = 0; v0 < nv; v0 += 6) {
      const float* qv = q + v0 * D;
      float* ev = e + v0 * es + i;
      switch (std::min(6, nv - v0)) {
        case 6: score4v<6>(qv, k4, D, sc, ev, es); break;
        case 5: score4v<5>(qv, k4, D, sc, ev, es); break;
        case 4: score4v<4>(qv, k4, D, sc, ev, es); break;
        case 3: score4v<3>(qv, k4, D, sc, ev, es); break;
        case 2: score4v<2>(qv, k4, D, sc, ev, es); break;
        default: score4v<1>(qv, k4, D, sc, ev, es); break;
      }
    }
  }
}

// Adds keys [i0, i1)'s values, weighted by e (GN vectors, es apart), to the vectors' running sums acc (D apart)
// in lanes [d0, d0 + 16 CH) (HALF: the last chunk has 8), key by key in cache order, the sums held in registers
// meanwhile.
template <int GN, int CH, bool HALF, typename KT>
inline void weigh_seg(const float* e, int64_t es, const int32_t* keys, int64_t i0, int64_t i1, const KT* vb,
                      int64_t vs, int64_t d0, float* acc_io, int64_t D) {
  auto lanes = [](int c) -> __mmask16 { return HALF && c == CH - 1 ? 0x00FF : 0xFFFF; };
  __m512 acc[GN][CH];
  for (int j = 0; j < GN; ++j)
    for (int c = 0; c < CH; ++c) acc[j][c] = _mm512_maskz_loadu_ps(lanes(c), acc_io + j * D + d0 + 16 * c);
  for (int64_t i = i0; i < i1; ++i) {
    const KT* v = vb + keys[i] * vs + d0;
    __m512 p[GN];  // the weights first: broadcast inside the chunk loop, GCC kept the sums in memory
    for (int j = 0; j < GN; ++j) p[j] = _mm512_set1_ps(e[j * es + i]);
    for (int c = 0; c < CH; ++c) {
      const __m512 vc = HALF && c == CH - 1 ? widen16<true>(v + 16 * c) : widen16<false>(v + 16 * c);
      for (int j = 0; j < GN; ++j) acc[j][c] = _mm512_fmadd_ps(p[j], vc, acc[j][c]);
    }
  }
  for (int j = 0; j < GN; ++j)
    for (int c = 0; c < CH; ++c) _mm512_mask_storeu_ps(acc_io + j * D + d0 + 16 * c, lanes(c), acc[j][c]);
}

template <int CH, bool HALF, typename KT>
void weigh_keys(const float* e, int64_t es, int nv, const int32_t* keys, int64_t i0, int64_t i1, const KT* vb,
                int64_t vs, int64_t d0, float* acc, int64_t D) {
  if (i0 >= i1) return;
  for (int v0 = 0; v0 < nv; v0 += 6) {
    const float* ev = e + v0 * es;
    float* av = acc + v0 * D;
    switch (std::min(6, nv - v0)) {
      case 6: weigh_seg<6, CH, HALF>(ev, es, keys, i0, i1, vb, vs, d0, av, D); break;
      case 5: weigh_seg<5, CH, HALF>(ev, es, keys, i0, i1, vb, vs, d0, av, D); break;
      case 4: weigh_seg<4, CH, HALF>(ev, es, keys, i0, i1, vb, vs, d0, av, D); break;
      case 3: weigh_seg<3, CH, HALF>(ev, es, keys, i0, i1, vb, vs, d0, av, D); break;
      case 2: weigh_seg<2, CH, HALF>(ev, es, keys, i0, i1, vb, vs, d0, av, D); break;
      default: weigh_seg<1, CH, HALF>(ev, es, keys, i0, i1, vb, vs, d0, av, D); break;
    }
  }
}

struct Scratch {
  std::vector<int32_t> keys;
  std::vector<float> q, e, acc, tots;
};

// Up to two rows of one key head (row r: G query vectors q[r] + g * qstride, mask m[r], output out[r] + g * D).
template <typename KT>
void attend_rows(const float* const* q, const bool* const* m, float* const* out, int R, int64_t qstride, const KT* kb,
                 int64_t ks, const KT* vb, int64_t vs, int64_t S, int64_t G, int64_t D, float sc, Scratch& s) {
  int64_t n[2] = {0, 0};
  s.keys.resize(2 * S);
  int32_t* keys[2] = {s.keys.data(), s.keys.data() + S};
  int live[2], L = 0;
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < S; ++j)
      if (m[r][j]) keys[r][n[r]++] = static_cast<int32_t>(j);
    if (n[r] == 0)  // no key: the row attends nothing (zeros, as attend_row gives)
      std::fill(out[r], out[r] + G * D, 0.0f);
    else
      live[L++] = r;
  }
  if (L == 0) return;
  int64_t shared = n[live[0]], es = 0;  // keys both rows attend, from the first: the same keys in the same order
  if (L == 2) {
    const int a = live[0], b = live[1];
    shared = 0;
    while (shared < std::min(n[a], n[b]) && keys[a][shared] == keys[b][shared]) ++shared;
  }
  for (int l = 0; l < L; ++l) es = std::max(es, n[live[l]] + 8);  // 8 spare slots: short blocks, exp's padding
  const int nv = static_cast<int>(L * G);  // vector l * G + g: row live[l]'s query head g
  s.q.resize(nv * D);
  s.e.resize(nv * es);
  s.acc.assign(nv * D, 0.0f);
  s.tots.resize(nv);
  float *qb = s.q.data(), *e = s.e.data(), *acc = s.acc.data();
  for (int l = 0; l < L; ++l)
    for (int64_t g = 0; g < G; ++g) std::copy_n(q[live[l]] + g * qstride, D, qb + (l * G + g) * D);
  // scores: the shared keys for every vector at once, then each row's own
  score_keys(qb, nv, keys[live[0]], 0, shared, kb, ks, D, sc, e, es);
  for (int l = 0; l < L; ++l)
    score_keys(qb + l * G * D, static_cast<int>(G), keys[live[l]], shared, n[live[l]], kb, ks, D, sc, e + l * G * es, es);
  // each vector's maximum, exponentials and their sum key by key in cache order (attend_row's arithmetic)
  for (int v = 0; v < nv; ++v) {
    const int64_t nn = n[live[v / G]];
    float* eg = e + v * es;
    __m256 mx8 = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= nn; i += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(eg + i));
    float mx = hmax(mx8);
    for (; i < nn; ++i) mx = std::max(mx, eg[i]);
    for (int64_t j = nn; j < nn + 8; ++j) eg[j] = mx;
    for (int64_t j = 0; j < nn; j += 8)
      _mm256_storeu_ps(eg + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(eg + j), _mm256_set1_ps(mx))));
  }
  for (int l = 0; l < L; ++l)  // a row's G sums side by side, each key by key
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const int gn = static_cast<int>(std::min<int64_t>(4, G - g0));
      const float* eg = e + (l * G + g0) * es;
      float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int64_t i = 0; i < n[live[l]]; ++i)
        for (int j = 0; j < gn; ++j) t[j] += eg[j * es + i];
      for (int j = 0; j < gn; ++j) s.tots[l * G + g0 + j] = t[j];
    }
  // weighted values: running sums in acc, the shared keys for every vector, then each row's own
  int64_t d0 = 0;
  auto lanes = [&](auto ch, auto half) {
    constexpr int CH = decltype(ch)::value;
    constexpr bool HALF = decltype(half)::value;
    weigh_keys<CH, HALF>(e, es, nv, keys[live[0]], 0, shared, vb, vs, d0, acc, D);
    for (int l = 0; l < L; ++l)
      weigh_keys<CH, HALF>(e + l * G * es, es, static_cast<int>(G), keys[live[l]], shared, n[live[l]], vb, vs, d0,
                           acc + l * G * D, D);
  };
  using full = std::false_type;
  for (; d0 + 64 <= D; d0 += 64) lanes(std::integral_constant<int, 4>{}, full{});
  for (; d0 + 16 <= D; d0 += 16) lanes(std::integral_constant<int, 1>{}, full{});
  if (d0 < D) lanes(std::integral_constant<int, 1>{}, std::true_type{});  // D is a multiple of 8
  for (int l = 0; l < L; ++l)
    for (int64_t g = 0; g < G; ++g) {
      const float* a = acc + (l * G + g) * D;
      float* o = out[live[l]] + g * D;
      const __m256 tot = _mm256_set1_ps(s.tots[l * G + g]);
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_div_ps(_mm256_loadu_ps(a + d), tot));
    }
}

template <typename KT>
void run_pairs(const float* qp, const KT* kp, const KT* vp, const bool* mp, float* op, int64_t B, int64_t H, int64_t T,
               int64_t D, int64_t KVH, int64_t S, const int64_t* kv, int64_t mb, float sc) {
  const int64_t G = H / KVH, pairs = (T + 1) / 2;
  at::parallel_for(0, B * KVH * pairs, 1, [&](int64_t i0, int64_t i1) {
    thread_local Scratch s;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / (KVH * pairs), h = item / pairs % KVH, t0 = item % pairs * 2;
      const int R = static_cast<int>(std::min<int64_t>(2, T - t0));
      const float* q[2];
      const bool* m[2];
      float* out[2];
      for (int r = 0; r < R; ++r) {
        const int64_t t = t0 + r;
        q[r] = qp + ((b * H + h * G) * T + t) * D;
        m[r] = mp + b * mb + t * S;
        out[r] = op + ((b * T + t) * H + h * G) * D;
      }
      attend_rows(q, m, out, R, T * D, kp + b * kv[0] + h * kv[1], kv[2], vp + b * kv[3] + h * kv[4], kv[5], S, G, D, sc, s);
    }
  });
}

}  // namespace

namespace m2r2_avx2 {
void attention_rows_vl(const float* q, const void* k, const void* v, bool bf16, const int64_t* kv, const bool* mask,
                       int64_t mb, float* out, int64_t B, int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t S,
                       float sc) {
  if (bf16)
    run_pairs(q, static_cast<const at::BFloat16*>(k), static_cast<const at::BFloat16*>(v), mask, out, B, H, T, D, KVH, S,
              kv, mb, sc);
  else
    run_pairs(q, static_cast<const float*>(k), static_cast<const float*>(v), mask, out, B, H, T, D, KVH, S, kv, mb, sc);
}
}  // namespace m2r2_avx2
