// The q4-avx2 kernel's loop over blocks of 8 output columns (layouts and numerics: q4_avx2.cpp), compiled
// twice: in q4_avx2.cpp with AVX2 only, and in q4_vnni.cpp for CPUs with AVX512-VNNI, where VPDPBUSD adds
// four byte products straight into a 32-bit lane (one instruction for VPMADDUBSW + VPADDW, no widening
// VPMADDWD). No partial sum here can saturate a 16-bit lane (the bounds are noted at each product), so both
// builds compute the same integers and a row gets the same bits on either (tested). Everything here has
// internal linkage: the two translation units' copies, compiled for different CPUs, never merge.
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

// 4 int8 inputs repeated over a register, loaded straight into it (a load-port broadcast, no ALU op)
inline __m256i broadcast4(const int8_t* p) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
}

// One block of 8 columns for R rows (xq, step, qsum at the first row; row strides K and G): every
// group's integer sums per row, then its float32 terms, group by group.
template <int BITS, int R>
inline void block_rows(const uint8_t* qb, const at::Half* sb, const int8_t* xq, const float* step, const float* qsum,
                       int64_t K, int64_t G, uint16_t* y, int64_t N) {
  constexpr int64_t gbytes = BITS == 4 ? 128 : 256;  // one group's weights
  constexpr int terms = BITS == 4 ? 2 : 1;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  __m256 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* qg = qb + g * gbytes;
    for (int64_t line = 0; line < gbytes; line += 64)  // the weights PREFETCH bytes ahead (blocks are contiguous):
      // a one-row pass is bound by memory latency, not by the dot products (experiments/verify_cost.py)
      _mm_prefetch(reinterpret_cast<const char*>(qg + PREFETCH + line), _MM_HINT_T0);
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
      // signed x signed: |w| times x with w's sign (two products of 127 * 127 fit a 16-bit lane)
      for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 32 * j));
        const __m256i aw = _mm256_abs_epi8(w);
        for (int r = 0; r < R; ++r) {
          const __m256i sx = _mm256_sign_epi8(broadcast4(xq + r * K + g * 32 + 4 * j), w);
#if M2R2_VNNI
          sums[r] = _mm256_dpbusd_epi32(sums[r], aw, sx);
#else
          sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
#endif
        }
      }
    }
    const at::Half* s = sb + g * terms * NB;
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

// Blocks [b0, b1) of y [M, blocks * 8] for M rows of int8 inputs (xq [M, K], per group steps and sums),
// MB rows at a time.
template <int BITS>
void block_range(const uint8_t* qp, const at::Half* sp, const int8_t* xq, const float* step, const float* qsum,
                 int64_t M, int64_t K, int64_t blocks, uint16_t* yp, int64_t b0, int64_t b1) {
  constexpr int64_t terms = BITS == 4 ? 2 : 1;
  const int64_t N = blocks * NB, G = K / 32, block_bytes = G * (BITS == 4 ? 128 : 256);
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int rows = static_cast<int>(M - m0 < MB ? M - m0 : MB);
      const uint8_t* qb = qp + b * block_bytes;
      const at::Half* sb = sp + b * G * terms * NB;
      const int8_t* xr = xq + m0 * K;
      const float *st = step + m0 * G, *qs = qsum + m0 * G;
      uint16_t* yb = yp + m0 * N + b * NB;
      switch (rows) {
#if M2R2_VNNI && M2R2_VNNI_ROWS == 8
        case 8: block_rows<BITS, 8>(qb, sb, xr, st, qs, K, G, yb, N); break;
        case 7: block_rows<BITS, 7>(qb, sb, xr, st, qs, K, G, yb, N); break;
        case 6: block_rows<BITS, 6>(qb, sb, xr, st, qs, K, G, yb, N); break;
        case 5: block_rows<BITS, 5>(qb, sb, xr, st, qs, K, G, yb, N); break;
#endif
        case 4: block_rows<BITS, 4>(qb, sb, xr, st, qs, K, G, yb, N); break;
        case 3: block_rows<BITS, 3>(qb, sb, xr, st, qs, K, G, yb, N); break;
        case 2: block_rows<BITS, 2>(qb, sb, xr, st, qs, K, G, yb, N); break;
        default: block_rows<BITS, 1>(qb, sb, xr, st, qs, K, G, yb, N); break;
      }
    }
}

}  // namespace
