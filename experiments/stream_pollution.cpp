// Does streaming the base model's weights push a draft level's weights out of the cache, and does a
// non-temporal prefetch of that stream keep them? The loop of csrc_avx2/q4_avx2.cpp (block_rows, 4-bit,
// one row) rebuilt without torch: a "verify" sweep over 94 MB of weights (beyond the 32 MB L3), then
// a "draft" sweep over 4.6 MB (a seeded draft level's fast layer, fuse and draft head), timed right
// after the big sweep; the big sweep's weights prefetched 4 KB ahead with _MM_HINT_T0 (the kernel's
// hint) or _MM_HINT_NTA, rounds alternating, medians over the rounds. One thread.
//
//   g++ -O3 -mavx2 -mfma -mf16c -o /tmp/stream_pollution experiments/stream_pollution.cpp && /tmp/stream_pollution
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

template <int HINT>
__attribute__((noinline)) void block(const uint8_t* qb, const uint16_t* sb, const int8_t* xq, const float* step,
                                     const float* qsum, float* y) {
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
  __m256 out = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    const uint8_t* qg = qb + g * 128;
    for (int line = 0; line < 128; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(qg + 4096 + line), static_cast<_mm_hint>(HINT));
    __m256i s16 = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int h = 0; h < 4; ++h) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 32 * h));
      const __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      const int8_t* xr = xq + g * 32 + 8 * h;
      s16 = _mm256_add_epi16(s16, _mm256_add_epi16(_mm256_maddubs_epi16(lo, b4(xr)), _mm256_maddubs_epi16(hi, b4(xr + 4))));
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * 16)));
    const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * 16 + 8)));
    out = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones)), _mm256_mul_ps(d, _mm256_set1_ps(step[g])), out);
    out = _mm256_fmadd_ps(mn, _mm256_set1_ps(qsum[g]), out);
  }
  _mm256_storeu_ps(y, out);
}

struct Weights {
  std::vector<uint8_t> q;
  std::vector<uint16_t> s;
  long blocks;
  explicit Weights(long n) : q(n * G * 128), s(n * G * 16, 0x2000), blocks(n) {
    for (auto& b : q) b = static_cast<uint8_t>(rand());
  }
};

template <int HINT>
double sweep(const Weights& w, const int8_t* xq, const float* step, const float* qsum, float* y) {
  const auto t = clk::now();
  for (long b = 0; b < w.blocks; ++b) block<HINT>(w.q.data() + b * G * 128, w.s.data() + b * G * 16, xq, step, qsum, y);
  return std::chrono::duration<double>(clk::now() - t).count() * 1e3;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main() {
  Weights big(32768), small(1600);  // 94 MB; 4.6 MB
  std::vector<int8_t> xq(K);
  for (auto& b : xq) b = static_cast<int8_t>(rand() % 255 - 127);
  std::vector<float> step(G, 0.01f), qsum(G, 1.0f), y(8);
  std::vector<double> big_t0, big_nta, after_t0, after_nta, hot;
  for (int round = 0; round < 15; ++round) {
    big_t0.push_back(sweep<_MM_HINT_T0>(big, xq.data(), step.data(), qsum.data(), y.data()));
    after_t0.push_back(sweep<_MM_HINT_T0>(small, xq.data(), step.data(), qsum.data(), y.data()));
    hot.push_back(sweep<_MM_HINT_T0>(small, xq.data(), step.data(), qsum.data(), y.data()));
    big_nta.push_back(sweep<_MM_HINT_NTA>(big, xq.data(), step.data(), qsum.data(), y.data()));
    after_nta.push_back(sweep<_MM_HINT_T0>(small, xq.data(), step.data(), qsum.data(), y.data()));
  }
  printf("| big sweep's prefetch | big sweep (94 MB) ms | small sweep (4.6 MB) right after, ms |\n|---|--:|--:|\n");
  printf("| T0 (the kernel's) | %.2f | %.3f |\n", median(big_t0), median(after_t0));
  printf("| NTA | %.2f | %.3f |\n", median(big_nta), median(after_nta));
  printf("small sweep again, hot: %.3f ms\n", median(hot));
}
