// 4-bit and 8-bit weight-only linear layers for CPUs with AVX2 (AMD Zen 2-5, Intel since Haswell; the
// default kernel wherever AMX is missing): the q4-avx2 kernel. Its block loop is q4_rows.h (built again in
// q4_vnni.cpp for AVX512-VNNI CPUs, chosen here at run time).
//
// Why: a CPU without AVX-512 (Zen 2/3) has no bf16 arithmetic. torch's 4-bit GEMM there de-quantizes every weight to
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
// Both then with the groups of blocks 2p and 2p+1 interleaved (m2r2.kernels.interleave_pairs; an odd last
// block alone): the AVX512-VNNI loop multiplies a pair in one 512-bit register (q4_rows.h).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "kernels2.h"
#include "q4_rows.h"
#include "simd2.h"

#include <atomic>
#include <cstdlib>
#include <vector>

namespace {

using namespace m2r2_avx2;

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Each row's inputs as int8 per group of 32 (groups g0..g1-1): q = round(x / dx), dx = max|x| / 127 (0 for a
// zero group), and dx * sum(q) for the minima's term; with `offset`, q + 128 as unsigned bytes (the VNNI 8-bit
// loop's inputs, q4_rows.h). Group by group, so a row's numbers are its own and do not depend on the split.
void quantize_groups_(const at::BFloat16* x, int64_t M, int64_t K, int64_t g0, int64_t g1, bool offset, int8_t* q,
                      float* step, float* qsum) {
  const int64_t G = K / 32;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes packs' lane interleave
  const __m256i flip = _mm256_set1_epi8(offset ? static_cast<char>(0x80) : 0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t g = g0; g < g1; ++g) {
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
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * K + g * 32), _mm256_xor_si256(b8, flip));
      step[i * G + g] = d;
      qsum[i * G + g] = d * static_cast<float>(s);
    }
}

// y [M, N] = x [M, K] times a packed weight (N = blocks * 8), raw pointers: what the op below and the
// fused decoder block (block_avx2.cpp) share, so both give the same bits.
template <int BITS>
void linear_rows(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* qp, const at::Half* sp, int64_t blocks,
                 uint16_t* yp) {
  const int64_t G = K / 32;
  if (M == 0) return;
  // the rows' int8 inputs and per-group terms, written whole here (the calling thread's scratch, see Scratch)
  thread_local Scratch<int8_t> xq_rows;
  thread_local Scratch<float> step_rows, qsum_rows;
  xq_rows.fit(M * K), step_rows.fit(M * G), qsum_rows.fit(M * G);
  int8_t* xq = xq_rows.data();
  float *step = step_rows.data(), *qsum = qsum_rows.data();
  const Loop loop = loop_for(M, blocks);
  parallel_rows(M, [&](int64_t r0, int64_t r1) {
    quantize_groups_(x + r0 * K, r1 - r0, K, 0, G, offset_inputs(BITS, loop), xq + r0 * K, step + r0 * G, qsum + r0 * G);
  });
  at::parallel_for(0, (blocks + 1) / 2, 8, [&](int64_t p0, int64_t p1) {  // whole pairs of blocks (q4_rows.h)
    linear_blocks(loop, BITS, qp, sp, xq, step, qsum, M, K, blocks, yp, 2 * p0, std::min(2 * p1, blocks));
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

// y [M, N] = x [M, K] times a packed 4- or 8-bit weight on the prefill's AMX-BF16 tiles (prefill_amx.cpp): the fused
// blocks' prefill linears as an op, for tests and timings (even block counts; where bf16_prefill_in_use())
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor qbytes, torch::Tensor scales, int64_t bits) {
  TORCH_CHECK(m2r2_avx2::bf16_prefill_in_use(), "the prefill's AMX-BF16 tiles are not in use here");
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), blocks = qbytes.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0 && blocks % 2 == 0 && qbytes.is_contiguous() && qbytes.numel() == blocks * G * (bits == 4 ? 128 : 256),
              "packed weight does not match x");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == blocks * G * (bits == 4 ? 2 : 1) * NB,
              "scales do not match the packed weight");
  auto y = torch::empty({M, blocks * NB}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks / 2, 1, [&](int64_t p0, int64_t p1) {
    m2r2_avx2::block_range_bf16(static_cast<int>(bits), static_cast<const uint8_t*>(qbytes.data_ptr()),
                                scales.data_ptr<at::Half>(), xp, M, K, blocks, yp, 2 * p0, 2 * p1);
  });
  return y;
}

}  // namespace

