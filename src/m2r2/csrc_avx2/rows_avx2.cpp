// The per-row helpers of csrc/ (RMSNorm, greedy argmax) for CPUs with AVX2 but no AVX-512.
//
// Why: without them a SmolLM2 step on an AVX2 CPU spends ~60 us in each of its 61 torch RMSNorm calls
// (bf16 there runs through float32 conversions) and ~0.1 ms a row in torch's argmax over 49k logits.
// The arithmetic is csrc/rms_norm.cpp's and csrc/argmax.cpp's with 8 lanes: a row's bits depend on that
// row alone, and the argmax keeps torch's rule (the first of equal maxima; the first NaN wins).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "simd2.h"
#include "kernels2.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace {

using namespace m2r2_avx2;


template <typename T>
int64_t argmax_row(const T* row, int64_t V) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < V; j += 8) {
    const int64_t n = std::min<int64_t>(8, V - j);
    __m256 x = load8(row + j, n);
    const int nan = _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) & ((1 << n) - 1);
    if (nan) return j + __builtin_ctz(nan);  // the first NaN (torch treats NaN as the maximum)
    if (n < 8) {  // lanes past the row's end count as -inf, not as the 0 they were loaded as
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
      x = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, valid);
    }
    mx = _mm256_max_ps(mx, x);
  }
  const float best_value = hmax(mx);
  const __m256 best = _mm256_set1_ps(best_value);
  for (int64_t j = 0; j < V; j += 8) {
    const int64_t n = std::min<int64_t>(8, V - j);
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(row + j, n), best, _CMP_EQ_OQ)) & ((1 << n) - 1);
    if (hit) return j + __builtin_ctz(hit);
  }
  return 0;  // not reached: the maximum is in the row
}

}  // namespace

namespace m2r2_avx2 {
float rms_scale(const at::BFloat16* row, int64_t D, float e) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 v = load8(row + d, D - d);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  return 1.0f / std::sqrt(hsum(acc) / static_cast<float>(D) + e);
}

void rms_norm_range(const at::BFloat16* row, const at::BFloat16* wp, float scale, int64_t c0, int64_t c1, uint16_t* op) {
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t d = c0; d < c1; d += 8) {
    const int64_t n = std::min<int64_t>(8, c1 - d);
    const __m256 v = round_bf16(_mm256_mul_ps(load8(row + d, n), s));
    uint16_t t[8];
    store8_bf16(t, _mm256_mul_ps(v, load8(wp + d, n)));
    std::memcpy(op + d, t, n * sizeof(uint16_t));
  }
}

int64_t argmax_bf16(const uint16_t* row, int64_t V) { return argmax_row(reinterpret_cast<const at::BFloat16*>(row), V); }

// RMSNorm of `rows` bfloat16 rows of D (csrc/rms_norm.cpp's order), raw pointers: shared by the op below
// and the fused decoder block (block_avx2.cpp).
void rms_norm_rows(const at::BFloat16* xp, const at::BFloat16* wp, int64_t rows, int64_t D, float e, uint16_t* op) {
  parallel_rows(rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_range(xp + r * D, wp, rms_scale(xp + r * D, D, e), 0, D, op + r * D);
  });
}
}  // namespace m2r2_avx2

// x [..., D] bfloat16 contiguous; w [D] bfloat16. Returns bfloat16 like x (csrc/rms_norm.cpp's order).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bfloat16");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 1, "w: contiguous bfloat16 [D]");
  const int64_t D = w.size(0);
  TORCH_CHECK(x.size(-1) == D, "x's last dimension must equal the weight's");
  auto out = torch::empty_like(x);
  m2r2_avx2::rms_norm_rows(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), D ? x.numel() / D : 0, D,
                           static_cast<float>(eps), reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

// x [..., V] float32 or bfloat16, contiguous. Returns int64 [...].
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous() && x.dim() >= 1,
              "x: contiguous float32 or bfloat16 [..., V]");
  const int64_t V = x.size(-1);
  TORCH_CHECK(V > 0, "argmax of an empty row");
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto out = torch::empty(sizes, x.options().dtype(at::kLong));
  const int64_t rows = x.numel() / V;
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      op[r] = x.scalar_type() == at::kFloat ? argmax_row(x.data_ptr<float>() + r * V, V)
                                            : argmax_row(x.data_ptr<at::BFloat16>() + r * V, V);
  });
  return out;
}

