// How fast the q4-avx2 kernel's inner loop can go on this core, and what each part of it costs: the loop
// of csrc_avx2/q4_avx2.cpp (block_rows, 4-bit) rebuilt without torch, on random weights, one thread.
//   hot:  16 blocks of 8 columns x 576 inputs (36 KB of weights, in L2), 200 calls, best of ROUNDS
//   cold: 32,768 blocks (92 MB with scales, beyond L3), best of ROUNDS / 3 sweeps, prefetched 4 KB ahead
// Every variant runs once per round (this VM's speed drifts for seconds at a time). Variants: the kernel's
// loop ("default"); its sums started by a group's first line ("first line", 7 adds a row instead of 8);
// each group's 16-bit pair sums widened by shifts instead of a multiply ("shift widen": the multiply port
// freed, same sums); two adjacent blocks at once ("pair": 16 columns, each broadcast input serving twice
// the columns, same bits); no float epilogue (integer sums only); the products and adds alone. With VNNI,
// the loop on VPDPBUSD ("vnni"), over a pair of blocks in two 256-bit sums a row ("vnni pair") or in one
// 512-bit sum a row ("vnni zmm": two blocks G * 128 bytes apart; "vnni zmm mixed": the pair's groups
// interleaved in memory, the layout csrc_avx2/q4_rows.h reads since the twenty-sixth round). The pair loops
// are checked against the vnni loop's bits first.
//
//   g++ -O3 -mavx2 -mfma -mf16c -o /tmp/q4_micro experiments/q4_micro.cpp && /tmp/q4_micro [ROUNDS]
// On a CPU with AVX512-VNNI add -mavx512f -mavx512vl -mavx512bw -mavx512dq -mavx512vnni for the "vnni"
// variants: VPDPBUSD adds four byte products straight into a 32-bit lane (the same integer sums: no 16-bit
// adds, no widening).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using clk = std::chrono::steady_clock;
constexpr int K = 576, G = K / 32;

inline __m256i b4(const int8_t* p) { return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p))); }

enum Variant { DEFAULT, FIRST_LINE, NO_EPILOGUE, PRODUCTS_ONLY, SHIFT_WIDEN, VNNI };

// a 16-bit pair's sum as a 32-bit lane without a multiply: (s << 16 >> 16) + (s >> 16), arithmetic shifts
inline __m256i widen_pairs(__m256i s) {
  return _mm256_add_epi32(_mm256_srai_epi32(_mm256_slli_epi32(s, 16), 16), _mm256_srai_epi32(s, 16));
}

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
#ifdef __AVX512VNNI__
        if constexpr (V == VNNI) {  // 32-bit sums straight from 4 byte products a lane: the same integers
          s16[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s16[r], lo, b4(xr)), hi, b4(xr + 4));
          continue;
        }
#endif
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, b4(xr)), _mm256_maddubs_epi16(hi, b4(xr + 4)));
        s16[r] = (V == FIRST_LINE && h == 0) ? p : _mm256_add_epi16(s16[r], p);
      }
    }
    if (V == DEFAULT || V == FIRST_LINE || V == SHIFT_WIDEN || V == VNNI) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * 16)));
      const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * 16 + 8)));
      for (int r = 0; r < R; ++r) {
        const __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(step[r * G + g]));
        const __m256i wide = V == VNNI          ? s16[r]
                             : V == SHIFT_WIDEN ? widen_pairs(s16[r])
                                                : _mm256_madd_epi16(s16[r], ones);
        out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), scaled, out[r]);
        out[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(qsum[r * G + g]), out[r]);
      }
    } else if (V == NO_EPILOGUE) {
      for (int r = 0; r < R; ++r) acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(s16[r], ones));
    } else {
      for (int r = 0; r < R; ++r) acc[r] = s16[r];
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(y + r * 8, V == DEFAULT || V == FIRST_LINE || V == SHIFT_WIDEN || V == VNNI
                                    ? out[r]
                                    : _mm256_cvtepi32_ps(acc[r]));
}


