// Does AMX's TDPBF16PS sum a score as some AVX-512 sequence could? csrc_avx2/attend_amx.cpp's scores differ from the
// AVX-512 path's in the last bits; were TDPBF16PS's arithmetic a fixed sequence of float32 operations, one-row passes
// could compute it on AVX-512 (no tiles: no wake-up, no slower linears beside them) while verify passes run the tiles
// at any context, every row keeping its bits. One tile product (16 x 32 bfloat16 times 32 x 16, into float32, from
// zero or from a random accumulator) over random values of wide range, 512,000 outputs, against: the pairs added in
// order with a rounding after each product (even first; odd first, as a chain of VDPBF16PS on the same lanes, run
// here on this CPU; the same with rounding toward zero), each pair's exact sum rounded then added, the exact pair
// added with one rounding, pairwise trees over the 16 pair sums, and the exact sum rounded once. Counts of outputs
// whose bits differ; run it alone on a CPU with AMX-BF16.
//
//     g++ -O2 -frounding-math -o /tmp/tdpbf16ps_order experiments/tdpbf16ps_order.cpp && /tmp/tdpbf16ps_order
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

struct alignas(64) Config {
  uint8_t palette = 1, start = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static float widen(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
static bool same(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

enum { EVEN_FIRST, VDPBF16PS_CHAIN, ODD_FIRST_TOWARD_ZERO, PAIR_ROUNDED, PAIR_ONE_ROUNDING, TREE_HALVES, TREE_NEIGHBOURS,
       EXACT, MODELS };
static const char* NAMES[MODELS] = {"pairs in order, even product first",
                                    "a VDPBF16PS chain on the same lanes (odd first)",
                                    "odd first, rounding toward zero",
                                    "each pair's sum rounded, then added",
                                    "pair and accumulator, one rounding",
                                    "pair sums, a tree of halves, then added",
                                    "pair sums, a tree of neighbours, then added",
                                    "the exact sum, one rounding"};

__attribute__((target("avx512f,avx512bf16,avx512vl,amx-tile,amx-bf16"))) int main() {
  if (!__builtin_cpu_supports("amx-bf16") ||
      syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
    std::printf("no AMX-BF16 here\n");
    return 0;
  }
  Config cfg;
  for (int t = 0; t < 3; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
  std::mt19937 gen(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  long differ[2][MODELS] = {}, outputs[2] = {};
  for (int trial = 0; trial < 2000; ++trial) {
    const int from_acc = trial % 2;
    alignas(64) uint16_t A[16][32], B[16][32];
    alignas(64) float C[16][16], C0[16][16];
    const float sa = std::exp(2 * normal(gen)), sb = std::exp(2 * normal(gen));
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 32; ++j) A[i][j] = to_bf16(normal(gen) * sa), B[i][j] = to_bf16(normal(gen) * sb);
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) C0[i][j] = from_acc ? 4 * normal(gen) * sa * sb : 0.0f;
    std::memcpy(C, C0, sizeof C);
    _tile_loadd(2, C, 64);
    _tile_loadd(0, A, 64);
    _tile_loadd(1, B, 64);
    _tile_dpbf16ps(2, 0, 1);
    _tile_stored(2, C, 64);
    for (int m = 0; m < 16; ++m) {
      // the VDPBF16PS chain: lanes n = 0..15 of one register hold output (m, n); step k adds pair k
      __m512 chain = _mm512_loadu_ps(C0[m]);
      for (int k = 0; k < 16; ++k) {
        alignas(64) uint32_t a_pair[16], b_pair[16];
        for (int n = 0; n < 16; ++n) {
          a_pair[n] = uint32_t(A[m][2 * k]) | uint32_t(A[m][2 * k + 1]) << 16;
          b_pair[n] = uint32_t(B[k][2 * n]) | uint32_t(B[k][2 * n + 1]) << 16;
        }
        __m512bh a, b;
        std::memcpy(&a, a_pair, 64);
        std::memcpy(&b, b_pair, 64);
        chain = _mm512_dpbf16_ps(chain, a, b);
      }
      alignas(64) float chained[16];
      _mm512_store_ps(chained, chain);
      for (int n = 0; n < 16; ++n) {
        float even = C0[m][n], rz = C0[m][n], rounded = C0[m][n], one = C0[m][n], halves[16], neighbours[16];
        double exact = C0[m][n];
        for (int k = 0; k < 16; ++k) {
          const float a0 = widen(A[m][2 * k]), a1 = widen(A[m][2 * k + 1]);
          const float b0 = widen(B[k][2 * n]), b1 = widen(B[k][2 * n + 1]);
          even = even + a0 * b0;
          even = even + a1 * b1;
          std::fesetround(FE_TOWARDZERO);
          rz = rz + a1 * b1;
          rz = rz + a0 * b0;
          std::fesetround(FE_TONEAREST);
          const double pair = double(a0) * b0 + double(a1) * b1;  // exact: products of bfloat16 values
          rounded = rounded + float(pair);
          one = float(double(one) + pair);
          halves[k] = neighbours[k] = float(pair);
          exact += pair;
        }
        for (int w = 8; w >= 1; w /= 2)
          for (int i = 0; i < w; ++i) halves[i] = halves[i] + halves[i + w];
        for (int w = 1; w < 16; w *= 2)
          for (int i = 0; i + w < 16; i += 2 * w) neighbours[i] = neighbours[i] + neighbours[i + w];
        const float models[MODELS] = {even, chained[n], rz, rounded, one, C0[m][n] + halves[0],
                                      C0[m][n] + neighbours[0], float(exact)};
        for (int i = 0; i < MODELS; ++i) differ[from_acc][i] += !same(C[m][n], models[i]);
        ++outputs[from_acc];
      }
    }
  }
  _tile_release();
  std::printf("| model of TDPBF16PS | outputs that differ, from zero (of %ld) | from an accumulator (of %ld) |\n",
              outputs[0], outputs[1]);
  std::printf("|---|--:|--:|\n");
  for (int i = 0; i < MODELS; ++i) std::printf("| %s | %ld | %ld |\n", NAMES[i], differ[0][i], differ[1][i]);
}
