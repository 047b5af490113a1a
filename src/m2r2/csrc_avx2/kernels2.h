// Raw-pointer entry points of the csrc_avx2 kernels: the ops bound in q4_avx2.cpp and the fused decoder
// block (block_avx2.cpp) call the same code, so a row gets the same bits either way.
#pragma once

#include <torch/extension.h>

namespace m2r2_avx2 {

// y [M, blocks * 8] (bfloat16 bits) = x [M, K] times a packed 4-bit (bits 4) or 8-bit (bits 8) weight
void linear_rows(int bits, const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* qbytes, const at::Half* scales,
                 int64_t blocks, uint16_t* y);
// Whether linear_rows runs its loop's AVX512-VNNI build (q4_vnni.cpp): the CPU has AVX512-VNNI and VL and
// neither M2R2_NO_VNNI=1 nor set_vnni(false) turned it off. Either build gives a row the same bits.
bool vnni_in_use();
// turn the VNNI build on (where the CPU has it) or off; returns whether it was in use
bool set_vnni(bool on);
// blocks [b0, b1) of linear_rows' output from int8 inputs, on the VNNI build (bits 4 or 8)
void block_range_vnni(int bits, const uint8_t* qbytes, const at::Half* scales, const int8_t* xq, const float* step,
                      const float* qsum, int64_t M, int64_t K, int64_t blocks, uint16_t* y, int64_t b0, int64_t b1);
// RMSNorm of `rows` rows of D
void rms_norm_rows(const at::BFloat16* x, const at::BFloat16* w, int64_t rows, int64_t D, float eps, uint16_t* out);
// row attention: q [B, H, T, D] float32; k, v float32 or bfloat16 (`bf16`) with strides kv = {k's b, h, s; v's b,
// h, s}; mask [T, S] per batch item (item stride mb); out [B, T, H, D] float32
void attention_rows(const float* q, const void* k, const void* v, bool bf16, const int64_t* kv, const bool* mask,
                    int64_t mb, float* out, int64_t B, int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t S, float sc);
// silu(gate) * up of rows [gate (m) | up (m)] into [rows, m]
void silu_mul_rows(const at::BFloat16* gu, int64_t rows, int64_t m, uint16_t* out);

}  // namespace m2r2_avx2
