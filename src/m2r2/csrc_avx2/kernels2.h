// Raw-pointer entry points of the csrc_avx2 kernels: the ops bound in q4_avx2.cpp and the fused decoder
// block (block_avx2.cpp) call the same code, so a row gets the same bits either way.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>

// Whether this compiler has the AMX intrinsics (GCC 11, Clang 12): the AMX files (q4_amx_rows.cpp, attend_amx.cpp,
// prefill_amx.cpp) build their tile code only then; an older compiler builds the rest of the extension without it
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define M2R2_AMX_COMPILER 1
#else
#define M2R2_AMX_COMPILER 0
#endif

namespace m2r2_avx2 {

// Whether the CPU has AMX tiles and the AMX feature at CPUID leaf 7 EDX bit `bit` (25: INT8, 22: BF16), and Linux
// grants the process the tile state (ARCH_REQ_XCOMP_PERM for XTILEDATA; asking again is harmless): the AMX paths'
// common check (q4_amx_rows.cpp, attend_amx.cpp)
inline bool amx_granted(int bit) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << bit))) return false;
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// An AMX tile configuration (palette 1; tile t: rows[t] rows of colsb[t] bytes), for the AMX paths (q4_amx_rows.cpp,
// attend_amx.cpp), loaded and read back through asm with the whole struct as the memory operand: through the
// intrinsics, GCC 12 took LDTILECFG for a reader of the first bytes only and dropped the stores of the rest where it
// could fold a comparison of the read-back (a configuration of empty tiles: SIGILL at the next product). A released
// configuration reads back as all zero.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
inline void load_tiles(const TileConfig& cfg) { asm volatile("ldtilecfg %0" : : "m"(cfg)); }
inline TileConfig tiles_now() {
  TileConfig now;
  asm volatile("sttilecfg %0" : "=m"(now));
  return now;
}

// whether the environment variable `name` is "1": how a user turns off a build chosen at run time (M2R2_NO_VNNI, ...)
inline bool turned_off(const char* name) {
  const char* v = std::getenv(name);
  return v && v[0] == '1';
}

// A growable buffer for a kernel's intermediate rows, kept by a thread from call to call (thread_local) and not zeroed
// when reused: for steps that write their rows whole before reading them, the same bits without an allocation and a
// zero fill per call. A parallel step's lambda must reach it through a reference or pointer bound on the calling
// thread: there the name of a thread_local denotes the running thread's own. It keeps the largest size asked for the
// thread's life: a 512-row prefill piece's rows, ~10 MB for a SmolLM2-135M block, ~40 MB for Qwen2.5-Coder-1.5B's.
template <typename T>
struct Scratch {
  std::unique_ptr<T[]> buf;
  int64_t cap = 0;
  // room for n elements (their values unspecified)
  void fit(int64_t n) {
    if (n > cap) buf.reset(new T[n]), cap = n;
  }
  T* data() { return buf.get(); }
};

// f(r0, r1) over rows [0, rows) on every thread, 16 rows or more a thread: the row-wise steps (norms, int8 rounding,
// RoPE, SwiGLU's product, adds) of a prefill's rows in parallel. Each row's numbers are its own, so the bits do not
// depend on the split; a pass of up to 16 rows runs on the calling thread.
template <typename F>
inline void parallel_rows(int64_t rows, const F& f) {
  at::parallel_for(0, rows, 16, f);
}

// y [M, blocks * 8] (bfloat16 bits) = x [M, K] times a packed 4-bit (bits 4) or 8-bit (bits 8) weight
void linear_rows(int bits, const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* qbytes, const at::Half* scales,
                 int64_t blocks, uint16_t* y);
// linear_rows in parts, for callers that split a pass's work themselves (the fused block's team, block_avx2.cpp):
// the loop a pass of M rows takes (AMX tiles for long passes of whole pairs, else the VNNI or the AVX2 loop; the same
// integers and bits on each), whether that loop wants its 8-bit inputs offset by 128, each row's int8 inputs for
// groups [g0, g1) of 32 (x, q rows K apart; step, qsum rows K / 32 apart), and output blocks [b0, b1) (whole pairs:
// b0 even) from the rows' int8 inputs
// (bf16: a fused block's prefill rows on AMX-BF16 tiles, prefill_amx.cpp; its own bits, never a verify pass's)
enum class Loop { avx2, vnni, amx, bf16 };
Loop loop_for(int64_t M, int64_t blocks);
inline bool offset_inputs(int bits, Loop loop) { return bits == 8 && loop == Loop::vnni; }
void quantize_groups(const at::BFloat16* x, int64_t M, int64_t K, int64_t g0, int64_t g1, bool offset, int8_t* q,
                     float* step, float* qsum);
