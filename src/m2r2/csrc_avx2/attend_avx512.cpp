// The row attention (rows_avx2.cpp, attend_row) from a bfloat16 cache on AVX-512, for CPUs with AVX512-BF16 (AMD
// Zen 4/5, Intel Cooper Lake and later), chosen at run time; the extension itself is built with AVX2 flags only
// and still loads on AVX2 CPUs. Every output gets the AVX2 path's bits (tested).
//
// Why: in a SmolLM2 pass at 250-500 cached tokens the row attention took a fifth to a third of a block's time at
// one row (experiments/block_phases.py); at two threads this build cuts it by 30-45% and a pass's layers by 4-15%
// (experiments/attention_insitu.py).
//
// The scores: VDPBF16PS multiplies pairs of bfloat16 values and adds both products to a float32 lane in one
// instruction, and where the keys and the query are bfloat16 (a bfloat16 cache, and a query rounded to bfloat16, as
// every bfloat16 model's is) a score needs a quarter of the instructions and no widening of the keys. On the AVX2
// path a score's lane j (of 8) adds q[8c + j] k[8c + j] for c = 0, 1, ... by fused multiply-adds, then the lanes
// are summed by hsum4's tree. A product of two bfloat16 values is exact in float32, so a fused multiply-add of it
// rounds once, as an add of the exact product does; and VDPBF16PS adds a lane's odd product, then its even one,
// rounding after each (Intel's definition; measured on a Zen 4, 3.2M of 3.2M lanes). So keys and queries are laid
// out for lane j to hold q[16m + j] k[16m + j] in its odd half and q[16m + 8 + j] k[16m + 8 + j] in its even half:
// instruction m adds steps c = 2m, 2m + 1 in that order, lanes 0-7 for one key and 8-15 for the next, and the
// lanes are summed by the same tree. The one difference: VDPBF16PS treats values below float32's normal range
// (|x| < 1.2e-38) as zero, which keys, queries and their products do not reach.
//
// The weighted values: the AVX2 path's multiply-adds, lane for lane, 16 lanes a register.
#include <immintrin.h>
#include <torch/extension.h>

#include "kernels2.h"
#include "simd2.h"

#include <atomic>
#include <cstring>

#pragma GCC target("avx512f,avx512vl,avx512bw,avx512bf16")

namespace {

// slot s of a step's operand (32 bfloat16 values, lanes 0-7 one key, 8-15 the next): which of the two keys'
// 32 values starting at 32 * (m / 2) it takes (VPERMT2W indices: 0-31 the first key, 32-63 the second)
__m512i step_index(int half) {
  alignas(64) uint16_t idx[32];
  for (int s = 0; s < 32; ++s) {
    const int lane = s / 2 % 8, key = s / 16, even = s % 2 == 0;
    idx[s] = static_cast<uint16_t>(key * 32 + half * 16 + (even ? 8 : 0) + lane);
  }
  return _mm512_load_si512(idx);
}

// the same layout for one query vector (float32 holding bfloat16 values), repeated for both keys: each step's 16
// values as bfloat16 (their high halves), then placed by one VPERMW
void query_steps(const float* q, int64_t D, __m512bh* out) {
  alignas(64) uint16_t idx[32];
  for (int s = 0; s < 32; ++s) idx[s] = static_cast<uint16_t>((s % 2 == 0 ? 8 : 0) + s / 2 % 8);
  const __m512i place = _mm512_load_si512(idx);
  for (int64_t m = 0; m < D / 16; ++m) {
    const __m256i halves = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_loadu_si512(q + 16 * m), 16));
    const __m512i v = _mm512_permutexvar_epi16(place, _mm512_castsi256_si512(halves));
    std::memcpy(&out[m], &v, 64);
  }
}

constexpr int64_t MAX_D = 256;  // head sizes up to this take the fast path (operands kept on the stack)

// GN query vectors against four keys: their scores (times sc) into e, as score4 in rows_avx2.cpp gives them
template <int GN>
inline void score4_bf16(const __m512bh (*qs)[MAX_D / 16], const at::BFloat16* const* k4, int64_t D, float sc, float* e,
                        int64_t estride, __m512i idx0, __m512i idx1) {
  __m512 acc[GN][2];
  for (int j = 0; j < GN; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
  for (int64_t mm = 0; mm < D / 32; ++mm) {
    __m512bh ops[2][2];
    for (int p = 0; p < 2; ++p) {
      const __m512i a = _mm512_loadu_si512(k4[2 * p] + 32 * mm), b = _mm512_loadu_si512(k4[2 * p + 1] + 32 * mm);
      const __m512i o0 = _mm512_permutex2var_epi16(a, idx0, b), o1 = _mm512_permutex2var_epi16(a, idx1, b);
      std::memcpy(&ops[p][0], &o0, 64);
      std::memcpy(&ops[p][1], &o1, 64);
    }
    for (int j = 0; j < GN; ++j)
      for (int p = 0; p < 2; ++p) {
        acc[j][p] = _mm512_dpbf16_ps(acc[j][p], ops[p][0], qs[j][2 * mm]);
        acc[j][p] = _mm512_dpbf16_ps(acc[j][p], ops[p][1], qs[j][2 * mm + 1]);
      }
  }
  // hsum4's tree on both keys of a register at once: lanes 0-3 of a key's 8 get s = lo + hi, then every
  // lane k of a 4-lane group (s0 + s2) + (s1 + s3) (IEEE addition commutes, so a swapped operand order
  // gives the same bits); the four keys' sums land in lanes 0, 4, 8 and 12 of the packed register
  const __m512i pack = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int j = 0; j < GN; ++j) {
    const __m512 s01 = _mm512_add_ps(acc[j][0], _mm512_shuffle_f32x4(acc[j][0], acc[j][0], 0xB1));
    const __m512 s23 = _mm512_add_ps(acc[j][1], _mm512_shuffle_f32x4(acc[j][1], acc[j][1], 0xB1));
    const __m512 w = _mm512_permutex2var_ps(s01, pack, s23);  // keys 0, 1, 2, 3: s0..s3 in each 4-lane group
    const __m512 t = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4E));  // (s0 + s2), (s1 + s3), ...
    const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));  // (s0 + s2) + (s1 + s3)
    const __m128 sums = _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, u));
    _mm_storeu_ps(e + j * estride, _mm_mul_ps(sums, _mm_set1_ps(sc)));
  }
}

