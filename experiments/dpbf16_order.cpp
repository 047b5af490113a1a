// In what order does VDPBF16PS add its two products on this CPU? csrc_avx2/attend_avx512.cpp relies on it to give the
// AVX2 row attention's bits. 3.2M lanes of random bfloat16 pairs and float32 accumulators over a wide range (no value
// below float32's normal range), against three models of the instruction: the odd product added first then the even
// one, rounding after each (Intel's definition); the even one first; and one rounding of the exact sum.
//
//     g++ -O2 -o /tmp/dpbf16_order experiments/dpbf16_order.cpp && /tmp/dpbf16_order
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

static float widen(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static uint16_t truncate(float f) {  // a bfloat16 value (the high half of f)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

__attribute__((target("avx512f,avx512bf16,avx512vl"))) int main() {
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::printf("no AVX512-BF16 on this CPU\n");
    return 0;
  }
  std::mt19937 g(1);
  std::normal_distribution<float> n(0, 1);
  long odd_first = 0, even_first = 0, one_rounding = 0, total = 0;
  for (int it = 0; it < 200000; ++it) {
    uint16_t a[32], b[32];
    float acc0[16], out[16];
    for (int i = 0; i < 32; ++i) {
      a[i] = truncate(n(g) * std::exp(n(g) * 3));
      b[i] = truncate(n(g) * std::exp(n(g) * 3));
    }
    for (int i = 0; i < 16; ++i) acc0[i] = n(g) * std::exp(n(g) * 3);
    __m512bh va, vb;
    std::memcpy(&va, a, 64);
    std::memcpy(&vb, b, 64);
    _mm512_storeu_ps(out, _mm512_dpbf16_ps(_mm512_loadu_ps(acc0), va, vb));
    for (int i = 0; i < 16; ++i) {
      const float ao = widen(a[2 * i + 1]), bo = widen(b[2 * i + 1]), ae = widen(a[2 * i]), be = widen(b[2 * i]);
      const float oe = std::fma(ae, be, std::fma(ao, bo, acc0[i])), eo = std::fma(ao, bo, std::fma(ae, be, acc0[i]));
      const float once = static_cast<float>(double(acc0[i]) + double(ao) * bo + double(ae) * be);
      odd_first += std::memcmp(&oe, &out[i], 4) == 0;
      even_first += std::memcmp(&eo, &out[i], 4) == 0;
      one_rounding += std::memcmp(&once, &out[i], 4) == 0;
      ++total;
    }
  }
  std::printf("lanes %ld: odd product first %ld, even first %ld, one rounding %ld\n", total, odd_first, even_first,
              one_rounding);
}
