// The q4-avx2 kernel's loop over blocks of 8 output columns (layouts and numerics: q4_avx2.cpp), compiled
// twice: in q4_avx2.cpp with AVX2 only, and in q4_vnni.cpp for CPUs with AVX512-VNNI, where VPDPBUSD adds
// four byte products straight into a 32-bit lane (one instruction for VPMADDUBSW + VPADDW, no widening
// VPMADDWD). No partial sum here can saturate a 16-bit lane (the bounds are noted at each product), so both
// builds compute the same integers and a row gets the same bits on either (tested). Everything here has
// internal linkage: the two translation units' copies, compiled for different CPUs, never merge.
//
// The blocks come in pairs (m2r2.kernels.interleave_pairs): group g of block 2p+1 follows group g of block
// 2p, so a pair's 16 columns stream from one run of memory; an odd last block stays alone. The VNNI build
// runs a pair in one 512-bit register a row (pair_rows): each broadcast input, row step and float operation
// serves 16 columns instead of 8 (Zen 4 runs a 512-bit operation as two 256-bit halves: the same
// multiply-adds in half the instructions). Every lane's integers and float operations, in their order, are
// the 8-column loop's, so the bits stay the same (tested). experiments/q4_micro.cpp ("vnni zmm mixed", 4-bit)
// measured 20-33% more multiply-adds a second than the 8-column loop at 1-8 rows on a Zen 4 core with the
// weights in L2, and 8-12% less time at 4 and 8 rows from memory (the same at 1-3 rows, bound by memory
// there). Two blocks read side by side from G * 128 bytes apart ran at ~2/3 of the memory speed: hence the
// interleaving. In generation (experiments/round_parts.py) a verify row's layers cost ~20% less.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include "simd2.h"

#ifndef M2R2_VNNI
#define M2R2_VNNI 0
#endif

namespace {

using namespace m2r2_avx2;

constexpr int64_t NB = 8;  // columns per block: one register of 8 float32 sums
// rows per pass over a block's weights: as many as the registers hold (AVX2's 16 take 4 rows' sums and outputs,
// AVX-512's 32 take 8), so that a prefill or a long verify pass reads and unpacks each weight half as often
#ifndef M2R2_VNNI_ROWS
#define M2R2_VNNI_ROWS 8
#endif
constexpr int MB = M2R2_VNNI ? M2R2_VNNI_ROWS : 4;
#ifndef M2R2_PREFETCH
#define M2R2_PREFETCH 4096
#endif
constexpr int64_t PREFETCH = M2R2_PREFETCH;
#ifndef M2R2_PREFETCH_L2
#define M2R2_PREFETCH_L2 32768
#endif
constexpr int64_t PREFETCH_L2 = M2R2_PREFETCH_L2;

// The weights' line at p asked for twice ahead of its use: into L1 PREFETCH bytes ahead, and into L2 PREFETCH_L2
// bytes ahead. A one-row pass is bound by memory, not by the dot products (experiments/verify_cost.py). The L2
// request keeps more lines in flight while a pass of several rows spends longer on each group: on a 2-vCPU
// Sapphire Rapids class Xeon, whose two threads stream ~20 GB/s, it made a pass's 30 layers 4% and the 8-bit head
// 11-14% faster at 1-4 rows (experiments/stream_ab.py).
inline void prefetch(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_L2), _MM_HINT_T1);
}

// 4 int8 inputs repeated over a register, loaded straight into it (a load-port broadcast, no ALU op)
inline __m256i broadcast4(const int8_t* p) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
}

