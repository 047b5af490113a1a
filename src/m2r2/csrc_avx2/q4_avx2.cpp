// 4-bit and 8-bit weight-only linear layers for CPUs with AVX2 but no AVX-512 (AMD Zen 2/3, Intel
// before Ice Lake): the q4-avx2 kernel.
//
// Why: such a CPU has no bf16 arithmetic. torch's 4-bit GEMM there de-quantizes every weight to
// float for every call and every 4 rows (a SmolLM2 step ~50 ms on one Zen 3 core, 8 rows 3.4 steps),
// and a bf16 LM head runs at float32 speed. The integer dot products AVX2 does have
// (VPMADDUBSW: unsigned x signed bytes, 32 products an instruction) need 8-bit inputs, so, as
// llama.cpp does for these very GGUF blocks (Q4_1 x Q8_1, Q8_0 x Q8_0), each row's inputs are rounded
// per group of 32 to int8 with step dx = max|x| / 127. Per column and group a weight is q * d + m
// (4-bit, q in 0..15) or q * d (8-bit, q in -127..127), so a group adds
//   d * dx * sum(q * qx) + m * dx * sum(qx)
// to an output. The integer sums are exact, and the float32 terms are added group by group in the same
// order whatever the number of rows: a row's bits never depend on the pass (verification stays
// lossless: tested, and probed once per shape by the Python side). It is a different rounding of the
// model than the bf16 kernels' (measured against the float32 reference in BENCHMARKS.md).
//
// Layouts (written by m2r2.kernels._AmxLinear.pack for products "avx2"), per block of 8 columns:
//   4-bit qbytes : uint8 [N/8, K/8, 32]: per 8 inputs 8j..8j+7, byte 4c+i holds column c's input 8j+i
//                  in its low nibble and input 8j+4+i in its high nibble.
//   8-bit qbytes : int8 [N/8, K/4, 32]: per 4 inputs 4j..4j+3, byte 4c+i is column c's input 4j+i.
//   scales       : half [N/8, K/32, terms, 8]: per group the 8 steps d (then, 4-bit, the 8 minima m).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "simd2.h"

#include <vector>

namespace {

using namespace m2r2_avx2;

constexpr int64_t NB = 8;  // columns per block: one register of 8 float32 sums
constexpr int MB = 4;      // rows per pass over a block's weights
#ifndef M2R2_PREFETCH
#define M2R2_PREFETCH 4096
#endif
constexpr int64_t PREFETCH = M2R2_PREFETCH;

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Each row's inputs as int8 per group of 32: q = round(x / dx), dx = max|x| / 127 (0 for a zero
// group), and dx * sum(q) for the minima's term. Row by row, so a row's numbers are its own.
void quantize_rows(const at::BFloat16* x, int64_t M, int64_t K, int8_t* q, float* step, float* qsum) {
  const int64_t G = K / 32;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes packs' lane interleave
  for (int64_t i = 0; i < M; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const at::BFloat16* xg = x + i * K + g * 32;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int t = 0; t < 4; ++t) {
        v[t] = load8(xg + 8 * t, 8);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[t], abs_mask));
      }
      const float m = hmax(amax);
      const float d = m / 127.0f, inv = m > 0.0f ? 127.0f / m : 0.0f;
      __m256i qi[4];
      for (int t = 0; t < 4; ++t)
        qi[t] = _mm256_cvtps_epi32(
            _mm256_round_ps(_mm256_mul_ps(v[t], _mm256_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const int32_t s = hsum(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
      const __m256i w16 = _mm256_packs_epi32(qi[0], qi[1]), w16b = _mm256_packs_epi32(qi[2], qi[3]);
      const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, w16b), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * K + g * 32), b8);
      step[i * G + g] = d;
      qsum[i * G + g] = d * static_cast<float>(s);
    }
}

// 4 int8 inputs repeated over a register, loaded straight into it (a load-port broadcast, no ALU op)
inline __m256i broadcast4(const int8_t* p) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
}

// One block of 8 columns for R rows (xq, step, qsum at the first row; row strides K and G): every
// group's integer sums per row, then its float32 terms, group by group.
template <int BITS, int R>
inline void block_rows(const uint8_t* qb, const at::Half* sb, const int8_t* xq, const float* step, const float* qsum,
                       int64_t K, int64_t G, uint16_t* y, int64_t N) {
  constexpr int64_t gbytes = BITS == 4 ? 128 : 256;  // one group's weights
  constexpr int terms = BITS == 4 ? 2 : 1;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 out[R];
  for (int r = 0; r < R; ++r) out[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* qg = qb + g * gbytes;
    for (int64_t line = 0; line < gbytes; line += 64)  // the weights PREFETCH bytes ahead (blocks are contiguous):
      // a one-row pass is bound by memory latency, not by the dot products (experiments/verify_cost.py)
      _mm_prefetch(reinterpret_cast<const char*>(qg + PREFETCH + line), _MM_HINT_T0);
    __m256i sums[R];
    if constexpr (BITS == 4) {
      // 16-bit lanes take 16 products of at most 15 * 127 each: no overflow before the widening add
      __m256i s16[R];
      for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      // kept rolled: unrolled, the compiler computed all 32 products before adding them and spilled them
#pragma GCC unroll 1
      for (int h = 0; h < 4; ++h) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 32 * h));
        const __m256i lo = _mm256_and_si256(bytes, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + r * K + g * 32 + 8 * h;
          const __m256i pa = _mm256_maddubs_epi16(lo, broadcast4(xr));
          const __m256i pb = _mm256_maddubs_epi16(hi, broadcast4(xr + 4));
          s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(pa, pb));
        }
      }
      for (int r = 0; r < R; ++r) sums[r] = _mm256_madd_epi16(s16[r], ones);
    } else {
      // signed x signed: |w| times x with w's sign (two products of 127 * 127 fit a 16-bit lane)
      for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 32 * j));
        const __m256i aw = _mm256_abs_epi8(w);
        for (int r = 0; r < R; ++r) {
          const __m256i sx = _mm256_sign_epi8(broadcast4(xq + r * K + g * 32 + 4 * j), w);
          sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
        }
      }
    }
    const at::Half* s = sb + g * terms * NB;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
    for (int r = 0; r < R; ++r) {
      const __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(step[r * G + g]));
      out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), scaled, out[r]);
    }
    if constexpr (BITS == 4) {
      const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + NB)));
      for (int r = 0; r < R; ++r) out[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(qsum[r * G + g]), out[r]);
    }
  }
  for (int r = 0; r < R; ++r) store8_bf16(y + r * N, out[r]);
}

