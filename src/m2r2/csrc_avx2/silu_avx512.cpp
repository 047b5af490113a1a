// SwiGLU's product (rows_avx2.cpp, silu_mul_range) on 16 lanes for CPUs with AVX-512 (F, BW, VL), chosen at run time;
// the extension itself is built with AVX2 flags only and still loads on AVX2 CPUs. Every output gets the AVX2
// path's bits (tested): each lane runs the same operations in the same order (simd2.h's exp8 on 16 lanes with its
// constants, the bfloat16 roundings the same integer steps), and the lanes past a range's end are masked instead of
// zero-filled. The 16-lane exp is exp16.h's (simd2.h is inlined by files built for AVX2 only).
//
// Why: the product is the largest of a block's row-wise steps (1.7 us a row a block on one thread, over a quarter
// of them; BENCHMARKS.md, "Thirtieth round"), paid again for every verify row and every prefilled token.
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>

#include "kernels2.h"
#include "simd2.h"

#pragma GCC target("avx512f,avx512vl,avx512bw")
#include "exp16.h"

namespace {

inline __m512 load16(const at::BFloat16* p, __mmask16 k) {  // bfloat16 widened exactly; masked lanes 0
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

inline __m512i bf16_bits16(__m512 v) {  // simd2.h's rounding to nearest even, lane for lane
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
}


bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}
std::atomic<bool> avx512_silu_on{cpu_has_avx512() && !m2r2_avx2::turned_off("M2R2_NO_AVX512_SILU")};

}  // namespace

namespace m2r2_avx2 {

bool avx512_silu_in_use() { return avx512_silu_on.load(std::memory_order_relaxed); }
bool set_avx512_silu(bool on) { return avx512_silu_on.exchange(on && cpu_has_avx512()); }

void silu_mul_range_avx512(const at::BFloat16* g, const at::BFloat16* u, int64_t c0, int64_t c1, uint16_t* o) {
  for (int64_t j = c0; j < c1; j += 16) {
    const int64_t n = std::min<int64_t>(16, c1 - j);
    const __mmask16 k = static_cast<__mmask16>(n >= 16 ? 0xFFFFu : (1u << n) - 1);
    const __m512 x = load16(g + j, k);
    const __m512 sig =
        _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(sig), 16));
    const __m512i out = bf16_bits16(_mm512_mul_ps(rounded, load16(u + j, k)));
    _mm256_mask_storeu_epi16(o + j, k, _mm512_cvtepi32_epi16(out));
  }
}

}  // namespace m2r2_avx2