void linear_blocks(Loop loop, int bits, const uint8_t* qbytes, const at::Half* scales, const int8_t* xq,
                   const float* step, const float* qsum, int64_t M, int64_t K, int64_t blocks, uint16_t* y, int64_t b0,
                   int64_t b1);
// Whether linear_rows runs its loop's AVX512-VNNI build (q4_vnni.cpp): the CPU has AVX512-VNNI and VL and
// neither M2R2_NO_VNNI=1 nor set_vnni(false) turned it off. Either build gives a row the same bits.
bool vnni_in_use();
// turn the VNNI build on (where the CPU has it) or off; returns whether it was in use
bool set_vnni(bool on);
// blocks [b0, b1) of linear_rows' output from int8 inputs, on the VNNI build (bits 4 or 8)
void block_range_vnni(int bits, const uint8_t* qbytes, const at::Half* scales, const int8_t* xq, const float* step,
                      const float* qsum, int64_t M, int64_t K, int64_t blocks, uint16_t* y, int64_t b0, int64_t b1);
// Whether linear_rows sums passes of amx_min_rows() rows or more on AMX tiles (q4_amx_rows.cpp): the CPU has AMX-INT8,
// Linux grants the tile state, and neither M2R2_NO_AMX_ROWS=1 nor set_amx_rows(false) turned it off. Same bits.
bool amx_rows_in_use();
// turn the AMX sums on (where the CPU has them) or off; returns whether they were in use
bool set_amx_rows(bool on);
// The fewest rows a pass sums on AMX tiles: 10 by default. Per group of 32 inputs a tile product costs about
// what the VNNI loop spends on 8-10 rows (its tile loads, product and store are paid whatever the rows), so
// verify passes of a few rows keep the VNNI loop and prefills take the tiles (experiments/amx_rows_ab.py).
// set_amx_min_rows returns the previous value (an experiment sets 1 to time every pass size).
int64_t amx_min_rows();
int64_t set_amx_min_rows(int64_t rows);
// blocks [b0, b1) (whole pairs: b0 and b1 even) of linear_rows' output on AMX tiles, from signed int8 inputs
void block_range_amx(int bits, const uint8_t* qbytes, const at::Half* scales, const int8_t* xq, const float* step,
                     const float* qsum, int64_t M, int64_t K, int64_t blocks, uint16_t* y, int64_t b0, int64_t b1);
// A prefill's linears on AMX-BF16 tiles (prefill_amx.cpp): the fused blocks take them for passes of prefill_min_rows()
// rows or more (only prompts: m2r2.model.ROW_INVARIANT_MAX_ROWS + 1) where the CPU has AMX-BF16, Linux grants the tile
// state, and neither M2R2_NO_BF16_PREFILL=1 nor set_bf16_prefill(false) turned them off. Bits of their own (bfloat16
// inputs and weights, float32 sums), the same for every method's prefill.
constexpr int64_t PREFILL_MIN_ROWS = 33;
bool bf16_prefill_in_use();
bool set_bf16_prefill(bool on);
// blocks [b0, b1) (whole pairs: b0 and b1 even) of y [M, blocks * 8] from bfloat16 rows x [M, K] on AMX-BF16 tiles
void block_range_bf16(int bits, const uint8_t* qbytes, const at::Half* scales, const uint16_t* x, int64_t M, int64_t K,
                      int64_t blocks, uint16_t* y, int64_t b0, int64_t b1);
// RMSNorm of `rows` rows of D
void rms_norm_rows(const at::BFloat16* x, const at::BFloat16* w, int64_t rows, int64_t D, float eps, uint16_t* out);
// the index of a bfloat16 row's maximum, as argmax_rows (and torch.argmax) picks it: the first of equal maxima, a NaN first
int64_t argmax_bf16(const uint16_t* row, int64_t V);
// rms_norm_rows in parts: a row's scale 1 / sqrt(mean(x^2) + eps), then its normed values c0..c1-1 (c0 a multiple of 8)
float rms_scale(const at::BFloat16* row, int64_t D, float eps);
void rms_norm_range(const at::BFloat16* row, const at::BFloat16* w, float scale, int64_t c0, int64_t c1, uint16_t* out);
// row attention: q [B, H, T, D] float32; k, v float32 or bfloat16 (`bf16`) with strides kv = {k's b, h, s; v's b,
// h, s}; mask [T, S] per batch item (item stride mb); out [B, T, H, D] float32
void attention_rows(const float* q, const void* k, const void* v, bool bf16, const int64_t* kv, const bool* mask,
                    int64_t mb, float* out, int64_t B, int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t S, float sc);
