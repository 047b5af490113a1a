// The row attention on AMX tiles (Intel Sapphire Rapids and later) for a bfloat16 cache and bfloat16 queries: chosen at
// run time by run_units (rows_avx2.cpp) where the CPU has AMX-BF16, for the query vectors that see at least
// amx_attention_min_keys() keys (448); the extension itself is built with AVX2 flags only and still loads elsewhere.
//
// Why: the AVX-512 build (attend_avx512.cpp) sums each score in the AVX2 path's order, lane partial sums and then a
// horizontal tree, per key and query vector, and every row of a verify pass pays for its own. Here one TDPBF16PS
// multiplies 16 keys (tile A: the cache's rows as they lie, 32 of a head's values each) by up to 16 query vectors of a
// key head, from all the pass's rows (tile B: their values in pairs), so the rows share every key's load and no score
// needs a horizontal sum: the scores come out as 16 keys x W vectors (W = 4, 8 or 16, the fewest that hold them),
// keys in rows, and the softmax runs down them 16 / W keys a register. On a 2-vCPU Sapphire Rapids class Xeon a pass
// of the 30 layers after 1,000 tokens took 0.98 / 0.92 / 0.82 of the AVX-512 build's time at 1 / 2 / 4 rows; after
// 64-250 tokens it took 1.03-1.08 at 1-2 rows (experiments/amx_attention_ab.py): each call wakes the tile unit, which
// sleeps after a microsecond or two idle (experiments/amx_wake.cpp), and lays out its queries, costs a short context
// does not repay. A block whose attention will run here now wakes the unit before its q/k/v projection
// (wake_amx_attention), and the blocks ask for their cached keys early (block_avx2.cpp, prefetch_cache). With both,
// timed in blocks of passes (BLOCK=30: the tiles slow the core's other work for a while after them), a one-row pass
// took 1.018 of the AVX-512 build's time after 384 tokens and 0.987 after 512, 2 rows 0.97 / 0.94, 4 rows 0.87 / 0.85;
// after 64-250 tokens one row lost 5-6% (experiments/amx_tax.py: a few % of it in the linear layers around the
// attention, the rest in the wake-up and the calls). Hence the threshold, about where one row breaks even, which
// follows a vector's own keys: one position gets one path in one-row decoding and in any verify pass.
//
// Bits: TDPBF16PS computes each output from its own row of A and column of B, whatever the other rows and columns
// hold, so a vector's score of a key is the same whichever vectors and keys share its tile: a verify pass's rows get
// the bits of one-row decoding (tested). The scores' order of additions is AMX's, not the AVX2 path's, so they differ
// from that path in the last bits; everything after them (the maximum, exp, the sum of exponentials key by key in cache
// order, the weighted values' multiply-adds key by key, the division) is the AVX-512 build's, lane for lane.
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels2.h"
#include "simd2.h"

#define M2R2_AMX_BF16_BUILD M2R2_AMX_COMPILER  // kernels2.h: an older compiler builds the rest without the tiles

#if M2R2_AMX_BF16_BUILD
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,amx-tile,amx-bf16")
#include "exp16.h"
#endif

namespace {

using namespace m2r2_avx2;

constexpr int64_t MAX_D = 256;
constexpr int KEYS = 16;  // keys a tile product scores (tile A's rows)

#if M2R2_AMX_BF16_BUILD

// tiles 0 and 6: the scores of two blocks, 16 keys x W vectors (float32); 1 and 7: their keys, 16 x 32 values; 2-5:
// 16 pairs of query values x W vectors (chunks 0-3, loaded once a call where the head size is up to 128, else chunk
// by chunk into 2). Loading a configuration took ~120 ns here, reading it back ~10 (experiments/amx_wake.cpp): the
// calls keep theirs (no tile release after a call) and load it only where the thread's tiles hold another (the
// linears' AMX path, q4_amx_rows.cpp, releases its own, which reads back as all zero; kernels2.h, TileConfig).
inline void configure(int W) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(4 * W);
  cfg.colsb[1] = cfg.colsb[7] = 64;
  const TileConfig now = tiles_now();
  if (std::memcmp(&cfg, &now, sizeof(cfg)) != 0) load_tiles(cfg);
}

// tile product C += A x B for the pairs (C, A) = (0, 1) or (6, 7) and B one of 2-5 (tile numbers must be constants)
inline void product(int c, int a, int b) {
  if (c == 0 && a == 1) {
    switch (b) {
      case 2: _tile_dpbf16ps(0, 1, 2); return;
      case 3: _tile_dpbf16ps(0, 1, 3); return;
      case 4: _tile_dpbf16ps(0, 1, 4); return;
      default: _tile_dpbf16ps(0, 1, 5); return;
    }
  }
  switch (b) {
    case 2: _tile_dpbf16ps(6, 7, 2); return;
    case 3: _tile_dpbf16ps(6, 7, 3); return;
    case 4: _tile_dpbf16ps(6, 7, 4); return;
    default: _tile_dpbf16ps(6, 7, 5); return;
  }
}

