// 4-bit and 8-bit weight-only linear layers whose cost is nearly flat in the number of rows (1..16).
//
// Why: a verify pass runs k rows through every layer. torch's CPU int4 kernel de-quantizes the
// weights again for every 4 rows, so 8 rows cost ~2 one-row steps. Here the weights are never
// de-quantized. Per column and group of 32 inputs a weight is w = q * d + m (4-bit: q in 0..15, step
// d, minimum m) or w = q * d (8-bit: q in -127..127, GGUF Q8_0), so a group adds
// d * sum(q * x) + m * sum(x) to an output. The integers are exact in bf16: each group of 32 inputs
// x 64 columns is unpacked once per call (per 16 rows) to bf16 integers (a 4 KB buffer in the VNNI
// pair layout), whose products with bf16 inputs are exact in float32, and the float32 sums are scaled
// per column. Two ways to sum q * x, one template:
//   AMX (Sapphire Rapids and later): TDPBF16PS sums up to 16 rows at once, 1 row costs what 16 cost;
//   AVX512-BF16 (Zen 4/5, Cooper Lake): VDPBF16PS per row, 16 columns x 1 input pair an instruction,
//     four rows at a time so each unpacked weight register serves four rows; the unpacking and the
//     weight bytes read (what a one-row step waits on) are still paid once for all rows.
// The two give different bits (the hardware adds in different orders), so they are two kernels
// (q4-amx, q4-avx512). In each, every output is summed group by group in the same order whatever the
// number of rows, so a row's bits do not depend on the pass (tested; the Python side also probes it
// once per shape). The next group is unpacked while AMX works on this one, the weights a few groups
// ahead are prefetched, and column blocks run in parallel on torch's thread pool (at::parallel_for,
// OpenMP).
//
// Layouts (written by m2r2.kernels.AmxInt4Linear / AmxInt8Linear). Per column block of 64 and pair
// of inputs (2p, 2p+1) there are 128 VNNI lanes: lane j is column j/2 at input 2p + j%2.
//   4-bit qbytes : uint8 [N/64, K/2, 64], 128 nibbles placed where the unpacking puts them: the low
//            nibbles of the 64 bytes give lanes 0-63, the high ones 64-127, and within each half
//            byte 16t+i (i < 8) gives lane 8t+i, byte 16t+8+i lane 32+8t+i.
//          scales : half [N/64, K/32, 2, 64]: per group the 64 steps d, then the 64 minima m.
//   8-bit qbytes : int8 [N/64, K/2, 128] in lane order.
//          scales : half [N/64, K/32, 1, 64]: per group the 64 steps d.
#include <ATen/Parallel.h>
#include <type_traits>
#include <immintrin.h>
#include <torch/extension.h>

#include <sys/syscall.h>
#include <unistd.h>

bool amx_usable();  // below: whether the AMX products run here

namespace {

constexpr int64_t NB = 64;       // columns per block
constexpr int64_t MB = 16;       // rows per pass over the weights (one AMX tile of rows)
constexpr int64_t PREFETCH = 4;  // groups of 32 inputs

// Bytes of one group's packed weights: 16 input pairs of 64 (4-bit) or 128 (8-bit) bytes.
template <int BITS>
constexpr int64_t group_bytes = 16 * NB * BITS / 4;

// One group (32 inputs x 64 columns) of integer weights into w: bf16 [16 input pairs][64 columns][2].
// 4-bit: a nibble indexes two 16-entry byte tables (low and high byte of the bf16 value of 0..15)
// and the two bytes are interleaved into words. 8-bit: sign-extended and converted through float32.
template <int BITS>
inline void unpack_group(const uint8_t* q, at::BFloat16* w, __m512i lut_lo, __m512i lut_hi) {
  for (int p = 0; p < 16; ++p) {
    __m512i* out = reinterpret_cast<__m512i*>(w + p * 2 * NB);
    if constexpr (BITS == 4) {
      const __m512i low4 = _mm512_set1_epi8(0x0F);
      const __m512i bytes = _mm512_loadu_si512(q + p * NB);
      const __m512i lo = _mm512_and_si512(bytes, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
      const __m512i lo_l = _mm512_shuffle_epi8(lut_lo, lo), lo_h = _mm512_shuffle_epi8(lut_hi, lo);
      const __m512i hi_l = _mm512_shuffle_epi8(lut_lo, hi), hi_h = _mm512_shuffle_epi8(lut_hi, hi);
      _mm512_store_si512(out + 0, _mm512_unpacklo_epi8(lo_l, lo_h));
      _mm512_store_si512(out + 1, _mm512_unpackhi_epi8(lo_l, lo_h));
      _mm512_store_si512(out + 2, _mm512_unpacklo_epi8(hi_l, hi_h));
      _mm512_store_si512(out + 3, _mm512_unpackhi_epi8(hi_l, hi_h));
    } else {
      for (int h = 0; h < 4; ++h) {  // 32 lanes each
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + p * 2 * NB + 32 * h));
        const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
        const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
        _mm512_store_si512(out + h, (__m512i)_mm512_cvtne2ps_pbh(b, a));
      }
    }
  }
}