// "pair": two adjacent blocks (16 columns) at once, each column's sums and float terms in the default
// order (same bits): every broadcast input and every row's loop serves twice the columns. VNNI ("vnni pair"):
// the sums by VPDPBUSD, as the vnni loop (AVX-512VL's 32 registers hold 4 rows' two sums and outputs).
template <int R, int PF, bool VNNI_SUMS = false>
__attribute__((noinline)) void block_pair(const uint8_t* qb, const uint16_t* sb, const int8_t* xq, const float* step,
                                          const float* qsum, float* y) {
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
  const uint8_t* qb2 = qb + G * 128;
  const uint16_t* sb2 = sb + G * 16;
  __m256 out[R][2];
  for (int r = 0; r < R; ++r) out[r][0] = out[r][1] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    const uint8_t *qg = qb + g * 128, *qg2 = qb2 + g * 128;
    if (PF)
      for (int line = 0; line < 128; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(qg + PF + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(qg2 + PF + line), _MM_HINT_T0);
      }
    __m256i s16[R][2];
    for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int h = 0; h < 4; ++h) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 32 * h));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg2 + 32 * h));
      const __m256i lo0 = _mm256_and_si256(b0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(b0, 4), low4);
      const __m256i lo1 = _mm256_and_si256(b1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(b1, 4), low4);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * K + g * 32 + 8 * h;
        const __m256i xa = b4(xr), xb = b4(xr + 4);
#ifdef __AVX512VNNI__
        if constexpr (VNNI_SUMS) {  // 32-bit sums (s16 holds them here)
          s16[r][0] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s16[r][0], lo0, xa), hi0, xb);
          s16[r][1] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s16[r][1], lo1, xa), hi1, xb);
          continue;
        }
#endif
        s16[r][0] = _mm256_add_epi16(s16[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xa), _mm256_maddubs_epi16(hi0, xb)));
        s16[r][1] = _mm256_add_epi16(s16[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xa), _mm256_maddubs_epi16(hi1, xb)));
      }
    }
    for (int c = 0; c < 2; ++c) {
      const uint16_t* s = (c ? sb2 : sb) + g * 16;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
      const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 8)));
      for (int r = 0; r < R; ++r) {
        const __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(step[r * G + g]));
        const __m256i wide = VNNI_SUMS ? s16[r][c] : _mm256_madd_epi16(s16[r][c], ones);
        out[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), scaled, out[r][c]);
        out[r][c] = _mm256_fmadd_ps(mn, _mm256_set1_ps(qsum[r * G + g]), out[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c) _mm256_storeu_ps(y + r * 16 + 8 * c, out[r][c]);
}

#ifdef __AVX512VNNI__
// "vnni zmm": the same two blocks in one 512-bit register a row (Zen 4 runs a 512-bit op as two 256-bit
// halves: the same multiply-adds in half the instructions); each lane's operations are the ymm loop's.
template <int R, int PF, int MIXED = 0>
__attribute__((noinline)) void block_vnni_zmm(const uint8_t* qb, const uint16_t* sb, const int8_t* xq,
                                              const float* step, const float* qsum, float* y) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // MIXED: the two blocks' groups interleaved (group g of block 1 right after group g of block 0), one stream
  constexpr int64_t gq = MIXED ? 256 : 128, gs = MIXED ? 32 : 16;
  const uint8_t* qb2 = MIXED ? qb + 128 : qb + G * 128;
  const uint16_t* sb2 = MIXED ? sb + 16 : sb + G * 16;
  __m512 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    const uint8_t *qg = qb + g * gq, *qg2 = qb2 + g * gq;
    if (PF)
      for (int line = 0; line < 128; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(qg + PF + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(qg2 + PF + line), _MM_HINT_T0);
      }
    __m512i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int h = 0; h < 4; ++h) {
      const __m512i bytes = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 32 * h))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg2 + 32 * h)), 1);
      const __m512i lo = _mm512_and_si512(bytes, low4), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * K + g * 32 + 8 * h;
        const __m512i xa = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr));
        const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 4));
        s[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[r], lo, xa), hi, xb);
      }
    }
    const __m512 d = _mm512_insertf32x8(
        _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * gs)))),
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb2 + g * gs))), 1);
    const __m512 mn = _mm512_insertf32x8(
        _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * gs + 8)))),
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb2 + g * gs + 8))), 1);
    for (int r = 0; r < R; ++r) {
      const __m512 scaled = _mm512_mul_ps(d, _mm512_set1_ps(step[r * G + g]));
      out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), scaled, out[r]);
      out[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(qsum[r * G + g]), out[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * 16, out[r]);
}
#endif