// One block of 8 columns for R rows (xq, step, qsum at the first row; row strides K and G): every
// group's integer sums per row, then its float32 terms, group by group.
// gq / gs: bytes / halves from one group's weights / terms to the next (a lone block's own sizes, twice
// them in a pair).
template <int BITS, int R>
inline void block_rows(const uint8_t* qb, const at::Half* sb, const int8_t* xq, const float* step, const float* qsum,
                       int64_t K, int64_t G, uint16_t* y, int64_t N, int64_t gq, int64_t gs) {
  constexpr int64_t gbytes = BITS == 4 ? 128 : 256;  // one group's weights
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  __m256 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* qg = qb + g * gq;
    for (int64_t line = 0; line < gbytes; line += 64)  // the weights ahead (blocks are contiguous): see prefetch()
      prefetch(qg + line);
    __m256i sums[R];
    if constexpr (BITS == 4) {
      // 16-bit lanes take 16 products of at most 15 * 127 each: no overflow before the widening add
      __m256i s16[R];
      for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      // kept rolled: unrolled, the compiler computed all 32 products before adding them and spilled them
#pragma GCC unroll 1
      for (int h = 0; h < 4; ++h) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 32 * h));
        const __m256i lo = _mm256_and_si256(bytes, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + r * K + g * 32 + 8 * h;
#if M2R2_VNNI  // four byte products straight into each 32-bit lane (s16 holds 32-bit sums here)
          s16[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s16[r], lo, broadcast4(xr)), hi, broadcast4(xr + 4));
#else
          const __m256i pa = _mm256_maddubs_epi16(lo, broadcast4(xr));
          const __m256i pb = _mm256_maddubs_epi16(hi, broadcast4(xr + 4));
          s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(pa, pb));
#endif
        }
      }
      for (int r = 0; r < R; ++r) sums[r] = M2R2_VNNI ? s16[r] : _mm256_madd_epi16(s16[r], ones);
    } else {
      for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
#if M2R2_VNNI
      // unsigned inputs x + 128 times signed w into 32-bit lanes (no saturation), less 128 sum w: the inputs
      // come offset (linear_rows, q4_avx2.cpp), which saves the sign transfer per row and product
      const __m256i one8 = _mm256_set1_epi8(1);
      __m256i wsum = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 32 * j));
        wsum = _mm256_dpbusd_epi32(wsum, one8, w);
        for (int r = 0; r < R; ++r) sums[r] = _mm256_dpbusd_epi32(sums[r], broadcast4(xq + r * K + g * 32 + 4 * j), w);
      }
      const __m256i offset = _mm256_slli_epi32(wsum, 7);
      for (int r = 0; r < R; ++r) sums[r] = _mm256_sub_epi32(sums[r], offset);
#else
      // signed x signed: |w| times x with w's sign (two products of 127 * 127 fit a 16-bit lane; VPMADDUBSW
      // would saturate on 255 * 127 pairs, so the AVX2 build cannot take the offset inputs)
#pragma GCC unroll 1
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 32 * j));
        const __m256i aw = _mm256_abs_epi8(w);
        for (int r = 0; r < R; ++r) {
          const __m256i sx = _mm256_sign_epi8(broadcast4(xq + r * K + g * 32 + 4 * j), w);
          sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
        }
      }
#endif
    }
    const at::Half* s = sb + g * gs;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
    for (int r = 0; r < R; ++r) {
      const __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(step[r * G + g]));
      out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), scaled, out[r]);
    }
    if constexpr (BITS == 4) {
      const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + NB)));
      for (int r = 0; r < R; ++r) out[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(qsum[r * G + g]), out[r]);
    }
  }
  for (int r = 0; r < R; ++r) store8_bf16(y + r * N, out[r]);
}

#if M2R2_VNNI
// float32 sums of 16 columns -> bfloat16 bits, each 8-column half as store8_bf16 rounds it
inline void store16_bf16(uint16_t* y, __m512 v) {
  store8_bf16(y, _mm512_castps512_ps256(v));
  store8_bf16(y + NB, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// A pair of blocks' 16 columns in one register (see the top): 32 bytes of each block at offset o of group qg (a block's
// group is gbytes long), side by side
inline __m512i pair_bytes(const uint8_t* qg, int64_t gbytes, int64_t o) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + o))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + gbytes + o)), 1);
}

// ... and its 16 float16 terms as float32: the first block's 8 at s + a, the second's at s + b
inline __m512 pair_terms16(const at::Half* s, int64_t a, int64_t b) {
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + a)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b)));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

