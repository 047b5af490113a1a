// 4-bit weight-only linear layer whose cost is nearly flat in the number of rows (1..16).
//
// Why: a verify pass runs k rows through every layer. torch's CPU int4 kernel de-quantizes the
// weights again for every 4 rows, so 8 rows cost ~2 one-row steps. Here each group of 32 inputs x
// 64 output columns is de-quantized once per call into a 4 KB bf16 buffer (the VNNI pair layout AMX
// reads) and multiplied by up to 16 rows at once on the AMX tiles (TDPBF16PS: 1 row costs what 16
// cost), while the next group is de-quantized into a second buffer and the weights a few groups
// ahead are prefetched. Every output is summed group by group in the same order whatever the number
// of rows, so a row's bits do not depend on the pass (tested; the Python side also probes it once
// per shape). Parallel over column blocks with torch's thread pool (at::parallel_for, OpenMP).
//
// Layout (written by m2r2.kernels.AmxInt4Linear):
//   qbytes : uint8 [N/64, K/2, 64]  per column block and pair of inputs (2p, 2p+1): 64 bytes =
//            128 nibbles; lane j (0..127) is column j/2 at input 2p + j%2; byte i holds lanes
//            i (low nibble) and i + 64 (high nibble).
//   scales : half  [N/64, K/32, 2, 64]  per column block and group of 32 inputs: the 64 steps d,
//            then the 64 minima m; a weight is fma(q, d, m) in float32, rounded to bf16.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t NB = 64;  // columns per block
constexpr int64_t MB = 16;  // rows per pass over the weights (one AMX tile of rows)
#ifndef PREFETCH_GROUPS
#define PREFETCH_GROUPS 4
#endif
constexpr int64_t PREFETCH = PREFETCH_GROUPS;  // groups of 32 inputs