namespace m2r2_avx2 {
namespace {
bool cpu_has_vnni() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"); }
std::atomic<bool> vnni_on{cpu_has_vnni() && !turned_off("M2R2_NO_VNNI")};
}  // namespace

bool vnni_in_use() { return vnni_on.load(std::memory_order_relaxed); }
bool set_vnni(bool on) { return vnni_on.exchange(on && cpu_has_vnni()); }

Loop loop_for(int64_t M, int64_t blocks) {
  // AMX tiles for passes of amx_min_rows() rows or more, whole pairs of blocks only (every layer of the bundled
  // models); the same integers and bits as the loops (q4_amx_rows.cpp)
  if (M >= amx_min_rows() && blocks % 2 == 0 && amx_rows_in_use()) return Loop::amx;
  return vnni_in_use() ? Loop::vnni : Loop::avx2;
}

void quantize_groups(const at::BFloat16* x, int64_t M, int64_t K, int64_t g0, int64_t g1, bool offset, int8_t* q,
                     float* step, float* qsum) {
  quantize_groups_(x, M, K, g0, g1, offset, q, step, qsum);
}

void linear_blocks(Loop loop, int bits, const uint8_t* qp, const at::Half* sp, const int8_t* xq, const float* step,
                   const float* qsum, int64_t M, int64_t K, int64_t blocks, uint16_t* yp, int64_t b0, int64_t b1) {
  if (loop == Loop::amx)
    block_range_amx(bits, qp, sp, xq, step, qsum, M, K, blocks, yp, b0, b1);
  else if (loop == Loop::vnni)
    block_range_vnni(bits, qp, sp, xq, step, qsum, M, K, blocks, yp, b0, b1);
  else if (bits == 4)
    block_range<4>(qp, sp, xq, step, qsum, M, K, blocks, yp, b0, b1);
  else
    block_range<8>(qp, sp, xq, step, qsum, M, K, blocks, yp, b0, b1);
}

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
  m.def("vnni_in_use", &m2r2_avx2::vnni_in_use, "whether the 4/8-bit linears run on AVX512-VNNI (same bits)");
  m.def("set_vnni", &m2r2_avx2::set_vnni, "turn the AVX512-VNNI loop on (where the CPU has it) or off");
  m.def("amx_rows_in_use", &m2r2_avx2::amx_rows_in_use,
        "whether the 4/8-bit linears sum passes of several rows on AMX tiles (same bits)");
  m.def("set_amx_rows", &m2r2_avx2::set_amx_rows, "turn the AMX sums on (where the CPU has AMX-INT8) or off");
  m.def("set_amx_min_rows", &m2r2_avx2::set_amx_min_rows,
        "the fewest rows a pass sums on AMX tiles (default 10); returns the previous value");
  m.def("bf16_linear", &bf16_linear, "4/8-bit weight-only linear layer on the prefill's AMX-BF16 tiles (bf16 inputs)");
  m.def("bf16_prefill_in_use", &m2r2_avx2::bf16_prefill_in_use,
        "whether the fused blocks run a prefill's linears on AMX-BF16 tiles (bits of their own, every method's)");
  m.def("set_bf16_prefill", &m2r2_avx2::set_bf16_prefill,
        "turn the prefill's AMX-BF16 tiles on (where the CPU has them) or off; returns whether they were in use");
  m.def("prefill_min_rows", [] { return m2r2_avx2::PREFILL_MIN_ROWS; },
        "the fewest rows of a fused pass that count as a prefill (m2r2.model.ROW_INVARIANT_MAX_ROWS + 1)");
  m.def("avx512_attention_in_use", &m2r2_avx2::avx512_attention_in_use,
        "whether the row attention runs its AVX-512 build (same bits)");
  m.def("set_avx512_attention", &m2r2_avx2::set_avx512_attention,
        "turn the AVX-512 row attention on (where the CPU has AVX512-BF16) or off");
  m.def("amx_attention_in_use", &m2r2_avx2::amx_attention_in_use,
        "whether the row attention's scores run on AMX tiles (a pass's rows keep one-row decoding's bits)");
  m.def("set_amx_attention", &m2r2_avx2::set_amx_attention,
        "turn the AMX row attention on (where the CPU has AMX-BF16) or off");
  m.def("set_amx_attention_min_keys", &m2r2_avx2::set_amx_attention_min_keys,
        "the fewest keys a query vector sees for its attention to run on AMX tiles (default 448); returns the previous");
  m.def("avx512_silu_in_use", &m2r2_avx2::avx512_silu_in_use,
        "whether SwiGLU's product runs its AVX-512 build (same bits)");
  m.def("set_avx512_silu", &m2r2_avx2::set_avx512_silu,
        "turn the AVX-512 SwiGLU product on (where the CPU has AVX-512) or off");
  m.def("usable", &usable, "whether this CPU can run the kernels (AVX2, FMA, F16C)");
}