namespace {

inline __m256 load_row8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_row8(const at::BFloat16* p) { return load8(p, 8); }

// Scores of four keys (k4) for GN query vectors (q, rows qstride apart) into e (rows estride apart): each
// key's multiply-adds over D in chunks of 8 into its own register, as one score alone is summed. GN <= 3 and
// four keys fill AVX2's 16 registers (12 sums, 3 query chunks, the widened key chunk), so nothing spills and
// a key chunk is widened once for the GN vectors.
template <int GN, typename KT>
inline void score4(const float* q, int64_t qstride, const KT* const* k4, int64_t D, float sc, float* e, int64_t estride) {
  __m256 acc[GN][4];
  for (int j = 0; j < GN; ++j)
    for (int c = 0; c < 4; ++c) acc[j][c] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qd[GN];
    for (int j = 0; j < GN; ++j) qd[j] = _mm256_loadu_ps(q + j * qstride + d);
    for (int c = 0; c < 4; ++c) {
      const __m256 kc = load_row8(k4[c] + d);
      for (int j = 0; j < GN; ++j) acc[j][c] = _mm256_fmadd_ps(qd[j], kc, acc[j][c]);
    }
  }
  for (int j = 0; j < GN; ++j) _mm_storeu_ps(e + j * estride, _mm_mul_ps(hsum4(acc[j]), _mm_set1_ps(sc)));
}

// GN query vectors' weighted values over CH chunks of 8 output lanes from d0, keys in cache order (each
// lane adds its keys' terms in that order: the bits of one vector at a time), divided by the vectors' sums
// of exponentials. GN = 3, CH = 4: 12 sums, 3 weights and one widened value chunk in 16 registers.
template <int GN, int CH, typename KT>
inline void weigh(const float* e, int64_t estride, const int32_t* keys, int64_t n, const KT* vb, int64_t vs,
                  int64_t d0, const float* tots, float* out, int64_t D) {
  __m256 acc[GN][CH];
  for (int j = 0; j < GN; ++j)
    for (int c = 0; c < CH; ++c) acc[j][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const KT* v = vb + keys[i] * vs + d0;
    __m256 p[GN];
    for (int j = 0; j < GN; ++j) p[j] = _mm256_set1_ps(e[j * estride + i]);
    for (int c = 0; c < CH; ++c) {
      const __m256 vc = load_row8(v + 8 * c);
      for (int j = 0; j < GN; ++j) acc[j][c] = _mm256_fmadd_ps(p[j], vc, acc[j][c]);
    }
  }
  for (int j = 0; j < GN; ++j) {
    const __m256 inv = _mm256_set1_ps(tots[j]);
    for (int c = 0; c < CH; ++c) _mm256_storeu_ps(out + j * D + d0 + 8 * c, _mm256_div_ps(acc[j][c], inv));
  }
}

template <int GN, typename KT>
inline void weigh_all(const float* e, int64_t estride, const int32_t* keys, int64_t n, const KT* vb, int64_t vs,
                      const float* tots, float* out, int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) weigh<GN, 4>(e, estride, keys, n, vb, vs, d0, tots, out, D);
  for (; d0 < D; d0 += 8) weigh<GN, 1>(e, estride, keys, n, vb, vs, d0, tots, out, D);
}

// GN vectors' sums of exponentials (rows estride apart), each key by key in cache order, side by side
template <int GN>
inline void sum_keys(const float* e, int64_t estride, int64_t n, float* tots) {
  float t[GN] = {};
  for (int64_t i = 0; i < n; ++i)
    for (int j = 0; j < GN; ++j) t[j] += e[j * estride + i];
  for (int j = 0; j < GN; ++j) tots[j] = t[j];
}