// Group g's float terms for R rows of a pair of blocks (16 columns; the first block's 8 steps, then, 4-bit, its 8
// minima at s, the second block's after them): out[r] += sum(r) * (d * step) and, 4-bit, + m * qsum, lane by lane
// as block_rows does for 8 columns. One helper for pair_rows and the AMX tiles' loop (q4_amx_rows.cpp), whose
// integer sums come from registers or from a stored tile: the same float operations in the same order.
template <int BITS, int R, typename Sum>
inline void pair_terms(__m512 (&out)[R], const Sum& sum, const at::Half* s, const float* step, const float* qsum,
                       int64_t G, int64_t g) {
  constexpr int64_t terms = BITS == 4 ? 2 : 1;
  const __m512 d = pair_terms16(s, 0, terms * NB);
  for (int r = 0; r < R; ++r) {
    const __m512 scaled = _mm512_mul_ps(d, _mm512_set1_ps(step[r * G + g]));
    out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum(r)), scaled, out[r]);
  }
  if constexpr (BITS == 4) {
    const __m512 mn = pair_terms16(s, NB, 3 * NB);
    for (int r = 0; r < R; ++r) out[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(qsum[r * G + g]), out[r]);
  }
}

// A pair of blocks (16 columns; groups interleaved, see the top) for R rows in 512-bit registers: lanes 0-7
// are block_rows' lanes of the first block, lanes 8-15 of the second, with the same integers and the same
// float operations in the same order.
template <int BITS, int R>
inline void pair_rows(const uint8_t* qb, const at::Half* sb, const int8_t* xq, const float* step, const float* qsum,
                      int64_t K, int64_t G, uint16_t* y, int64_t N) {
  constexpr int64_t gbytes = BITS == 4 ? 128 : 256, terms = BITS == 4 ? 2 : 1;
  __m512 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm512_setzero_ps();
  // 4 int8 inputs broadcast to every 32-bit lane
  const auto inputs = [](const int8_t* x) {
    int32_t v;
    std::memcpy(&v, x, 4);
    return _mm512_set1_epi32(v);
  };
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* qg = qb + g * 2 * gbytes;
    for (int64_t line = 0; line < 2 * gbytes; line += 64) prefetch(qg + line);
    __m512i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
    if constexpr (BITS == 4) {
      const __m512i low4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 1
      for (int h = 0; h < 4; ++h) {
        const __m512i bytes = pair_bytes(qg, gbytes, 32 * h);
        const __m512i lo = _mm512_and_si512(bytes, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + r * K + g * 32 + 8 * h;
          sums[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums[r], lo, inputs(xr)), hi, inputs(xr + 4));
        }
      }
    } else {
      // the inputs come as x + 128 (unsigned bytes, see below): sum (x + 128) w - 128 sum w = sum x w exactly,
      // with sum w over the group's 32 inputs taken once for all rows
      const __m512i ones = _mm512_set1_epi8(1);
      __m512i wsum = _mm512_setzero_si512();
#pragma GCC unroll 1
      for (int j = 0; j < 8; ++j) {
        const __m512i w = pair_bytes(qg, gbytes, 32 * j);
        wsum = _mm512_dpbusd_epi32(wsum, ones, w);
        for (int r = 0; r < R; ++r) sums[r] = _mm512_dpbusd_epi32(sums[r], inputs(xq + r * K + g * 32 + 4 * j), w);
      }
      const __m512i offset = _mm512_slli_epi32(wsum, 7);
      for (int r = 0; r < R; ++r) sums[r] = _mm512_sub_epi32(sums[r], offset);
    }
    pair_terms<BITS, R>(out, [&sums](int r) { return sums[r]; }, sb + g * 2 * terms * NB, step, qsum, G, g);
  }
  for (int r = 0; r < R; ++r) store16_bf16(y + r * N, out[r]);
}
#endif

