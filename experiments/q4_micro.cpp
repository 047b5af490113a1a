// How fast the q4-avx2 kernel's inner loop can go on this core, and what each part of it costs: the loop
// of csrc_avx2/q4_avx2.cpp (block_rows, 4-bit) rebuilt without torch, on random weights, one thread.
//   hot:  16 blocks of 8 columns x 576 inputs (36 KB of weights, in L2), 200 x 30 calls, best of 30
//   cold: 32,768 blocks (92 MB with scales, beyond L3), best of 9 sweeps, weights prefetched 4 KB ahead
// Variants: the kernel's loop ("default"); its sums started by a group's first line ("first line", 7 adds
// a row instead of 8); no float epilogue (integer sums only: the byte products' ceiling with the 16-bit
// adds); the products and adds alone, without the per-group widening.
//
//   g++ -O3 -mavx2 -mfma -mf16c -o /tmp/q4_micro experiments/q4_micro.cpp && /tmp/q4_micro
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

using clk = std::chrono::steady_clock;
constexpr int K = 576, G = K / 32;

inline __m256i b4(const int8_t* p) { return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p))); }

enum Variant { DEFAULT, FIRST_LINE, NO_EPILOGUE, PRODUCTS_ONLY };

template <int R, Variant V, int PF>
__attribute__((noinline)) void block(const uint8_t* qb, const uint16_t* sb, const int8_t* xq, const float* step,
                                     const float* qsum, float* y) {
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
  __m256 out[R];
  __m256i acc[R];
  for (int r = 0; r < R; ++r) out[r] = _mm256_setzero_ps(), acc[r] = _mm256_setzero_si256();
  for (int g = 0; g < G; ++g) {
    const uint8_t* qg = qb + g * 128;
    if (PF)
      for (int line = 0; line < 128; line += 64) _mm_prefetch(reinterpret_cast<const char*>(qg + PF + line), _MM_HINT_T0);
    __m256i s16[R];
    if (V != FIRST_LINE)
      for (int r = 0; r < R; ++r) s16[r] = V == PRODUCTS_ONLY ? acc[r] : _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int h = 0; h < 4; ++h) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 32 * h));
      const __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * K + g * 32 + 8 * h;
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, b4(xr)), _mm256_maddubs_epi16(hi, b4(xr + 4)));
        s16[r] = (V == FIRST_LINE && h == 0) ? p : _mm256_add_epi16(s16[r], p);
      }
    }
    if (V == DEFAULT || V == FIRST_LINE) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * 16)));
      const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * 16 + 8)));
      for (int r = 0; r < R; ++r) {
        const __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(step[r * G + g]));
        out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r], ones)), scaled, out[r]);
        out[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(qsum[r * G + g]), out[r]);
      }
    } else if (V == NO_EPILOGUE) {
      for (int r = 0; r < R; ++r) acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(s16[r], ones));
    } else {
      for (int r = 0; r < R; ++r) acc[r] = s16[r];
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(y + r * 8, V == DEFAULT || V == FIRST_LINE ? out[r] : _mm256_cvtepi32_ps(acc[r]));
}

using Fn = void (*)(const uint8_t*, const uint16_t*, const int8_t*, const float*, const float*, float*);

double run(Fn f, int R, long blocks, int calls, int reps) {
  std::vector<uint8_t> qb(blocks * G * 128);
  for (size_t i = 0; i < qb.size(); ++i) qb[i] = static_cast<uint8_t>(rand());
  std::vector<uint16_t> sb(blocks * G * 16, 0x2000);
  std::vector<int8_t> xq(8 * K);
  for (auto& b : xq) b = static_cast<int8_t>(rand() % 255 - 127);
  std::vector<float> step(8 * G, 0.01f), qsum(8 * G, 1.0f), y(64);
  double best = 1e9;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t = clk::now();
    for (int c = 0; c < calls; ++c)
      for (long b = 0; b < blocks; ++b) f(qb.data() + b * G * 128, sb.data() + b * G * 16, xq.data(), step.data(), qsum.data(), y.data());
    best = std::min(best, std::chrono::duration<double>(clk::now() - t).count());
  }
  return best;
}

template <int R, Variant V>
void row(const char* name) {
  const double hot = run(block<R, V, 0>, R, 16, 200, 30), cold = run(block<R, V, 4096>, R, 32768, 1, 9);
  const double hot_macs = 200.0 * 16 * 8 * K * R, cold_macs = 32768.0 * 8 * K * R;
  printf("| %s | %d | %.0f | %.2f | %.0f |\n", name, R, hot_macs / hot / 1e9, cold * 1e3, cold_macs / cold / 1e9);
}

int main() {
  printf("| loop | rows | hot GMAC/s | cold ms | cold GMAC/s |\n|---|--:|--:|--:|--:|\n");
  row<1, DEFAULT>("default");
  row<2, DEFAULT>("default");
  row<3, DEFAULT>("default");
  row<4, DEFAULT>("default");
  row<6, DEFAULT>("default");
  row<1, FIRST_LINE>("first line");
  row<3, FIRST_LINE>("first line");
  row<4, FIRST_LINE>("first line");
  row<4, NO_EPILOGUE>("no float epilogue");
  row<4, PRODUCTS_ONLY>("products and 16-bit adds only");
}
