// simd2.h's exp8 on 16 lanes, for the AVX-512 files (silu_avx512.cpp, attend_amx.cpp): its constants, its steps in
// its order, so every lane gets exp8's bits (tested through SwiGLU's product). Include it after the file's target
// pragma; it has internal linkage, so no copy built for one instruction set stands in for another's.
#pragma once

#include <immintrin.h>

#include "simd2.h"

namespace {

inline __m512 exp16(__m512 x) {  // simd2.h's exp8 on 16 lanes: its constants, its steps in its order
  namespace c = m2r2_avx2::exp_c;
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(c::HI)), _mm512_set1_ps(c::LO));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(c::LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(c::LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(c::LN2_LO), r);
  __m512 p = _mm512_set1_ps(c::P[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c::P[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

}  // namespace