// One block (or, on the VNNI build, a pair: `pair`) for M rows, MB rows at a time.
template <int BITS>
inline void rows_of(const uint8_t* qb, const at::Half* sb, const int8_t* xq, const float* step, const float* qsum,
                    int64_t M, int64_t K, int64_t G, uint16_t* yb, int64_t N, int64_t gq, int64_t gs, bool pair) {
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int rows = static_cast<int>(M - m0 < MB ? M - m0 : MB);
    const int8_t* xr = xq + m0 * K;
    const float *st = step + m0 * G, *qs = qsum + m0 * G;
    uint16_t* y = yb + m0 * N;
#if M2R2_VNNI
    if (pair) {
      switch (rows) {
#if M2R2_VNNI_ROWS == 8
        case 8: pair_rows<BITS, 8>(qb, sb, xr, st, qs, K, G, y, N); break;
        case 7: pair_rows<BITS, 7>(qb, sb, xr, st, qs, K, G, y, N); break;
        case 6: pair_rows<BITS, 6>(qb, sb, xr, st, qs, K, G, y, N); break;
        case 5: pair_rows<BITS, 5>(qb, sb, xr, st, qs, K, G, y, N); break;
#endif
        case 4: pair_rows<BITS, 4>(qb, sb, xr, st, qs, K, G, y, N); break;
        case 3: pair_rows<BITS, 3>(qb, sb, xr, st, qs, K, G, y, N); break;
        case 2: pair_rows<BITS, 2>(qb, sb, xr, st, qs, K, G, y, N); break;
        default: pair_rows<BITS, 1>(qb, sb, xr, st, qs, K, G, y, N); break;
      }
      continue;
    }
#else
    (void)pair;
#endif
    switch (rows) {
#if M2R2_VNNI && M2R2_VNNI_ROWS == 8
      case 8: block_rows<BITS, 8>(qb, sb, xr, st, qs, K, G, y, N, gq, gs); break;
      case 7: block_rows<BITS, 7>(qb, sb, xr, st, qs, K, G, y, N, gq, gs); break;
      case 6: block_rows<BITS, 6>(qb, sb, xr, st, qs, K, G, y, N, gq, gs); break;
      case 5: block_rows<BITS, 5>(qb, sb, xr, st, qs, K, G, y, N, gq, gs); break;
#endif
      case 4: block_rows<BITS, 4>(qb, sb, xr, st, qs, K, G, y, N, gq, gs); break;
      case 3: block_rows<BITS, 3>(qb, sb, xr, st, qs, K, G, y, N, gq, gs); break;
      case 2: block_rows<BITS, 2>(qb, sb, xr, st, qs, K, G, y, N, gq, gs); break;
      default: block_rows<BITS, 1>(qb, sb, xr, st, qs, K, G, y, N, gq, gs); break;
    }
  }
}

// Blocks [b0, b1) of y [M, blocks * 8] for M rows of int8 inputs (xq [M, K], per group steps and sums).
// The blocks come in pairs (see the top): callers split them at even b0 so that a pair stays whole.
template <int BITS>
void block_range(const uint8_t* qp, const at::Half* sp, const int8_t* xq, const float* step, const float* qsum,
                 int64_t M, int64_t K, int64_t blocks, uint16_t* yp, int64_t b0, int64_t b1) {
  constexpr int64_t terms = BITS == 4 ? 2 : 1, gbytes = BITS == 4 ? 128 : 256, ghalves = terms * NB;
  const int64_t N = blocks * NB, G = K / 32, block_bytes = G * gbytes;
  const int64_t paired = blocks / 2 * 2;  // blocks [0, paired) come in pairs
  for (int64_t b = b0; b < b1; ++b) {
    uint16_t* yb = yp + b * NB;
    if (b >= paired) {
      rows_of<BITS>(qp + b * block_bytes, sp + b * G * ghalves, xq, step, qsum, M, K, G, yb, N, gbytes, ghalves, false);
      continue;
    }
    const uint8_t* qb = qp + (b - b % 2) * block_bytes;  // the pair's start
    const at::Half* sb = sp + (b - b % 2) * G * ghalves;
    if (M2R2_VNNI && b % 2 == 0 && b + 1 < b1) {  // the whole pair at once
      rows_of<BITS>(qb, sb, xq, step, qsum, M, K, G, yb, N, 2 * gbytes, 2 * ghalves, true);
      ++b;
      continue;
    }
    rows_of<BITS>(qb + b % 2 * gbytes, sb + b % 2 * ghalves, xq, step, qsum, M, K, G, yb, N, 2 * gbytes, 2 * ghalves,
                  false);
  }
}

}  // namespace