// One query row of one key head: its G query vectors attend the allowed keys in increasing cache
// position, every sum in that order (a score's multiply-adds over D in chunks of 8, one horizontal
// sum; the sum of exponentials and each output lane's weighted values key by key), so a row's bits
// are the same wherever its keys sit and whatever rows run beside it.
template <typename KT>
void attend_row(const float* q, int64_t qstride, const KT* kb, int64_t ks, const KT* vb, int64_t vs, const bool* m,
                int64_t S, int64_t G, int64_t D, float sc, float* out, std::vector<int32_t>& keys,
                std::vector<float>& e, std::vector<float>& tots, bool wide) {
  keys.resize(S);
  int64_t n = 0, s = 0;
  for (; s + 8 <= S; s += 8) {  // eight allowed slots at once where a run of them is (a verified prefix)
    uint64_t eight;
    std::memcpy(&eight, m + s, 8);
    if (eight == 0x0101010101010101ull) {
      for (int j = 0; j < 8; ++j) keys[n + j] = static_cast<int32_t>(s + j);
      n += 8;
    } else if (eight != 0) {
      for (int64_t j = s; j < s + 8; ++j)
        if (m[j]) keys[n++] = static_cast<int32_t>(j);
    }
  }
  for (; s < S; ++s)
    if (m[s]) keys[n++] = static_cast<int32_t>(s);
  if (n == 0) {  // no key: the row attends nothing (zeros, as csrc/row_attention.cpp gives)
    std::fill(out, out + G * D, 0.0f);
    return;
  }
  const int64_t es = n + 8;  // e has 8 spare slots past n: a short block's extra scores land there
  e.resize(G * es);
  if constexpr (std::is_same_v<KT, at::BFloat16>) {
    if (wide) scores_avx512(q, qstride, G, kb, ks, keys.data(), n, D, sc, e.data(), es);  // the same bits
  }
  for (int64_t i0 = 0; i0 < n && !wide; i0 += 4) {  // four keys at a time; a short block repeats its last key
    const int64_t nb = std::min<int64_t>(4, n - i0);
    const KT* k4[4];
    for (int64_t j = 0; j < 4; ++j) k4[j] = kb + keys[i0 + std::min(j, nb - 1)] * ks;
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
      const float* qg = q + g0 * qstride;
      float* eg = e.data() + g0 * es + i0;
      switch (std::min<int64_t>(3, G - g0)) {
        case 3: score4<3>(qg, qstride, k4, D, sc, eg, es); break;
        case 2: score4<2>(qg, qstride, k4, D, sc, eg, es); break;
        default: score4<1>(qg, qstride, k4, D, sc, eg, es); break;
      }
    }
  }
  tots.resize(G);
  for (int64_t g = 0; g < G; ++g) {
    float* eg = e.data() + g * es;
    __m256 mx8 = _mm256_set1_ps(-INFINITY);  // the maximum is the same whatever the order
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(eg + i));
    float mx = hmax(mx8);
    for (; i < n; ++i) mx = std::max(mx, eg[i]);
    for (int64_t i = n; i < n + 8; ++i) eg[i] = mx;  // padding: the last block's spare lanes
    for (int64_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(eg + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(eg + i), _mm256_set1_ps(mx))));
  }
  // each vector's sum of exponentials key by key, in cache order; the G sums advance side by side
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const float* eg = e.data() + g0 * es;
    switch (std::min<int64_t>(4, G - g0)) {
      case 4: sum_keys<4>(eg, es, n, tots.data() + g0); break;
      case 3: sum_keys<3>(eg, es, n, tots.data() + g0); break;
      case 2: sum_keys<2>(eg, es, n, tots.data() + g0); break;
      default: sum_keys<1>(eg, es, n, tots.data() + g0); break;
    }
  }
  if constexpr (std::is_same_v<KT, at::BFloat16>) {
    if (wide) {  // the same sums on 16 lanes at once
      values_avx512(e.data(), es, G, keys.data(), n, vb, vs, tots.data(), out, D);
      return;
    }
  }
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    const float* eg = e.data() + g0 * es;
    switch (std::min<int64_t>(3, G - g0)) {
      case 3: weigh_all<3>(eg, es, keys.data(), n, vb, vs, tots.data() + g0, out + g0 * D, D); break;
      case 2: weigh_all<2>(eg, es, keys.data(), n, vb, vs, tots.data() + g0, out + g0 * D, D); break;
      default: weigh_all<1>(eg, es, keys.data(), n, vb, vs, tots.data() + g0, out + g0 * D, D); break;
    }
  }
}

// whether n float32 values are all bfloat16 values (their low 16 bits zero): queries attend_avx512.cpp can take
inline bool holds_bfloat16(const float* p, int64_t n) {
  uint32_t low = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, p + i, 4);
    low |= bits & 0xFFFFu;
  }
  return low == 0;
}