// 4 x 16 values of a bfloat16 row from d0 as float32 (exact)
inline void widen64(const at::BFloat16* v, __m512 (&out)[4]) {
  for (int c = 0; c < 4; ++c) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * c));
    out[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
}

// Vectors n0..n0+GN-1's weighted values over 64 lanes from d0: their exponentials e[s * W + n] times the values of
// keys 0..end-1 in cache order (keys before `all` allowed for every vector, later ones as `allowed[s]`'s bit n says),
// divided by their sums: attend_avx512.cpp's weigh64, lane for lane. The first call (`sums`) also adds every vector's
// exponentials key by key in cache order into tots (a chain of dependent adds, run beside the multiply-adds here
// rather than alone; adding a not allowed key's zero keeps a sum's bits).
template <int GN>
inline void weigh(const float* e, int W, const uint16_t* allowed, int64_t all, int64_t end, int n0,
                  const at::BFloat16* vb, int64_t vs, int64_t d0, bool sums, float* tots, float* const* out) {
  __m512 acc[GN][4];
  for (int j = 0; j < GN; ++j)
    for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_setzero_ps();
  const __mmask16 w = static_cast<__mmask16>((1u << W) - 1);
  __m512 tot = _mm512_setzero_ps(), vc[4];
  for (int64_t s = 0; s < all; ++s) {
    if (sums) tot = _mm512_add_ps(tot, _mm512_maskz_loadu_ps(w, e + s * W));
    widen64(vb + s * vs + d0, vc);
    for (int j = 0; j < GN; ++j) {
      const __m512 p = _mm512_set1_ps(e[s * W + n0 + j]);
      for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_fmadd_ps(p, vc[c], acc[j][c]);
    }
  }
  for (int64_t s = all; s < end; ++s) {  // a pass's own rows: each vector only the keys its row sees
    if (sums) tot = _mm512_add_ps(tot, _mm512_maskz_loadu_ps(w, e + s * W));
    const unsigned bits = allowed[s] >> n0;
    if ((bits & ((1u << GN) - 1)) == 0) continue;
    widen64(vb + s * vs + d0, vc);
    for (int j = 0; j < GN; ++j) {
      if (!((bits >> j) & 1)) continue;
      const __m512 p = _mm512_set1_ps(e[s * W + n0 + j]);
      for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_fmadd_ps(p, vc[c], acc[j][c]);
    }
  }
  if (sums) _mm512_storeu_ps(tots, tot);
  for (int j = 0; j < GN; ++j) {
    const __m512 t = _mm512_set1_ps(tots[n0 + j]);
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out[n0 + j] + d0 + 16 * c, _mm512_div_ps(acc[j][c], t));
  }
}

#endif

bool cpu_has_amx_bf16() {
#if M2R2_AMX_BF16_BUILD
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && amx_granted(22);
#else
  return false;
#endif
}

const bool amx_bf16_here = cpu_has_amx_bf16();
std::atomic<bool> amx_attention_on{amx_bf16_here && !m2r2_avx2::turned_off("M2R2_NO_AMX_ATTENTION")};
std::atomic<int64_t> min_keys{448};

}  // namespace

