// AVX-512 helpers the C++ kernels share: tail masks and float32 views of float32 or bfloat16 rows.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

namespace m2r2 {

// lanes d..d+15 of a row of D elements that exist (the last chunk of a D not divisible by 16 is partial)
inline __mmask16 lanes(int64_t d, int64_t D) {
  return D - d >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (D - d)) - 1);
}

// 16 elements as float32 (masked lanes 0): float32 as is, bfloat16 widened exactly (its 16 bits on top)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

}  // namespace m2r2