using Fn = void (*)(const uint8_t*, const uint16_t*, const int8_t*, const float*, const float*, float*);

double run(Fn f, int R, long blocks, int calls, int reps, int per_call = 1) {
  std::vector<uint8_t> qb(blocks * G * 128);
  for (size_t i = 0; i < qb.size(); ++i) qb[i] = static_cast<uint8_t>(rand());
  std::vector<uint16_t> sb(blocks * G * 16, 0x2000);
  std::vector<int8_t> xq(8 * K);
  for (auto& b : xq) b = static_cast<int8_t>(rand() % 255 - 127);
  std::vector<float> step(8 * G, 0.01f), qsum(8 * G, 1.0f), y(128);
  double best = 1e9;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t = clk::now();
    for (int c = 0; c < calls; ++c)
      for (long b = 0; b < blocks; b += per_call) f(qb.data() + b * G * 128, sb.data() + b * G * 16, xq.data(), step.data(), qsum.data(), y.data());
    best = std::min(best, std::chrono::duration<double>(clk::now() - t).count());
  }
  return best;
}

struct Entry {
  const char* name;
  int rows, per_call;
  Fn hot, cold;
  double best_hot = 1e9, best_cold = 1e9;
};

template <int R, Variant V>
Entry variant(const char* name) {
  return {name, R, 1, block<R, V, 0>, block<R, V, 4096>};
}
template <int R>
Entry pair(const char* name) {
  return {name, R, 2, block_pair<R, 0>, block_pair<R, 4096>};
}
#ifdef __AVX512VNNI__
template <int R>
Entry vnni_pair(const char* name) {
  return {name, R, 2, block_pair<R, 0, true>, block_pair<R, 4096, true>};
}
template <int R, int PF = 4096, int MIXED = 0>
Entry vnni_zmm(const char* name) {
  return {name, R, 2, block_vnni_zmm<R, 0, MIXED>, block_vnni_zmm<R, PF, MIXED>};
}
#endif

#ifdef __AVX512VNNI__
// The pair and zmm loops must give each column the vnni loop's bits: two blocks of random weights, rows and
// steps, compared bit for bit (returns the number of differing outputs).
template <int R>
int differing() {
  std::vector<uint8_t> qb(2 * G * 128);
  for (auto& b : qb) b = static_cast<uint8_t>(rand());
  std::vector<uint16_t> sb(2 * G * 16);
  for (auto& h : sb) h = static_cast<uint16_t>(0x2000 + rand() % 0x1000);  // positive halves of varied size
  std::vector<int8_t> xq(8 * K);
  for (auto& b : xq) b = static_cast<int8_t>(rand() % 255 - 127);
  std::vector<float> step(8 * G), qsum(8 * G);
  for (auto& f : step) f = 0.001f * (1 + rand() % 100);
  for (auto& f : qsum) f = 0.01f * (rand() % 200 - 100);
  std::vector<float> one(R * 8), ref(R * 16), pair(R * 16), zmm(R * 16);
  for (int c = 0; c < 2; ++c) {
    block<R, VNNI, 0>(qb.data() + c * G * 128, sb.data() + c * G * 16, xq.data(), step.data(), qsum.data(), one.data());
    for (int r = 0; r < R; ++r) std::copy(one.begin() + r * 8, one.begin() + r * 8 + 8, ref.begin() + r * 16 + 8 * c);
  }
  block_pair<R, 0, true>(qb.data(), sb.data(), xq.data(), step.data(), qsum.data(), pair.data());
  block_vnni_zmm<R, 0>(qb.data(), sb.data(), xq.data(), step.data(), qsum.data(), zmm.data());
  int bad = 0;
  for (int i = 0; i < R * 16; ++i)
    bad += (std::memcmp(&ref[i], &pair[i], 4) != 0) + (std::memcmp(&ref[i], &zmm[i], 4) != 0);
  return bad;
}
#endif