// De-quantize one group (32 inputs x 64 columns) into w: bf16 [16 input pairs][64 columns][2].
inline void dequant_group(const uint8_t* q, const at::Half* s, at::BFloat16* w) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // lane j of a 16-lane chunk reads column j / 2 (+ 8 for the odd chunk of a 16-column scale vector)
  const __m512i dup0 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dup1 = _mm512_add_epi32(dup0, _mm512_set1_epi32(8));
  // byte 4l of chunk c's lanes takes byte 16c + l (the other bytes zeroed): a zero-extension in one shuffle
  const __mmask64 every4 = 0x1111111111111111ULL;
  __m512i spread[4];
  for (int c = 0; c < 4; ++c)
    spread[c] = _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                 _mm512_set1_epi32(16 * c));
  __m512 d[8], m[8];
  for (int t = 0; t < 4; ++t) {  // 16 columns each
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 * t)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + NB + 16 * t)));
    d[2 * t] = _mm512_permutexvar_ps(dup0, dv), d[2 * t + 1] = _mm512_permutexvar_ps(dup1, dv);
    m[2 * t] = _mm512_permutexvar_ps(dup0, mv), m[2 * t + 1] = _mm512_permutexvar_ps(dup1, mv);
  }
  for (int p = 0; p < 16; ++p) {
    const __m512i bytes = _mm512_loadu_si512(q + p * NB);
    const __m512i lo = _mm512_and_si512(bytes, low4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
    __m512 v[8];
    for (int c = 0; c < 4; ++c) {
      v[c] = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(every4, spread[c], lo));
      v[c + 4] = _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(every4, spread[c], hi));
    }
    at::BFloat16* out = w + p * 2 * NB;
    for (int c = 0; c < 8; c += 2) {
      const __m512 a = _mm512_fmadd_ps(v[c], d[c], m[c]);
      const __m512 b = _mm512_fmadd_ps(v[c + 1], d[c + 1], m[c + 1]);
      _mm512_store_si512(out + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

}  // namespace

// AMX tile configuration: tiles 0-3 accumulate rows x 16 columns each (float32), tile 4 holds
// rows x 32 inputs of x, tiles 5-6 hold 32 inputs x 16 columns of de-quantized weights (VNNI pairs).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) cfg.colsb[t] = 64, cfg.rows[t] = static_cast<uint8_t>(rows);
  for (int t = 5; t < 7; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

// y[M, N] (bf16) = x[M, K] (bf16) @ W^T for the packed 4-bit W [N, K]. Per block of 64 columns and
// 16 rows: for each group of 32 inputs, de-quantize its 32 x 64 weights into a 4 KB buffer (L1) and
// accumulate with four AMX dot products; the order of the sums never depends on M.
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qbytes, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(qbytes.scalar_type() == at::kByte && qbytes.is_contiguous() && qbytes.dim() == 3, "qbytes: uint8 [N/64, K/2, 64]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 4, "scales: half [N/64, K/32, 2, 64]");
  const int64_t M = x.size(0), K = x.size(1), blocks = qbytes.size(0), N = blocks * NB;
  TORCH_CHECK(K % 32 == 0 && qbytes.size(1) * 2 == K && qbytes.size(2) == NB, "packed weight does not match x");
  TORCH_CHECK(scales.size(0) == blocks && scales.size(1) * 32 == K && scales.size(2) == 2 && scales.size(3) == NB,
              "scales do not match the packed weight");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const uint8_t* qp = qbytes.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t groups = K / 32;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    // two group buffers: AMX reads one while the next group is de-quantized into the other (a tile
    // load right after the stores that fill its buffer waited for them)
    alignas(64) at::BFloat16 w[2][16 * 2 * NB];  // a group: 16 input pairs x 64 columns x 2
    alignas(64) float c[MB * NB];
    int configured = 0;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int rows = static_cast<int>(std::min(MB, M - m0));
      if (rows != configured) configure(rows), configured = rows;
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* qb = qp + b * (K / 2) * NB;
        const at::Half* sb = sp + b * groups * 2 * NB;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        dequant_group(qb, sb, w[0]);
        for (int64_t g = 0; g < groups; ++g) {
          if (g + 1 < groups) {
            // the weights PREFETCH groups ahead (past the block's end: the next block's first groups);
            // the hardware prefetcher alone left the loop waiting on memory
            const uint8_t* ahead = qb + (g + PREFETCH) * 16 * NB;
            for (int l = 0; l < 16; ++l) _mm_prefetch(reinterpret_cast<const char*>(ahead + l * NB), _MM_HINT_T0);
            const char* sahead = reinterpret_cast<const char*>(sb + (g + PREFETCH) * 2 * NB);
            for (int l = 0; l < 4; ++l) _mm_prefetch(sahead + 64 * l, _MM_HINT_T0);
            dequant_group(qb + (g + 1) * 16 * NB, sb + (g + 1) * 2 * NB, w[(g + 1) & 1]);
          }
          const at::BFloat16* wg = w[g & 1];
          _tile_loadd(4, xp + m0 * K + g * 32, K * sizeof(at::BFloat16));
          _tile_loadd(5, wg, 2 * NB * sizeof(at::BFloat16));
          _tile_loadd(6, wg + 32, 2 * NB * sizeof(at::BFloat16));
          _tile_dpbf16ps(0, 4, 5);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(5, wg + 64, 2 * NB * sizeof(at::BFloat16));
          _tile_loadd(6, wg + 96, 2 * NB * sizeof(at::BFloat16));
          _tile_dpbf16ps(2, 4, 5);
          _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, c, NB * sizeof(float));
        _tile_stored(1, c + 16, NB * sizeof(float));
        _tile_stored(2, c + 32, NB * sizeof(float));
        _tile_stored(3, c + 48, NB * sizeof(float));
        for (int i = 0; i < rows; ++i)
          for (int64_t j = 0; j < NB; j += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + (m0 + i) * N + b * NB + j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + i * NB + j)));
      }
    }
    _tile_release();
  });
  return y;
}

// Whether this CPU runs the kernel: AVX512-BF16 and VBMI for the de-quantization, AMX for the products.
// (Linux gives a process AMX state only on request: ARCH_REQ_XCOMP_PERM for XTILEDATA.)
bool usable() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("amx-bf16") && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear", &q4_linear, "4-bit weight-only linear layer (AMX)");
  m.def("usable", &usable, "whether this CPU can run q4_linear");
}
