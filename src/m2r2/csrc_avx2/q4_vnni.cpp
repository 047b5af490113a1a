// The q4-avx2 kernel's block loop (q4_rows.h) built for CPUs with AVX512-VNNI (AMD Zen 4/5, Intel Ice Lake
// and later), chosen at run time by linear_rows (q4_avx2.cpp) where the CPU has it; the extension itself is
// built with AVX2 flags only and still loads on AVX2 CPUs.
//
// Why: in a verify pass of 3-4 rows the loop is bound by its byte products and the 16-bit adds around them
// (experiments/q4_micro.cpp); VPDPBUSD does both in one instruction: the 4-bit loop ran 13-18% more
// multiply-adds a second at 3-4 rows on a Zen 4 core, the same at 1-2 rows (q4_micro.out.txt).
//
// Everything from other headers is included before the target pragma, so that no inline function shared
// with the AVX2-only translation units is compiled here for AVX-512: only this file's own code (internal
// linkage, q4_rows.h) and block_range_vnni get the wider instruction set.
#include <immintrin.h>
#include <torch/extension.h>

#include "kernels2.h"
#include "simd2.h"

#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni")
#define M2R2_VNNI 1
#include "q4_rows.h"

namespace m2r2_avx2 {
void block_range_vnni(int bits, const uint8_t* qbytes, const at::Half* scales, const int8_t* xq, const float* step,
                      const float* qsum, int64_t M, int64_t K, int64_t blocks, uint16_t* y, int64_t b0, int64_t b1) {
  if (bits == 4)
    block_range<4>(qbytes, scales, xq, step, qsum, M, K, blocks, y, b0, b1);
  else
    block_range<8>(qbytes, scales, xq, step, qsum, M, K, blocks, y, b0, b1);
}
}  // namespace m2r2_avx2