// y [M, N] = x [M, K] times a packed weight (N = blocks * 8), raw pointers: what the op below and the
// fused decoder block (block_avx2.cpp) share, so both give the same bits.
template <int BITS>
void linear_rows(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* qp, const at::Half* sp, int64_t blocks,
                 uint16_t* yp) {
  constexpr int64_t terms = BITS == 4 ? 2 : 1;
  const int64_t N = blocks * NB, G = K / 32;
  if (M == 0) return;
  std::vector<int8_t> xq(M * K);
  std::vector<float> step(M * G), qsum(M * G);
  quantize_rows(x, M, K, xq.data(), step.data(), qsum.data());
  const int64_t block_bytes = G * (BITS == 4 ? 128 : 256);
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int rows = static_cast<int>(std::min<int64_t>(MB, M - m0));
        const uint8_t* qb = qp + b * block_bytes;
        const at::Half* sb = sp + b * G * terms * NB;
        const int8_t* xr = xq.data() + m0 * K;
        const float *st = step.data() + m0 * G, *qs = qsum.data() + m0 * G;
        uint16_t* yb = yp + m0 * N + b * NB;
        switch (rows) {
          case 4: block_rows<BITS, 4>(qb, sb, xr, st, qs, K, G, yb, N); break;
          case 3: block_rows<BITS, 3>(qb, sb, xr, st, qs, K, G, yb, N); break;
          case 2: block_rows<BITS, 2>(qb, sb, xr, st, qs, K, G, yb, N); break;
          default: block_rows<BITS, 1>(qb, sb, xr, st, qs, K, G, yb, N); break;
        }
      }
  });
}

template <int BITS>
torch::Tensor linear(torch::Tensor x, torch::Tensor qbytes, torch::Tensor scales) {
  constexpr int64_t terms = BITS == 4 ? 2 : 1;
  constexpr int64_t per_byte = BITS == 4 ? 8 : 4;  // inputs per 32-byte row of qbytes
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(qbytes.element_size() == 1 && qbytes.is_contiguous() && qbytes.dim() == 3 && qbytes.size(2) == 32,
              "qbytes: bytes [N/8, K/", per_byte, ", 32]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 4,
              "scales: half [N/8, K/32, terms, 8]");
  const int64_t M = x.size(0), K = x.size(1), blocks = qbytes.size(0), N = blocks * NB, G = K / 32;
  TORCH_CHECK(K % 32 == 0 && qbytes.size(1) * per_byte == K, "packed weight does not match x");
  TORCH_CHECK(scales.size(0) == blocks && scales.size(1) == G && scales.size(2) == terms && scales.size(3) == NB,
              "scales do not match the packed weight");
  auto y = torch::empty({M, N}, x.options());
  linear_rows<BITS>(x.data_ptr<at::BFloat16>(), M, K, static_cast<const uint8_t*>(qbytes.data_ptr()),
                    scales.data_ptr<at::Half>(), blocks, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  return y;
}

}  // namespace

namespace m2r2_avx2 {
void linear_rows(int bits, const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* qbytes, const at::Half* scales,
                 int64_t blocks, uint16_t* y) {
  if (bits == 4)
    ::linear_rows<4>(x, M, K, qbytes, scales, blocks, y);
  else
    ::linear_rows<8>(x, M, K, qbytes, scales, blocks, y);
}
}  // namespace m2r2_avx2

// Whether this CPU runs these kernels (AVX2 integer dot products, FMA, F16C half scales).
bool usable() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// rows_avx2.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor argmax_rows(torch::Tensor x);
torch::Tensor row_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale);
torch::Tensor silu_mul(torch::Tensor gu);
// block_avx2.cpp
void bind_block(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_linear_avx2", &linear<4>, "4-bit weight-only linear layer, int8 inputs per group of 32 (AVX2)");
  m.def("q8_linear_avx2", &linear<8>, "8-bit weight-only linear layer, int8 inputs per group of 32 (AVX2)");
  m.def("rms_norm", &rms_norm, "RMSNorm of bfloat16 rows, each row alone");
  m.def("argmax_rows", &argmax_rows, "index of each row's maximum, as torch.argmax");
  m.def("row_attention", &row_attention, "attention of a few rows, bits independent of the keys' layout");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of bfloat16 rows [gate | up]");
  bind_block(m);
  m.def("usable", &usable, "whether this CPU can run the kernels (AVX2, FMA, F16C)");
}
