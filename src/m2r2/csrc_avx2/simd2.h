// AVX2 helpers the csrc_avx2 kernels share: float32 views of float32 or bfloat16 rows (with a partial
// last chunk), horizontal sums and maxima, and rounding to bfloat16.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <cstring>

namespace m2r2_avx2 {

// 8 elements as float32 (bfloat16 widened exactly); n < 8 reads only n (the rest 0)
inline __m256 load8(const float* p, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(p);
  alignas(32) float t[8] = {};
  std::memcpy(t, p, n * sizeof(float));
  return _mm256_load_ps(t);
}
inline __m256 load8(const at::BFloat16* p, int64_t n) {
  __m128i raw;
  if (n >= 8) {
    raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t t[8] = {};
    std::memcpy(t, p, n * sizeof(uint16_t));
    raw = _mm_load_si128(reinterpret_cast<const __m128i*>(t));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// hsum of four vectors at once, lane k = hsum(v[k]) bit for bit: each vector's halves added, then a 4x4
// transpose, so that lane k adds (s0 + s2) + (s1 + s3) of v[k]'s s = lo + hi, as hsum does
inline __m128 hsum4(const __m256* v) {
  __m128 s[4];
  for (int k = 0; k < 4; ++k) s[k] = _mm_add_ps(_mm256_castps256_ps128(v[k]), _mm256_extractf128_ps(v[k], 1));
  _MM_TRANSPOSE4_PS(s[0], s[1], s[2], s[3]);  // s[i] lane k = v[k]'s s_i
  return _mm_add_ps(_mm_add_ps(s[0], s[2]), _mm_add_ps(s[1], s[3]));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// float32 -> bfloat16 bits, rounding to nearest even (finite values, as c10::BFloat16)
inline __m256i to_bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
}
inline __m256 round_bf16(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(to_bf16_bits(v), 16)); }

// 8 float32 as bfloat16 at y (8 values)
inline void store8_bf16(uint16_t* y, __m256 v) {
  const __m256i b = to_bf16_bits(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y),
                   _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08)));
}

// exp's clamps, ln 2 in two parts and polynomial (highest power first): one set for exp8 and its 16-lane build
// (silu_avx512.cpp), which must give the same bits
namespace exp_c {
constexpr float HI = 88.3762626647949f, LO = -87.3f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f,
                LN2_LO = -2.12194440e-4f;
constexpr float P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                        4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_c

// exp(x) for 8 lanes (csrc/row_attention.cpp's polynomial; 2^n built from its exponent bits, so x is
// clamped to >= -87.3, where exp is below float32's smallest normal anyway). Lanes are independent.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(exp_c::HI)), _mm256_set1_ps(exp_c::LO));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(exp_c::LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(exp_c::LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(exp_c::LN2_LO), r);
  __m256 p = _mm256_set1_ps(exp_c::P[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(exp_c::P[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

}  // namespace m2r2_avx2