// Query vectors u0..u1-1 of a pass (u = ((b * KVH + h) * T + t) * G + g: vector g of key head h's group in row t) on
// the calling thread, a run of one row and head's vectors at a time. A vector's sums are the same whichever vectors
// of its group run beside it (each has its own accumulators), so any cut gives the same bits.
template <typename KT>
void run_units(const float* qp, const KT* kp, const KT* vp, const bool* mp, float* op, int64_t B, int64_t H, int64_t T,
               int64_t D, int64_t KVH, int64_t S, const int64_t* kv, int64_t mb, float sc, int64_t u0, int64_t u1) {
  const int64_t G = H / KVH;
  // a bfloat16 cache and bfloat16 queries (every bfloat16 model's): the AVX-512 build of the same sums
  const bool bf16 = std::is_same_v<KT, at::BFloat16> && holds_bfloat16(qp, B * H * T * D);
  const bool wide = bf16 && avx512_attention_in_use() && avx512_attention_fits(D);
  thread_local std::vector<int32_t> keys;
  thread_local std::vector<float> e, tots;
  // a key head's vectors of all rows that see enough keys together on AMX tiles (attend_amx.cpp), the rest below (a
  // row's vectors share its keys, so they go one way together)
  thread_local std::vector<char> tiled;
  tiled.clear();
  if constexpr (std::is_same_v<KT, at::BFloat16>) {
    const int64_t least = amx_attention_min_keys();
    if (bf16 && S >= least && amx_attention_in_use() && amx_attention_fits(D)) {
      tiled.assign(u1 - u0, 0);
      int64_t counted = -1, count = 0;  // the last row counted (a flat index b * T + t) and its keys
      for (int64_t u = u0; u < u1;) {
        const int64_t bh = u / (T * G), stop = std::min(u1, (bh + 1) * T * G);  // vectors of one (item, key head)
        const int64_t b = bh / KVH, h = bh % KVH;
        const float* qs[16];
        const bool* ms[16];
        float* os[16];
        int n = 0;
        const auto flush = [&] {
          if (n) attend_amx(qs, ms, os, n, kp + b * kv[0] + h * kv[1], kv[2], vp + b * kv[3] + h * kv[4], kv[5], S, D, sc);
          n = 0;
        };
        for (; u < stop; ++u) {
          const int64_t t = u / G % T, g = u % G;
          const bool* m = mp + b * mb + t * S;
          if (b * T + t != counted) {  // a verified prefix, then a few of the pass's own rows, then unfilled slots
            const void* last = memrchr(m, 1, S);
            const int64_t end = last ? static_cast<const bool*>(last) - m + 1 : 0;
            const void* off = end >= least ? std::memchr(m, 0, end) : nullptr;
            const int64_t prefix = off ? static_cast<const bool*>(off) - m : end;
            counted = b * T + t, count = end < least ? end : prefix + std::count(m + prefix, m + end, true);
          }
          if (count < least) continue;
          tiled[u - u0] = 1;
          qs[n] = qp + ((b * H + h * G + g) * T + t) * D, ms[n] = m, os[n] = op + ((b * T + t) * H + h * G + g) * D;
          if (++n == 16) flush();
        }
        flush();
      }
    }
  }
  for (int64_t u = u0; u < u1;) {
    if (!tiled.empty() && tiled[u - u0]) {
      ++u;
      continue;
    }
    const int64_t item = u / G, g0 = u % G, g1 = std::min(G, g0 + (u1 - u));
    const int64_t b = item / (KVH * T), h = item / T % KVH, t = item % T;
    attend_row(qp + ((b * H + h * G + g0) * T + t) * D, T * D, kp + b * kv[0] + h * kv[1], kv[2],
               vp + b * kv[3] + h * kv[4], kv[5], mp + b * mb + t * S, S, g1 - g0, D, sc,
               op + ((b * T + t) * H + h * G + g0) * D, keys, e, tots, wide);
    u += g1 - g0;
  }
}

}  // namespace

