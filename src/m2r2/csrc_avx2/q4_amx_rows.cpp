// The q4-avx2 kernel's integer sums on AMX tiles (Intel Sapphire Rapids and later), chosen at run time by
// linear_rows (q4_avx2.cpp) for passes of amx_min_rows() rows or more (10); fewer rows keep the VNNI loop.
//
// Why: per row, group of 32 inputs and pair of blocks (16 columns) the VNNI loop (q4_rows.h, pair_rows) spends
// 8 VPDPBUSD and 8 input broadcasts before its float terms, so a row costs its multiply-adds. AMX's TDPBSSD sums a
// group's 32 byte products for up to 16 rows x 16 columns in one instruction, leaving a row only its float terms
// (the same on either path). But the scales come per group of 32 inputs, so every group needs its own tile
// product and tile store, whatever the rows: on a 2-vCPU Sapphire Rapids class Xeon that fixed cost is what the
// VNNI loop spends on 8-10 rows. Passes of fewer rows (verify passes) keep the VNNI loop; from 10 rows on
// (prefills, large trees) the tiles run a row's linears in 0.75-0.85 of the time (experiments/amx_rows_ab.py).
//
// Same integers, same bits: TDPBSSD multiplies signed bytes by signed bytes into 32-bit sums without
// saturation (at most 32 x 127 x 127 per group here). The weights are signed bytes on both paths (4-bit
// nibbles 0..15, 8-bit -127..127) and the inputs are quantize_groups' signed int8, not the VNNI 8-bit loop's
// x + 128 (linear_rows skips that offset for this path), so every group's integer sums equal the VNNI loop's,
// and its float terms then run lane by lane in pair_rows' order: a row gets the same bits on either path, and
// so for any number of rows (tested).
//
// Tiles, per group of 32 inputs and pair of blocks: A = R rows x 32 int8 inputs, loaded straight from the
// quantized rows (stride K); B = 8 rows x 64 bytes, the VNNI form of 32 inputs x 16 columns: B row k holds
// each column's 4 weights of inputs 4k..4k+3, which is what pair_rows feeds VPDPBUSD (4-bit: row 2h the low
// nibbles of the pair's bytes 32h.., row 2h+1 the high ones; 8-bit: row j the pair's bytes 32j..), copied from
// the two interleaved blocks into a buffer; C = R rows x 16 int32 sums, stored for the float terms. Groups run
// 16 at a time in phases (all staged, then all tile products two at a time on tiles 0-2 and 3-5, then all float
// terms): a first version that ran each group's three steps back to back waited on each hand-over and cost
// twice the VNNI loop at 2-4 rows.
#include <immintrin.h>
#include <torch/extension.h>

#include <atomic>
#include <cstring>

#include "kernels2.h"
#include "simd2.h"

#define M2R2_AMX_BUILD M2R2_AMX_COMPILER  // kernels2.h: an older compiler builds the rest without the tiles

#if M2R2_AMX_BUILD
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")
#define M2R2_VNNI 1
#include "q4_rows.h"
#endif

namespace {
#if M2R2_AMX_BUILD

constexpr int MR = 16;        // rows per tile
constexpr int64_t CHUNK = 16;  // groups of 32 inputs staged at a time (8 KB of weights, up to 16 KB of sums)

// tiles 0 and 3: R rows x 32 inputs; 1 and 4: 8 x 64 weight bytes; 2 and 5: R rows x 16 int32 sums
inline void configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 6; t += 3) {
    cfg.colsb[t] = 32, cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t + 1] = 64, cfg.rows[t + 1] = 8;
    cfg.colsb[t + 2] = 64, cfg.rows[t + 2] = static_cast<uint8_t>(rows);
  }
  load_tiles(cfg);
}

// One group's weights for a pair of blocks (q4_rows.h: group g of the second block follows the first's) into
// B's VNNI form: 8 rows of 64 bytes.
template <int BITS>
inline void stage_group(const uint8_t* qg, int8_t* b) {
  constexpr int64_t gbytes = BITS == 4 ? 128 : 256;
  for (int64_t line = 0; line < 2 * gbytes; line += 64) prefetch(qg + line);
  if constexpr (BITS == 4) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int h = 0; h < 4; ++h) {
      const __m512i bytes = pair_bytes(qg, gbytes, 32 * h);
      _mm512_store_si512(b + 128 * h, _mm512_and_si512(bytes, low4));
      _mm512_store_si512(b + 128 * h + 64, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4));
    }
  } else {
    for (int j = 0; j < 8; ++j) _mm512_store_si512(b + 64 * j, pair_bytes(qg, gbytes, 32 * j));
  }
}