// AMX tile configuration: tiles 0-3 take rows x 16 columns each of a group's sums (float32), tile 4
// holds rows x 32 inputs of x, tiles 5-6 hold 32 inputs x 16 columns of integer weights (VNNI pairs).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) cfg.colsb[t] = 64, cfg.rows[t] = static_cast<uint8_t>(rows);
  for (int t = 5; t < 7; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  asm volatile("ldtilecfg %0" : : "m"(cfg));  // the whole struct as the operand: GCC may drop stores the intrinsic hides
}

// Sums of q * x for one group with VDPBF16PS: c[i][col] for ROWS rows starting at x (row stride K),
// the group's inputs at x + 32 g. load(p, wv) puts input pair p's weights for the 64 columns into four
// registers (16 columns x 2 inputs each); each (row, 16-column quarter) sums its 16 pairs in order.
template <int ROWS, typename Load>
inline void dot_rows(Load&& load, const at::BFloat16* x, int64_t K, float* c) {
  __m512 s[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < 4; ++t) s[r][t] = _mm512_setzero_ps();
  for (int p = 0; p < 16; ++p) {
    __m512bh wv[4];
    load(p, wv);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * K + 2 * p));
      for (int t = 0; t < 4; ++t) s[r][t] = _mm512_dpbf16_ps(s[r][t], wv[t], xb);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < 4; ++t) _mm512_store_ps(c + r * NB + 16 * t, s[r][t]);
}

// An unpacked group (the 8-bit head): the weights as they lie in the buffer.
template <int ROWS>
inline void dot_group(const at::BFloat16* w, const at::BFloat16* x, int64_t K, float* c) {
  dot_rows<ROWS>(
      [w](int p, __m512bh* wv) {
        for (int t = 0; t < 4; ++t) wv[t] = (__m512bh)_mm512_load_si512(w + p * 2 * NB + 32 * t);
      },
      x, K, c);
}

// The same sums straight from 4-bit bytes packed for this path (no unpacked buffer): 32 little-endian
// words per input pair, nibble n of word i being lane 32n + i, so (word >> 4n) & 0xF | 0x4300 is the
// bf16 of 128 + q for 16 columns at once (one shift and one ternary-logic op per 32 weights, against
// four byte shuffles, interleaves and stores). The caller takes 128 * sum(x) off each sum.
template <int ROWS>
inline void dot_group_offset(const uint8_t* q, const at::BFloat16* x, int64_t K, float* c) {
  dot_rows<ROWS>(
      [q](int p, __m512bh* wv) {
        const __m512i low4 = _mm512_set1_epi16(0x000F), offset = _mm512_set1_epi16(0x4300);  // bf16(128)
        const __m512i words = _mm512_loadu_si512(q + p * NB);
        for (int t = 0; t < 4; ++t)  // (a & b) | c of the word shifted to nibble t
          wv[t] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4 * t), low4, offset, 0xEA);
      },
      x, K, c);
}

// f(n, i) for the rows i..i+n-1 of a pass: n = 4 while four are left, then the remainder (n a
// compile-time std::integral_constant, so the dot products keep their accumulators in registers)
template <typename F>
inline void by_fours(int rows, F&& f) {
  int i = 0;
  for (; i + 4 <= rows; i += 4) f(std::integral_constant<int, 4>{}, i);
  switch (rows - i) {
    case 3: f(std::integral_constant<int, 3>{}, i); break;
    case 2: f(std::integral_constant<int, 2>{}, i); break;
    case 1: f(std::integral_constant<int, 1>{}, i); break;
    default: break;
  }
}