// GN query vectors' weighted values over 64 output lanes from d0 (four 16-lane chunks), keys in cache order,
// divided by the vectors' sums of exponentials: rows_avx2.cpp's weigh, lane for lane, on 16 lanes at once
template <int GN>
inline void weigh64(const float* e, int64_t estride, const int32_t* keys, int64_t n, const at::BFloat16* vb, int64_t vs,
                    int64_t d0, const float* tots, float* out, int64_t D) {
  __m512 acc[GN][4];
  for (int j = 0; j < GN; ++j)
    for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const at::BFloat16* v = vb + keys[i] * vs + d0;
    __m512 p[GN];
    for (int j = 0; j < GN; ++j) p[j] = _mm512_set1_ps(e[j * estride + i]);
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * c));
      const __m512 vc = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));  // exact widening
      for (int j = 0; j < GN; ++j) acc[j][c] = _mm512_fmadd_ps(p[j], vc, acc[j][c]);
    }
  }
  for (int j = 0; j < GN; ++j) {
    const __m512 tot = _mm512_set1_ps(tots[j]);
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + j * D + d0 + 16 * c, _mm512_div_ps(acc[j][c], tot));
  }
}

bool cpu_has_avx512_bf16() { return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"); }
std::atomic<bool> avx512_attention_on{cpu_has_avx512_bf16() && !m2r2_avx2::turned_off("M2R2_NO_AVX512_ATTENTION")};

}  // namespace

namespace m2r2_avx2 {

bool avx512_attention_in_use() { return avx512_attention_on.load(std::memory_order_relaxed); }
bool set_avx512_attention(bool on) { return avx512_attention_on.exchange(on && cpu_has_avx512_bf16()); }
bool avx512_attention_fits(int64_t D) { return D % 64 == 0 && D <= MAX_D; }

void scores_avx512(const float* q, int64_t qstride, int64_t G, const at::BFloat16* kb, int64_t ks, const int32_t* keys,
                 int64_t n, int64_t D, float sc, float* e, int64_t estride) {
  const __m512i idx0 = step_index(0), idx1 = step_index(1);
  __m512bh qs[3][MAX_D / 16];
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    const int gn = static_cast<int>(std::min<int64_t>(3, G - g0));
    for (int j = 0; j < gn; ++j) query_steps(q + (g0 + j) * qstride, D, qs[j]);
    for (int64_t i0 = 0; i0 < n; i0 += 4) {  // four keys at a time; a short block repeats its last key
      const int64_t nb = std::min<int64_t>(4, n - i0);
      const at::BFloat16* k4[4];
      for (int64_t j = 0; j < 4; ++j) k4[j] = kb + keys[i0 + std::min(j, nb - 1)] * ks;
      float* eg = e + g0 * estride + i0;
      switch (gn) {
        case 3: score4_bf16<3>(qs, k4, D, sc, eg, estride, idx0, idx1); break;
        case 2: score4_bf16<2>(qs, k4, D, sc, eg, estride, idx0, idx1); break;
        default: score4_bf16<1>(qs, k4, D, sc, eg, estride, idx0, idx1); break;
      }
    }
  }
}

void values_avx512(const float* e, int64_t estride, int64_t G, const int32_t* keys, int64_t n, const at::BFloat16* vb,
                 int64_t vs, const float* tots, float* out, int64_t D) {
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    const float* eg = e + g0 * estride;
    for (int64_t d0 = 0; d0 < D; d0 += 64) switch (std::min<int64_t>(3, G - g0)) {
        case 3: weigh64<3>(eg, estride, keys, n, vb, vs, d0, tots + g0, out + g0 * D, D); break;
        case 2: weigh64<2>(eg, estride, keys, n, vb, vs, d0, tots + g0, out + g0 * D, D); break;
        default: weigh64<1>(eg, estride, keys, n, vb, vs, d0, tots + g0, out + g0 * D, D); break;
      }
  }
}

}  // namespace m2r2_avx2