// A pair of blocks (16 columns) for R rows: pair_rows (q4_rows.h) with its integer sums from the tiles.
template <int BITS, int R>
inline void pair_rows_amx(const uint8_t* qb, const at::Half* sb, const int8_t* xq, const float* step,
                          const float* qsum, int64_t K, int64_t G, uint16_t* y, int64_t N) {
  constexpr int64_t gbytes = BITS == 4 ? 128 : 256, terms = BITS == 4 ? 2 : 1;
  alignas(64) int8_t wb[CHUNK][512];
  alignas(64) int32_t cs[CHUNK][R * 16];
  __m512 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm512_setzero_ps();
  // CHUNK groups at a time in three phases: their weights into B form, then every tile product (a run of
  // independent tile operations, two groups in flight), then the float terms in group order. Phase by phase,
  // no step waits on the one just before it (stores into tile loads, tile stores into vector loads).
  for (int64_t g0 = 0; g0 < G; g0 += CHUNK) {
    const int64_t n = G - g0 < CHUNK ? G - g0 : CHUNK;
    for (int64_t i = 0; i < n; ++i) stage_group<BITS>(qb + (g0 + i) * 2 * gbytes, wb[i]);
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) {
      _tile_loadd(1, wb[i], 64);
      _tile_loadd(0, xq + (g0 + i) * 32, K);
      _tile_zero(2);
      _tile_loadd(4, wb[i + 1], 64);
      _tile_loadd(3, xq + (g0 + i + 1) * 32, K);
      _tile_zero(5);
      _tile_dpbssd(2, 0, 1);
      _tile_dpbssd(5, 3, 4);
      _tile_stored(2, cs[i], 64);
      _tile_stored(5, cs[i + 1], 64);
    }
    if (i < n) {
      _tile_loadd(1, wb[i], 64);
      _tile_loadd(0, xq + (g0 + i) * 32, K);
      _tile_zero(2);
      _tile_dpbssd(2, 0, 1);
      _tile_stored(2, cs[i], 64);
    }
    for (i = 0; i < n; ++i) {  // pair_rows' float terms (q4_rows.h), the sums from the stored tile
      const int32_t* c = cs[i];
      pair_terms<BITS, R>(out, [c](int r) { return _mm512_load_si512(c + 16 * r); }, sb + (g0 + i) * 2 * terms * NB,
                          step, qsum, G, g0 + i);
    }
  }
  for (int r = 0; r < R; ++r) store16_bf16(y + r * N, out[r]);
}

template <int BITS>
void pairs_amx(const uint8_t* qp, const at::Half* sp, const int8_t* xq, const float* step, const float* qsum,
               int64_t M, int64_t K, int64_t blocks, uint16_t* yp, int64_t b0, int64_t b1) {
  constexpr int64_t terms = BITS == 4 ? 2 : 1, gbytes = BITS == 4 ? 128 : 256;
  const int64_t N = blocks * NB, G = K / 32, block_bytes = G * gbytes, block_halves = G * terms * NB;
  for (int64_t m0 = 0; m0 < M; m0 += MR) {
    const int rows = static_cast<int>(M - m0 < MR ? M - m0 : MR);
    configure(rows);
    const int8_t* xr = xq + m0 * K;
    const float *st = step + m0 * G, *qs = qsum + m0 * G;
    for (int64_t b = b0; b < b1; b += 2) {
      const uint8_t* qb = qp + b * block_bytes;
      const at::Half* sb = sp + b * block_halves;
      uint16_t* y = yp + m0 * N + b * NB;
      switch (rows) {
#define M2R2_AMX_CASE(R) \
  case R: pair_rows_amx<BITS, R>(qb, sb, xr, st, qs, K, G, y, N); break;
        M2R2_AMX_CASE(16) M2R2_AMX_CASE(15) M2R2_AMX_CASE(14) M2R2_AMX_CASE(13) M2R2_AMX_CASE(12) M2R2_AMX_CASE(11)
        M2R2_AMX_CASE(10) M2R2_AMX_CASE(9) M2R2_AMX_CASE(8) M2R2_AMX_CASE(7) M2R2_AMX_CASE(6) M2R2_AMX_CASE(5)
        M2R2_AMX_CASE(4) M2R2_AMX_CASE(3) M2R2_AMX_CASE(2) M2R2_AMX_CASE(1)
#undef M2R2_AMX_CASE
      }
    }
  }
  _tile_release();
}

bool cpu_has_amx_int8() { return m2r2_avx2::amx_granted(25); }

#else
bool cpu_has_amx_int8() { return false; }
#endif

const bool amx_here = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && cpu_has_amx_int8();
std::atomic<bool> amx_on{amx_here && !m2r2_avx2::turned_off("M2R2_NO_AMX_ROWS")};
std::atomic<int64_t> min_rows{10};

}  // namespace

namespace m2r2_avx2 {
bool amx_rows_in_use() { return amx_on.load(std::memory_order_relaxed); }
bool set_amx_rows(bool on) { return amx_on.exchange(on && amx_here); }
int64_t amx_min_rows() { return min_rows.load(std::memory_order_relaxed); }
int64_t set_amx_min_rows(int64_t rows) { return min_rows.exchange(rows < 1 ? 1 : rows); }

#if M2R2_AMX_BUILD
void block_range_amx(int bits, const uint8_t* qbytes, const at::Half* scales, const int8_t* xq, const float* step,
                     const float* qsum, int64_t M, int64_t K, int64_t blocks, uint16_t* y, int64_t b0, int64_t b1) {
  if (bits == 4)
    pairs_amx<4>(qbytes, scales, xq, step, qsum, M, K, blocks, y, b0, b1);
  else
    pairs_amx<8>(qbytes, scales, xq, step, qsum, M, K, blocks, y, b0, b1);
}
#else  // never called: amx_rows_in_use() is false without the tiles
void block_range_amx(int, const uint8_t*, const at::Half*, const int8_t*, const float*, const float*, int64_t, int64_t,
                     int64_t, uint16_t*, int64_t, int64_t) {}
#endif
}  // namespace m2r2_avx2