// y[M, N] (bf16) = x[M, K] (bf16) @ W^T for the packed W [N, K] of BITS-bit integers, the products
// summed on AMX tiles or (AMX false) with AVX512-BF16 dot products.
template <int BITS, bool AMX>
torch::Tensor linear(torch::Tensor x, torch::Tensor qbytes, torch::Tensor scales) {
  constexpr int64_t terms = BITS == 4 ? 2 : 1;  // per group: steps (and minima)
  if constexpr (AMX) {  // an AMX instruction on a CPU without it would kill the process
    static const bool amx_ok = amx_usable();
    TORCH_CHECK(amx_ok, "this CPU has no AMX: use the avx512 products (kernel q4-avx512)");
  }
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(qbytes.element_size() == 1 && qbytes.is_contiguous() && qbytes.dim() == 3, "qbytes: bytes [N/64, K/2, lanes]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 4, "scales: half [N/64, K/32, terms, 64]");
  const int64_t M = x.size(0), K = x.size(1), blocks = qbytes.size(0), N = blocks * NB;
  TORCH_CHECK(K % 32 == 0 && qbytes.size(1) * 2 == K && qbytes.size(2) == NB * BITS / 4, "packed weight does not match x");
  TORCH_CHECK(scales.size(0) == blocks && scales.size(1) * 32 == K && scales.size(2) == terms && scales.size(3) == NB,
              "scales do not match the packed weight");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const uint8_t* qp = static_cast<const uint8_t*>(qbytes.data_ptr());
  const at::Half* sp = scales.data_ptr<at::Half>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t groups = K / 32;
  // 4-bit: per row and group, the sum of its 32 inputs (the minima's term), in a fixed order
  std::vector<float> xsum(BITS == 4 ? M * groups : 0);
  for (int64_t i = 0; i < (BITS == 4 ? M : 0); ++i)
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i raw = _mm512_loadu_si512(xp + i * K + g * 32);
      const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
      const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
      xsum[i * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
  const float* xs = xsum.data();
  alignas(64) uint8_t lo_bytes[64], hi_bytes[64];  // bf16 of 0..15, low and high bytes, per 128-bit lane
  for (int t = 0; t < 4; ++t)
    for (int v = 0; v < 16; ++v) {
      const uint16_t bits = c10::BFloat16(static_cast<float>(v)).x;
      lo_bytes[16 * t + v] = bits & 0xFF, hi_bytes[16 * t + v] = bits >> 8;
    }
  const __m512i lut_lo = _mm512_load_si512(lo_bytes), lut_hi = _mm512_load_si512(hi_bytes);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    // two group buffers: AMX reads one while the next group is unpacked into the other
    alignas(64) at::BFloat16 w[2][16 * 2 * NB];  // a group: 16 input pairs x 64 columns x 2
    alignas(64) float c[MB * NB];                // a group's sums of q * x
    alignas(64) float acc[MB * NB];              // the outputs so far
    int configured = 0;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int rows = static_cast<int>(std::min(MB, M - m0));
      if constexpr (AMX)
        if (rows != configured) configure(rows), configured = rows;
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* qb = qp + b * groups * group_bytes<BITS>;
        const at::Half* sb = sp + b * groups * terms * NB;
        for (int i = 0; i < rows * NB; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
        constexpr bool OFFSET = !AMX && BITS == 4;  // the AVX512 4-bit path reads its bytes directly
        if constexpr (!OFFSET) unpack_group<BITS>(qb, w[0], lut_lo, lut_hi);
        for (int64_t g = 0; g < groups; ++g) {
          const at::BFloat16* wg = w[g & 1];
          if constexpr (AMX) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(4, xp + m0 * K + g * 32, K * sizeof(at::BFloat16));
            _tile_loadd(5, wg, 2 * NB * sizeof(at::BFloat16));
            _tile_loadd(6, wg + 32, 2 * NB * sizeof(at::BFloat16));
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, wg + 64, 2 * NB * sizeof(at::BFloat16));
            _tile_loadd(6, wg + 96, 2 * NB * sizeof(at::BFloat16));
            _tile_dpbf16ps(2, 4, 5);
            _tile_dpbf16ps(3, 4, 6);
          } else {  // AVX512: rows four at a time, then the rest (each row sums in the same order either way)
            const at::BFloat16* xg = xp + m0 * K + g * 32;
            by_fours(rows, [&](auto n, int i) {
              if constexpr (OFFSET)
                dot_group_offset<decltype(n)::value>(qb + g * group_bytes<BITS>, xg + i * K, K, c + i * NB);
              else
                dot_group<decltype(n)::value>(wg, xg + i * K, K, c + i * NB);
            });
          }
          if (g + 1 < groups) {  // while AMX works: prefetch ahead, unpack the next group
            // (past the block's end: the next block's first groups; the hardware prefetcher alone
            // left the loop waiting on memory)
            const char* ahead = reinterpret_cast<const char*>(qb + (g + PREFETCH) * group_bytes<BITS>);
            for (int l = 0; l < group_bytes<BITS> / 64; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
            const char* sahead = reinterpret_cast<const char*>(sb + (g + PREFETCH) * terms * NB);
            for (int l = 0; l < 2 * terms; ++l) _mm_prefetch(sahead + 64 * l, _MM_HINT_T0);
            if constexpr (!OFFSET)
              unpack_group<BITS>(qb + (g + 1) * group_bytes<BITS>, w[(g + 1) & 1], lut_lo, lut_hi);
          }
          if constexpr (AMX) {
            _tile_stored(0, c, NB * sizeof(float));
            _tile_stored(1, c + 16, NB * sizeof(float));
            _tile_stored(2, c + 32, NB * sizeof(float));
            _tile_stored(3, c + 48, NB * sizeof(float));
          }
          // this group's terms, per row and column: fma(sum(q * x), d, acc), then fma(sum(x), m, acc)
          const at::Half* s = sb + g * terms * NB;
          __m512 d[4], mn[4];
          for (int t = 0; t < 4; ++t) {
            d[t] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 * t)));
            if constexpr (BITS == 4)
              mn[t] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + NB + 16 * t)));
          }
          for (int i = 0; i < rows; ++i) {
            const __m512 xg = BITS == 4 ? _mm512_set1_ps(xs[(m0 + i) * groups + g]) : _mm512_setzero_ps();
            for (int t = 0; t < 4; ++t) {
              __m512 a = _mm512_load_ps(acc + i * NB + 16 * t);
              __m512 sum = _mm512_load_ps(c + i * NB + 16 * t);
              if constexpr (OFFSET) sum = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), xg, sum);  // 128 * sum(x) off
              a = _mm512_fmadd_ps(sum, d[t], a);
              if constexpr (BITS == 4) a = _mm512_fmadd_ps(xg, mn[t], a);
              _mm512_store_ps(acc + i * NB + 16 * t, a);
            }
          }
        }
        for (int i = 0; i < rows; ++i)
          for (int64_t j = 0; j < NB; j += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + (m0 + i) * N + b * NB + j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + i * NB + j)));
      }
    }
    if constexpr (AMX) _tile_release();
  });
  return y;
}

}  // namespace