// Every variant once per round, best of many rounds: this VM's speed drifts for seconds at a time, so
// variants timed one after another differ by more than the loops do; interleaved, they see the same drift.
int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 30;
  std::vector<Entry> all = {
      variant<1, DEFAULT>("default"),        variant<2, DEFAULT>("default"),
      variant<3, DEFAULT>("default"),        variant<4, DEFAULT>("default"),
      variant<1, FIRST_LINE>("first line"),  variant<3, FIRST_LINE>("first line"),
      variant<1, SHIFT_WIDEN>("shift widen"), variant<2, SHIFT_WIDEN>("shift widen"),
      variant<3, SHIFT_WIDEN>("shift widen"), variant<4, SHIFT_WIDEN>("shift widen"),
      pair<1>("pair"),                       pair<2>("pair"),
      pair<3>("pair"),                       pair<4>("pair"),
      variant<4, NO_EPILOGUE>("no float epilogue"), variant<4, PRODUCTS_ONLY>("products and 16-bit adds only"),
#ifdef __AVX512VNNI__
      variant<1, VNNI>("vnni"),              variant<2, VNNI>("vnni"),
      variant<3, VNNI>("vnni"),              variant<4, VNNI>("vnni"),
      variant<6, VNNI>("vnni"),              variant<8, VNNI>("vnni"),  // AVX-512's 32 registers hold 8 rows
      vnni_pair<1>("vnni pair"),             vnni_pair<2>("vnni pair"),
      vnni_pair<3>("vnni pair"),             vnni_pair<4>("vnni pair"),
      vnni_zmm<1>("vnni zmm"),               vnni_zmm<2>("vnni zmm"),
      vnni_zmm<3>("vnni zmm"),               vnni_zmm<4>("vnni zmm"),
      vnni_zmm<6>("vnni zmm"),               vnni_zmm<8>("vnni zmm"),
      vnni_zmm<1, 4096, 1>("vnni zmm mixed"), vnni_zmm<2, 4096, 1>("vnni zmm mixed"),
      vnni_zmm<3, 4096, 1>("vnni zmm mixed"), vnni_zmm<4, 4096, 1>("vnni zmm mixed"),
      vnni_zmm<6, 4096, 1>("vnni zmm mixed"), vnni_zmm<8, 4096, 1>("vnni zmm mixed"),
#endif
  };
#ifdef __AVX512VNNI__
  const int bad = differing<1>() + differing<2>() + differing<3>() + differing<4>();
  printf("vnni pair / vnni zmm outputs differing from the vnni loop's bits: %d\n", bad);
#endif
  for (int rep = 0; rep < rounds; ++rep)
    for (auto& e : all) {
      e.best_hot = std::min(e.best_hot, run(e.hot, e.rows, 16, 200, 1, e.per_call));
      if (rep % 3 == 0) e.best_cold = std::min(e.best_cold, run(e.cold, e.rows, 32768, 1, 1, e.per_call));
    }
  printf("| loop | rows | hot GMAC/s | cold ms | cold GMAC/s |\n|---|--:|--:|--:|--:|\n");
  for (auto& e : all) {
    const double hot_macs = 200.0 * 16 * 8 * K * e.rows, cold_macs = 32768.0 * 8 * K * e.rows;
    printf("| %s | %d | %.0f | %.2f | %.0f |\n", e.name, e.rows, hot_macs / e.best_hot / 1e9, e.best_cold * 1e3,
           cold_macs / e.best_cold / 1e9);
  }
}