// The row attention's AVX-512 build (attend_avx512.cpp: the AVX2 path's bits), where the CPU has AVX512-BF16: whether
// it is in use (neither M2R2_NO_AVX512_ATTENTION=1 nor set_avx512_attention(false) turned it off), the switch (returns
// whether it was in use), whether a head size takes it, then its two parts for G query vectors (q, qstride apart;
// bfloat16 values) over n keys of a bfloat16 cache: the scores e[g * estride + i] = sc * q_g . k[keys[i]] (four keys
// at a time: up to 3 spare slots past n get written) and the weighted values out[g * D + d] = sum_i e[g * estride + i]
// v[keys[i]][d] / tots[g]
bool avx512_attention_in_use();
bool set_avx512_attention(bool on);
bool avx512_attention_fits(int64_t D);
void scores_avx512(const float* q, int64_t qstride, int64_t G, const at::BFloat16* kb, int64_t ks, const int32_t* keys,
                 int64_t n, int64_t D, float sc, float* e, int64_t estride);
void values_avx512(const float* e, int64_t estride, int64_t G, const int32_t* keys, int64_t n, const at::BFloat16* vb,
                 int64_t vs, const float* tots, float* out, int64_t D);
// The row attention's scores on AMX tiles (attend_amx.cpp), where the CPU has AMX-BF16: whether they are in use (neither
// M2R2_NO_AMX_ATTENTION=1 nor set_amx_attention(false) turned them off), the switch (returns whether they were in use),
// whether a head size takes them, then the attention of N <= 16 query vectors of one key head (q[i]: bfloat16 values
// as float32; mask[i]: the keys vector i may see, bool [S]; out[i]: D float32) over a bfloat16 cache. A vector's
// output has the same bits whichever vectors share the call; they differ from the AVX2 path's in the scores' order
// of additions.
bool amx_attention_in_use();
bool set_amx_attention(bool on);
bool amx_attention_fits(int64_t D);
// The fewest keys a query vector sees for its attention to run on the tiles: 448 by default. A call pays to wake the
// tile unit (asleep after a microsecond or two idle) and to lay out its queries, and the tiles slow the linear layers
// around them a little, which a one-row pass's few keys do not repay; the choice follows a vector's own keys, the same in one-row decoding as in a verify pass, so every
// position gets one path's bits whatever pass computes it. set_amx_attention_min_keys returns the previous value.
int64_t amx_attention_min_keys();
int64_t set_amx_attention_min_keys(int64_t keys);
void attend_amx(const float* const* q, const bool* const* mask, float* const* out, int N, const at::BFloat16* kb,
                int64_t ks, const at::BFloat16* vb, int64_t vs, int64_t S, int64_t D, float sc);
// A throwaway tile product, where this thread's tiles hold attend_amx's configuration: a block whose attention will run on
// the tiles calls it before its q/k/v projection, so that the tile unit, asleep since the last block's attention, is
// awake when the attention starts (no-op elsewhere).
void wake_amx_attention();
// silu(gate) * up of rows [gate (m) | up (m)] into [rows, m]
void silu_mul_rows(const at::BFloat16* gu, int64_t rows, int64_t m, uint16_t* out);
// one row's silu(gate[j]) * up[j] for j in c0..c1-1 (c0 a multiple of 8), into out[j]
void silu_mul_range(const at::BFloat16* gate, const at::BFloat16* up, int64_t c0, int64_t c1, uint16_t* out);
// SwiGLU's product's AVX-512 build (silu_avx512.cpp: the same bits), where the CPU has AVX-512 F/BW/VL: whether it is
// in use (neither M2R2_NO_AVX512_SILU=1 nor set_avx512_silu(false) turned it off), the switch (returns whether it was
// in use), and the range itself
bool avx512_silu_in_use();
bool set_avx512_silu(bool on);
void silu_mul_range_avx512(const at::BFloat16* gate, const at::BFloat16* up, int64_t c0, int64_t c1, uint16_t* out);
// attention_rows' query vectors u0..u1-1 (u = ((b * KVH + h) * T + t) * (H / KVH) + g: vector g of key head h's group in
// row t), on the calling thread (the same bits however a pass's vectors are cut)
void attention_units(const float* q, const void* k, const void* v, bool bf16, const int64_t* kv, const bool* mask,
                     int64_t mb, float* out, int64_t B, int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t S,
                     float sc, int64_t u0, int64_t u1);

}  // namespace m2r2_avx2
