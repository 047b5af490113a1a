// A prefill's linear layers on AMX-BF16 tiles (Intel Sapphire Rapids and later): the fused blocks (block_avx2.cpp)
// take this path for passes of more than PREFILL_MIN_ROWS - 1 rows, which only prompts send (m2r2.model's
// ROW_INVARIANT_MAX_ROWS: a verify pass is never that long).
//
// Why: every other loop rounds a row's inputs to int8 per group of 32 and pays, per row, group and 16 columns, the
// group's float terms (the weight's scale and minimum times the row's step and sum) after the integer sums. On AMX
// INT8 tiles that is a tile product, a tile store and ~5 vector operations per row for every group of 32 inputs
// (q4_amx_rows.cpp): a 71-token SmolLM2 prompt took ~29 ms, 0.41 ms a token, against ~2.5 ms for a whole decoding
// step, and its prefill was 8-19% of `vanilla`'s time on the paper's datasets (short answers weigh it most). Here a
// pair of blocks' weights (16 columns) is widened once per pass to bfloat16 (w = d q + m in float32, rounded to
// nearest even: the 4-bit values and their fp16 terms fit float32 exactly), and each tile of 16 rows then sums all K
// inputs on the tiles with no per-group work: one TDPBF16PS per 16 rows, 16 columns and 32 inputs (2 threads: a
// 71-token prompt 29 -> 22 ms, a 300-token one 131 -> 85 ms; experiments/prefill_sizes.py, BENCHMARKS.md "Forty-fifth
// round").
//
// The bits differ from the int8 loops' (inputs in bfloat16, not int8 per group; weights rounded to bfloat16), as a
// prefill's attention already did (it attends only the filled slots). Every method prefills the same way, so
// outputs stay identical across methods; each row's sums depend on its own inputs only (a tile's rows are
// independent), so a row gets the same bits whatever the prompt's length or split. The attention keeps its path: on
// the AMX attention a prompt's bits would depend on its cache's dtype (the server's pooled caches are float32, which
// that path does not take; tried, BENCHMARKS.md). M2R2_NO_BF16_PREFILL=1 or set_bf16_prefill(false) keeps the int8
// loops.
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "kernels2.h"
#include "simd2.h"

#define M2R2_AMX_BF16_BUILD M2R2_AMX_COMPILER  // kernels2.h: an older compiler builds the rest without the tiles

#if M2R2_AMX_BF16_BUILD
#pragma GCC push_options  // the wider instruction set for the tile code only, not for what an AVX2 CPU runs at load
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni,avx512bf16,amx-tile,amx-bf16")
#define M2R2_VNNI 1
#include "q4_rows.h"  // the packed layout's helpers: NB, pair_bytes, pair_terms16, store16_bf16
#endif

namespace {

#if M2R2_AMX_BF16_BUILD
constexpr int MR = 16;  // rows per tile

// tiles 0-3: C, 16 rows x 16 float32 sums each; 4, 5: A, 16 rows x 32 bfloat16 inputs; 6, 7: B, 16 rows x 64
// bytes, 32 inputs x 16 columns in pairs (row k: each column's weights of inputs 2k, 2k+1)
inline void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = MR;
  const TileConfig now = m2r2_avx2::tiles_now();
  if (std::memcmp(&cfg, &now, sizeof(cfg)) != 0) m2r2_avx2::load_tiles(cfg);
}

// float32 even / odd inputs' weights of 16 columns -> one B row: column n's bfloat16 pair at bytes 4n..4n+3
// (interleave: word 2n from even's n, 2n + 1 from odd's n, as pair_order() gives it)
inline void store_pair_row(__m512 even, __m512 odd, __m512i interleave, uint16_t* row) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // even in words 0-15, odd in 16-31
  _mm512_store_si512(row, _mm512_permutexvar_epi16(interleave, both));
}
inline __m512i pair_order() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                          18, 2, 17, 1, 16, 0);
}