// csrc/row_attention.cpp's interface: q [B, H, T, D] float32 contiguous; k, v [B, KVH, S, D] float32 or
// bfloat16 with unit stride in D (D a multiple of 8); mask bool [Bm, T, S] contiguous, Bm = 1 or B.
// Returns [B, T, H, D] float32.
torch::Tensor row_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 4, "q: contiguous float32 [B, H, T, D]");
  TORCH_CHECK((k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16) &&
                  v.scalar_type() == k.scalar_type() && k.dim() == 4 && v.dim() == 4,
              "k, v: float32 or bfloat16 [B, KVH, S, D], the same dtype");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.sizes() == v.sizes(), "k, v: same shape, unit stride in D");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 3, "mask: contiguous bool [B, T, S]");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t KVH = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && H % KVH == 0 && D % 8 == 0, "shapes do not match");
  TORCH_CHECK((mask.size(0) == 1 || mask.size(0) == B) && mask.size(1) == T && mask.size(2) == S, "mask shape");
  auto out = torch::empty({B, T, H, D}, q.options());
  const int64_t kv[6] = {k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2)};
  const int64_t mb = mask.size(0) == 1 ? 0 : T * S;
  m2r2_avx2::attention_rows(q.data_ptr<float>(), k.data_ptr(), v.data_ptr(), k.scalar_type() == at::kBFloat16, kv,
                            mask.data_ptr<bool>(), mb, out.data_ptr<float>(), B, H, T, D, KVH, S,
                            static_cast<float>(scale));
  return out;
}

namespace m2r2_avx2 {
void attention_units(const float* q, const void* k, const void* v, bool bf16, const int64_t* kv, const bool* mask,
                     int64_t mb, float* out, int64_t B, int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t S,
                     float sc, int64_t u0, int64_t u1) {
  if (bf16)
    run_units(q, static_cast<const at::BFloat16*>(k), static_cast<const at::BFloat16*>(v), mask, out, B, H, T, D, KVH,
              S, kv, mb, sc, u0, u1);
  else
    run_units(q, static_cast<const float*>(k), static_cast<const float*>(v), mask, out, B, H, T, D, KVH, S, kv, mb, sc,
              u0, u1);
}

void attention_rows(const float* q, const void* k, const void* v, bool bf16, const int64_t* kv, const bool* mask,
                    int64_t mb, float* out, int64_t B, int64_t H, int64_t T, int64_t D, int64_t KVH, int64_t S, float sc) {
  const int64_t G = H / KVH;  // a key head's query vectors together: they share its keys' loads
  at::parallel_for(0, B * KVH * T, 1, [&](int64_t i0, int64_t i1) {
    attention_units(q, k, v, bf16, kv, mask, mb, out, B, H, T, D, KVH, S, sc, i0 * G, i1 * G);
  });
}

// SwiGLU's product silu(gate) * up of `rows` rows [gate (m) | up (m)] (bfloat16) into [rows, m]:
// silu(g) = g / (1 + exp(-g)) in float32, rounded to bfloat16, times up, rounded again (the two
// roundings torch's `F.silu(gate) * up` makes), with this file's exp: lanes independent, so a row's
// bits depend on that row alone.
void silu_mul_range(const at::BFloat16* g, const at::BFloat16* u, int64_t c0, int64_t c1, uint16_t* o) {
  if (avx512_silu_in_use()) return silu_mul_range_avx512(g, u, c0, c1, o);  // the same bits on 16 lanes
  for (int64_t j = c0; j < c1; j += 8) {
    const int64_t n = std::min<int64_t>(8, c1 - j);
    const __m256 x = load8(g + j, n);
    const __m256 sig =
        _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    uint16_t t[8];
    store8_bf16(t, _mm256_mul_ps(round_bf16(sig), load8(u + j, n)));
    std::memcpy(o + j, t, n * sizeof(uint16_t));
  }
}

void silu_mul_rows(const at::BFloat16* gu, int64_t rows, int64_t m, uint16_t* out) {
  parallel_rows(rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_range(gu + r * 2 * m, gu + r * 2 * m + m, 0, m, out + r * m);
  });
}
}  // namespace m2r2_avx2

// gu [..., 2m] bfloat16 contiguous (gate, then up). Returns [..., m] bfloat16: silu(gate) * up.
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.scalar_type() == at::kBFloat16 && gu.is_contiguous() && gu.dim() >= 1 && gu.size(-1) % 2 == 0,
              "gu: contiguous bfloat16 [..., 2m]");
  auto sizes = gu.sizes().vec();
  const int64_t m = sizes.back() / 2;
  sizes.back() = m;
  auto out = torch::empty(sizes, gu.options());
  m2r2_avx2::silu_mul_rows(gu.data_ptr<at::BFloat16>(), m ? gu.numel() / (2 * m) : 0, m,
                           reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}