// Whether this CPU runs the kernels: AVX512-BF16/BW for every kernel here (the unpacking, sums and
// dot products, the row attention, norm and argmax).
bool usable() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

// Whether it also runs the AMX products (Linux gives a process AMX state only on request:
// ARCH_REQ_XCOMP_PERM for XTILEDATA).
bool amx_usable() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return usable() && __builtin_cpu_supports("amx-bf16") &&
         syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// row_attention.cpp
torch::Tensor row_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale);
// rms_norm.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
// argmax.cpp
torch::Tensor argmax_rows(torch::Tensor x);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &linear<4, true>, "4-bit weight-only linear layer (AMX)");
  m.def("q8_linear", &linear<8, true>, "8-bit weight-only linear layer (AMX)");
  m.def("q4_linear_avx512", &linear<4, false>, "4-bit weight-only linear layer (AVX512-BF16)");
  m.def("q8_linear_avx512", &linear<8, false>, "8-bit weight-only linear layer (AVX512-BF16)");
  m.def("row_attention", &row_attention, "attention of a few rows, bits independent of the keys' layout");
  m.def("rms_norm", &rms_norm, "RMSNorm of bfloat16 rows, each row alone");
  m.def("argmax_rows", &argmax_rows, "index of each row's maximum, as torch.argmax");
  m.def("usable", &usable, "whether this CPU can run the kernels (AVX512-BF16)");
  m.def("amx_usable", &amx_usable, "whether this CPU can also run the AMX linear layers");
}