// A pair of blocks' weights (q4_rows.h: group g of the second block after the first's) as bfloat16 B tiles, one of
// 16 x 64 bytes per group of 32 inputs, into panel (G * 512 halves)
template <int BITS>
void widen_pair(const uint8_t* qb, const at::Half* sb, int64_t G, uint16_t* panel) {
  constexpr int64_t gbytes = BITS == 4 ? 128 : 256, terms = BITS == 4 ? 2 : 1;
  const __m512i order = pair_order(), low4 = _mm512_set1_epi32(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* qg = qb + g * 2 * gbytes;
    const at::Half* s = sb + g * 2 * terms * NB;
    uint16_t* tile = panel + g * 512;
    const __m512 d = pair_terms16(s, 0, terms * NB);
    if constexpr (BITS == 4) {
      // 32-bit lane n (column n) of chunk h, byte j: low nibble input 8h + j, high nibble input 8h + 4 + j; B row
      // 4h + k holds inputs 8h + 2k, 8h + 2k + 1: nibbles at bits 8 * 2k, 8 * (2k + 1) (k < 2), plus 4 after
      const __m512 mn = pair_terms16(s, NB, 3 * NB);
      const auto weight = [&](__m512i bytes, int shift) {
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(bytes, shift), low4)), d, mn);
      };
      for (int h = 0; h < 4; ++h) {
        const __m512i bytes = pair_bytes(qg, gbytes, 32 * h);
        for (int k = 0; k < 4; ++k) {
          const int shift = 16 * (k % 2) + 4 * (k / 2);
          store_pair_row(weight(bytes, shift), weight(bytes, shift + 8), order, tile + (4 * h + k) * 32);
        }
      }
    } else {
      // 32-bit lane n of chunk j: signed bytes, inputs 4j + 0..3; B rows 2j, 2j + 1
      const auto weight = [&](__m512i bytes, int i) {
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(bytes, 24 - 8 * i), 24)), d);
      };
      for (int j = 0; j < 8; ++j) {
        const __m512i bytes = pair_bytes(qg, gbytes, 32 * j);
        store_pair_row(weight(bytes, 0), weight(bytes, 1), order, tile + (2 * j) * 32);
        store_pair_row(weight(bytes, 2), weight(bytes, 3), order, tile + (2 * j + 1) * 32);
      }
    }
  }
}

// Two tiles of rows (a0, a1: 16 rows each, astride bytes apart) times two pairs' B tiles (p0, p1: G tiles each) into
// C tiles 0 (a0 p0), 1 (a0 p1), 2 (a1 p0), 3 (a1 p1), every group of 32 inputs in turn; RT / CT: how many of each are
// real. Each A and B tile loaded serves two products, and the four sums are independent (the products overlap).
template <int RT, int CT>
inline void product_tiles(const uint16_t* a0, const uint16_t* a1, int64_t astride, const uint16_t* p0,
                          const uint16_t* p1, int64_t G) {
  _tile_zero(0);
  if (CT > 1) _tile_zero(1);
  if (RT > 1) _tile_zero(2);
  if (RT > 1 && CT > 1) _tile_zero(3);
  for (int64_t g = 0; g < G; ++g) {
    _tile_loadd(4, a0 + g * 32, astride);
    _tile_loadd(6, p0 + g * 512, 64);
    if (CT > 1) _tile_loadd(7, p1 + g * 512, 64);
    if (RT > 1) _tile_loadd(5, a1 + g * 32, astride);
    _tile_dpbf16ps(0, 4, 6);
    if (CT > 1) _tile_dpbf16ps(1, 4, 7);
    if (RT > 1) _tile_dpbf16ps(2, 5, 6);
    if (RT > 1 && CT > 1) _tile_dpbf16ps(3, 5, 7);
  }
}

// C tile t's rows r0.. (at most `rows` real) as bfloat16 into y's 16 columns at col (row stride N)
inline void store_tile(int t, float* c, uint16_t* y, int64_t N, int64_t r0, int64_t rows, int64_t col) {
  switch (t) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
  }
  for (int64_t r = 0; r < rows; ++r) store16_bf16(y + (r0 + r) * N + col, _mm512_load_ps(c + r * 16));
}

// Pairs of blocks widened at a time: up to ~256 KB of B tiles, which stay in L2 while every 32 rows pass over them
constexpr int64_t PANEL_BYTES = 256 << 10;