namespace m2r2_avx2 {

bool amx_attention_in_use() { return amx_attention_on.load(std::memory_order_relaxed); }
bool set_amx_attention(bool on) { return amx_attention_on.exchange(on && amx_bf16_here); }
bool amx_attention_fits(int64_t D) { return D % 64 == 0 && D <= MAX_D; }
int64_t amx_attention_min_keys() { return min_keys.load(std::memory_order_relaxed); }
int64_t set_amx_attention_min_keys(int64_t keys) { return min_keys.exchange(keys < 1 ? 1 : keys); }

#if M2R2_AMX_BF16_BUILD
void attend_amx(const float* const* q, const bool* const* mask, float* const* out, int N, const at::BFloat16* kb,
                int64_t ks, const at::BFloat16* vb, int64_t vs, int64_t S, int64_t D, float sc) {
  TORCH_CHECK(N >= 1 && N <= KEYS && amx_attention_fits(D), "attend_amx: 1-16 vectors, a head size of 64..256");
  const int W = N <= 4 ? 4 : N <= 8 ? 8 : 16, per = KEYS / W;
  const int64_t chunks = D / 32;
  // The tile unit sleeps after a microsecond or two without work (between two layers' attention it always has), and
  // the first product after that waited ~800-3,000 more cycles on this machine (experiments/amx_wake.cpp): a throwaway
  // product now, on whatever the tiles hold, wakes it while the queries and masks below are read.
  configure(W);
  _tile_dpbf16ps(0, 1, 2);
  for (int64_t r = 0; r < std::min<int64_t>(S, 2 * KEYS); ++r)  // the first two blocks' keys, ahead of their tile
    for (int64_t d = 0; d < D; d += 32)                          // loads (which wait on each of their 16 lines)
      _mm_prefetch(reinterpret_cast<const char*>(kb + r * ks + d), _MM_HINT_T0);
  // B first (its stores then reach the cache while the masks are read; a tile load cannot take them from the store
  // buffer): chunk c's 16 pairs of query values (32c + 2k, 32c + 2k + 1) for each vector n (the rest zero), rows 4W
  // bytes, a pair's two bfloat16 values (the queries' high halves) in one 32-bit word
  alignas(64) uint32_t bq[MAX_D / 32 * 16 * KEYS];
  std::memset(bq, 0, chunks * 16 * W * sizeof(uint32_t));
  for (int n = 0; n < N; ++n)
    for (int64_t p = 0; p < D / 2; ++p) {
      uint64_t two;
      std::memcpy(&two, q[n] + 2 * p, 8);
      bq[p * W + n] = static_cast<uint32_t>((two >> 16) & 0xFFFFu) | static_cast<uint32_t>((two >> 32) & 0xFFFF0000u);
    }
  // keys [0, all) are allowed for every vector (a verified prefix); [all, end) for some
  int64_t all = S, end = 0;
  for (int i = 0; i < N; ++i) {  // (memchr and memrchr: bool is one byte, 0 or 1)
    const void* off = std::memchr(mask[i], 0, S);
    all = std::min<int64_t>(all, off ? static_cast<const bool*>(off) - mask[i] : S);
    const void* on = memrchr(mask[i], 1, S);
    end = std::max<int64_t>(end, on ? static_cast<const bool*>(on) - mask[i] + 1 : 0);
  }
  all = std::min(all, end);
  // the scores of W >= N vectors a key (4, 8 or 16: 16 / W keys a register), keys in rows
  thread_local std::vector<float> e;
  thread_local std::vector<uint16_t> allowed;
  const int64_t blocks = (end + KEYS - 1) / KEYS, regs = blocks * W;  // registers of 16 scores
  e.resize(std::max<int64_t>(regs, 1) * KEYS);
  allowed.resize(blocks * KEYS + 1);
  const unsigned every = (1u << N) - 1;
  for (int64_t s = 0; s < blocks * KEYS; ++s) {
    unsigned bits = s < all ? every : 0;
    for (int i = 0; i < N && s >= all && s < end; ++i) bits |= static_cast<unsigned>(mask[i][s]) << i;
    allowed[s] = static_cast<uint16_t>(bits);
  }
  const auto lanes = [&](int64_t r) {  // register r's allowed lanes: its keys' bits side by side
    if ((r + 1) * per <= all) return static_cast<__mmask16>(per == 4 ? every * 0x1111u : per == 2 ? every * 0x0101u : every);
    unsigned m = 0;
    for (int i = 0; i < per; ++i) m |= static_cast<unsigned>(allowed[r * per + i]) << (i * W);
    return static_cast<__mmask16>(m);
  };
  alignas(64) at::BFloat16 tail[KEYS * MAX_D];  // a last block of fewer than 16 keys, zero-padded
  const bool resident = chunks <= 4;
  if (resident) {
    const auto* b0 = bq, *b1 = bq + 16 * W, *b2 = bq + 2 * 16 * W, *b3 = bq + 3 * 16 * W;
    _tile_loadd(2, b0, 4 * W);
    _tile_loadd(3, b1, 4 * W);
    if (chunks > 2) _tile_loadd(4, b2, 4 * W);
    if (chunks > 3) _tile_loadd(5, b3, 4 * W);
  }
  // two blocks at a time on their own tiles (0 and 1, 6 and 7), so that one block's products run while the other's
  // keys load: a tile is not renamed, and one block's chain (its keys, two products, the store) waits on itself
  const auto keys_of = [&](int64_t blk, int64_t& stride) {  // block blk's 16 keys (zero-padded past `end`)
    const int64_t s0 = blk * KEYS, rows = std::min<int64_t>(KEYS, end - s0);
    for (int64_t r = s0 + 2 * KEYS; r < std::min(end, s0 + 3 * KEYS); ++r)  // two blocks ahead
      for (int64_t d = 0; d < D; d += 32) _mm_prefetch(reinterpret_cast<const char*>(kb + r * ks + d), _MM_HINT_T0);
    stride = ks * 2;
    if (rows == KEYS) return kb + s0 * ks;
    std::memset(tail, 0, KEYS * D * sizeof(at::BFloat16));
    for (int64_t r = 0; r < rows; ++r) std::memcpy(tail + r * D, kb + (s0 + r) * ks, D * 2);
    stride = D * 2;
    return static_cast<const at::BFloat16*>(tail);
  };
  for (int64_t blk = 0; blk < blocks; blk += 2) {
    const bool two = blk + 1 < blocks;
    int64_t sa = 0, sb = 0;
    const at::BFloat16* a = keys_of(blk, sa);
    const at::BFloat16* b = two ? keys_of(blk + 1, sb) : nullptr;
    _tile_zero(0);
    if (two) _tile_zero(6);
    for (int64_t c = 0; c < chunks; ++c) {
      if (!resident) _tile_loadd(2, bq + c * 16 * W, 4 * W);
      const int q = resident ? 2 + static_cast<int>(c) : 2;
      _tile_loadd(1, a + 32 * c, sa);
      product(0, 1, q);
      if (two) {
        _tile_loadd(7, b + 32 * c, sb);
        product(6, 7, q);
      }
    }
    _tile_stored(0, e.data() + blk * KEYS * W, 4 * W);
    if (two) _tile_stored(6, e.data() + (blk + 1) * KEYS * W, 4 * W);
  }
  // scaled by sc (as the other paths scale a score), and each vector's maximum over its allowed keys
  const __m512 scale = _mm512_set1_ps(sc);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t r = 0; r < regs; ++r) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(e.data() + r * KEYS), scale);
    _mm512_storeu_ps(e.data() + r * KEYS, x);
    mx = _mm512_mask_max_ps(mx, lanes(r), mx, x);
  }
  if (W <= 8) mx = _mm512_max_ps(mx, _mm512_shuffle_f32x4(mx, mx, 0x4E));  // the keys side by side: one maximum
  if (W == 4) mx = _mm512_max_ps(mx, _mm512_shuffle_f32x4(mx, mx, 0xB1));
  // exponentials, zero where a key is not allowed
  for (int64_t r = 0; r < regs; ++r) {
    float* x = e.data() + r * KEYS;
    _mm512_storeu_ps(x, _mm512_maskz_mov_ps(lanes(r), exp16(_mm512_sub_ps(_mm512_loadu_ps(x), mx))));
  }
  alignas(64) float tots[KEYS];  // each vector's sum of exponentials (the first weigh call's)
  for (int64_t d0 = 0; d0 < D; d0 += 64)
    for (int n0 = 0; n0 < N; n0 += 4) switch (std::min(4, N - n0)) {
        case 4: weigh<4>(e.data(), W, allowed.data(), all, end, n0, vb, vs, d0, d0 == 0 && n0 == 0, tots, out); break;
        case 3: weigh<3>(e.data(), W, allowed.data(), all, end, n0, vb, vs, d0, d0 == 0 && n0 == 0, tots, out); break;
        case 2: weigh<2>(e.data(), W, allowed.data(), all, end, n0, vb, vs, d0, d0 == 0 && n0 == 0, tots, out); break;
        default: weigh<1>(e.data(), W, allowed.data(), all, end, n0, vb, vs, d0, d0 == 0 && n0 == 0, tots, out); break;
      }
  for (int n = 0; n < N; ++n)  // a vector that sees no key attends nothing (zeros, as the other paths give)
    if (end == 0 || (all == 0 && std::find(mask[n], mask[n] + end, true) == mask[n] + end))
      std::fill(out[n], out[n] + D, 0.0f);
}

void wake_amx_attention() {
  const TileConfig now = tiles_now();
  // TDPBF16PS(0, 1, 2) needs C 16 x 4W, A 16 x 64 bytes, B 16 x 4W: configure()'s shapes (a released or other
  // configuration reads otherwise, and a product on it would fault)
  if (now.palette == 1 && now.rows[0] == KEYS && now.rows[1] == KEYS && now.colsb[1] == 64 && now.rows[2] == KEYS &&
      now.colsb[0] == now.colsb[2] && now.colsb[0] > 0)
    _tile_dpbf16ps(0, 1, 2);
}
#else  // never called: amx_attention_in_use() is false without the tiles
void wake_amx_attention() {}
void attend_amx(const float* const*, const bool* const*, float* const*, int, const at::BFloat16*, int64_t,
                const at::BFloat16*, int64_t, int64_t, int64_t, float) {}
#endif

}  // namespace m2r2_avx2