template <int BITS>
void pairs_bf16(const uint8_t* qp, const at::Half* sp, const uint16_t* x, int64_t M, int64_t K, int64_t blocks,
                uint16_t* yp, int64_t b0, int64_t b1) {
  constexpr int64_t terms = BITS == 4 ? 2 : 1, gbytes = BITS == 4 ? 128 : 256;
  const int64_t N = blocks * NB, G = K / 32, block_bytes = G * gbytes, block_halves = G * terms * NB;
  const int64_t chunk = std::max<int64_t>(2, PANEL_BYTES / (G * 1024) / 2 * 2);  // pairs widened at a time (even)
  thread_local m2r2_avx2::Scratch<uint16_t> panel_buf, tail_buf;
  panel_buf.fit(chunk * G * 512 + 32);
  uint16_t* panel = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(panel_buf.data()) + 63) & ~uintptr_t{63});
  // the last tile's rows past M read zeros: a copy of the partial tile, padded
  const int64_t whole = M / MR * MR, rest = M - whole;
  if (rest) {
    tail_buf.fit(MR * K);
    std::memcpy(tail_buf.data(), x + whole * K, rest * K * 2);
    std::memset(tail_buf.data() + rest * K, 0, (MR - rest) * K * 2);
  }
  const auto rows_at = [&](int64_t m) { return m < whole ? x + m * K : tail_buf.data(); };
  const int64_t tiles = (M + MR - 1) / MR;
  configure();
  alignas(64) float c[MR * 16];
  for (int64_t q0 = b0 / 2; q0 < b1 / 2; q0 += chunk) {  // pairs [q0, q1) widened, then every row over them
    const int64_t q1 = std::min(b1 / 2, q0 + chunk);
    for (int64_t q = q0; q < q1; ++q)
      widen_pair<BITS>(qp + 2 * q * block_bytes, sp + 2 * q * block_halves, G, panel + (q - q0) * G * 512);
    for (int64_t t = 0; t < tiles; t += 2) {
      const bool two_rows = t + 1 < tiles;
      const uint16_t *a0 = rows_at(t * MR), *a1 = rows_at(two_rows ? (t + 1) * MR : t * MR);
      const int64_t rows0 = std::min<int64_t>(MR, M - t * MR), rows1 = two_rows ? std::min<int64_t>(MR, M - (t + 1) * MR) : 0;
      for (int64_t q = q0; q < q1; q += 2) {
        const bool two_cols = q + 1 < q1;
        const uint16_t *p0 = panel + (q - q0) * G * 512, *p1 = two_cols ? p0 + G * 512 : p0;
        if (two_rows && two_cols)
          product_tiles<2, 2>(a0, a1, K * 2, p0, p1, G);
        else if (two_rows)
          product_tiles<2, 1>(a0, a1, K * 2, p0, p1, G);
        else if (two_cols)
          product_tiles<1, 2>(a0, a1, K * 2, p0, p1, G);
        else
          product_tiles<1, 1>(a0, a1, K * 2, p0, p1, G);
        store_tile(0, c, yp, N, t * MR, rows0, 2 * q * NB);
        if (two_cols) store_tile(1, c, yp, N, t * MR, rows0, 2 * (q + 1) * NB);
        if (two_rows) store_tile(2, c, yp, N, (t + 1) * MR, rows1, 2 * q * NB);
        if (two_rows && two_cols) store_tile(3, c, yp, N, (t + 1) * MR, rows1, 2 * (q + 1) * NB);
      }
    }
  }
}

}  // namespace

namespace m2r2_avx2 {
void block_range_bf16(int bits, const uint8_t* qbytes, const at::Half* scales, const uint16_t* x, int64_t M, int64_t K,
                      int64_t blocks, uint16_t* y, int64_t b0, int64_t b1) {
  if (bits == 4)
    pairs_bf16<4>(qbytes, scales, x, M, K, blocks, y, b0, b1);
  else
    pairs_bf16<8>(qbytes, scales, x, M, K, blocks, y, b0, b1);
}
}  // namespace m2r2_avx2
#pragma GCC pop_options

namespace {
bool cpu_has_amx_bf16() {
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") && m2r2_avx2::amx_granted(22);
}
#else
bool cpu_has_amx_bf16() { return false; }
#endif

const bool bf16_here = cpu_has_amx_bf16();
std::atomic<bool> bf16_on{bf16_here && !m2r2_avx2::turned_off("M2R2_NO_BF16_PREFILL")};

}  // namespace

namespace m2r2_avx2 {
bool bf16_prefill_in_use() { return bf16_on.load(std::memory_order_relaxed); }
bool set_bf16_prefill(bool on) { return bf16_on.exchange(on && bf16_here); }
#if !M2R2_AMX_BF16_BUILD  // never called: bf16_prefill_in_use() is false without the tiles
void block_range_bf16(int, const uint8_t*, const at::Half*, const uint16_t*, int64_t, int64_t, int64_t, uint16_t*,
                      int64_t, int64_t) {}
#endif
}  // namespace m2r2_avx2
