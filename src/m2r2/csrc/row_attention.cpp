// Attention for a few query rows whose bits do not depend on where a row's keys sit in the cache.
//
// Why: lossless speculative decoding needs every row of a verify pass to get the bits a one-token
// decoding step gives it. A tree row at depth j attends the verified prefix plus its j ancestors,
// which a tree pass leaves scattered among the other tree rows; a BLAS reduction over keys depends
// on the keys' positions, so the Python path gathered each branch's keys into decoding's layout
// (a copy of the whole cache per branch and layer) and ran ~10 small torch ops per row and layer,
// which made a tree pass cost ~0.6 of a decoding step in attention alone. Here each (row, query head)
// visits its allowed keys in increasing cache position and accumulates sequentially in that order,
// skipping masked keys: decoding (keys 0..n-1) and a tree row (prefix, then its ancestors, which the
// tree lays out in increasing position) see the same sequence of keys and so the same bits, with no
// gather. Scores are float32 dot products over the head dimension (fixed order), the softmax uses a
// vectorized exp whose lanes are independent, the sum of exponentials and the weighted sum of values
// run key by key. Work items (sequence, key head, row) run in parallel; each is one thread's.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "simd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

namespace {

// exp(x) for 16 lanes: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2 (Cephes' expf polynomial); every
// lane is computed alike, so a value's exp does not depend on its lane.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-103.972084045410f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

using m2r2::lanes;
using m2r2::load16;

constexpr int64_t MAX_G = 16;   // query heads per key head
constexpr int64_t G_TILE = 4;    // query heads whose weighted values accumulate together
constexpr int64_t VCHUNKS = 4;   // 16-lane chunks of a value row accumulated together

// The horizontal sums of 16 vectors at once, lane j holding v[j]'s: a butterfly of 15 shuffle-and-add
// steps instead of 16 separate reductions, with each lane summed in exactly the tree a lone
// _mm512_reduce_add_ps uses (lanes i + i+8, then + i+4, + i+2, + i+1), so a score has one value
// whichever of the 16 slots its key falls in (float addition is commutative; the tree fixes the rest).
inline __m512 halve(__m512 a, __m512 b) {  // [a 0-7 + a 8-15, b 0-7 + b 8-15]
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
inline __m512 quarter(__m512 a, __m512 b) {  // 128-bit chunks [a0 + a1, a2 + a3, b0 + b1, b2 + b3]
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline __m512 sums16(const __m512* v) {
  __m512 w[4];
  for (int n = 0; n < 4; ++n) w[n] = quarter(halve(v[n], v[n + 4]), halve(v[n + 8], v[n + 12]));
  // within each 128-bit chunk: lanes i + i+2, then i + i+1
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(w[2], w[3], _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(w[2], w[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(r, u, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(r, u, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Softmax-weighted values of GT query heads (their exponentials ``e``, GT rows of ``padded``): the sum
// of exponentials and each output lane's sum run key by key in increasing position; the GT heads and
// 4 chunks of 16 lanes run side by side (compile-time counts keep the accumulators in registers).
template <int GT, typename KT>
void weigh_values(const KT* vbase, int64_t vs, const int32_t* keys, int64_t n, int64_t D, const float* e,
                  int64_t padded, float* orows, int64_t ostride) {
  float total[GT];
  for (int g = 0; g < GT; ++g) total[g] = 0.0f;
  for (int64_t i = 0; i < n; ++i)
    for (int g = 0; g < GT; ++g) total[g] += e[g * padded + i];
  __m512 denom[GT];
  for (int g = 0; g < GT; ++g) denom[g] = _mm512_set1_ps(n ? total[g] : 1.0f);
  for (int64_t d0 = 0; d0 < D; d0 += 16 * VCHUNKS) {
    __m512 acc[GT][VCHUNKS];
    __mmask16 lm[VCHUNKS];
    for (int c = 0; c < VCHUNKS; ++c) {
      lm[c] = d0 + 16 * c < D ? lanes(d0 + 16 * c, D) : static_cast<__mmask16>(0);
      for (int g = 0; g < GT; ++g) acc[g][c] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < n; ++i) {
      const KT* vrow = vbase + keys[i] * vs + d0;
      __m512 vv[VCHUNKS];
      for (int c = 0; c < VCHUNKS; ++c) vv[c] = load16(vrow + 16 * c, lm[c]);
      for (int g = 0; g < GT; ++g) {
        const __m512 p = _mm512_set1_ps(e[g * padded + i]);
        for (int c = 0; c < VCHUNKS; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
      }
    }
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < VCHUNKS; ++c)
        _mm512_mask_storeu_ps(orows + g * ostride + d0 + 16 * c, lm[c], _mm512_div_ps(acc[g][c], denom[g]));
  }
}

// One (sequence, key head, row) item: scores, softmax and weighted values for its G query heads.
// The arithmetic of every output is fixed by its allowed keys alone: a score is the sum over chunks
// of 16 of q*k (fused multiply-adds in chunk order, then the tree of a horizontal sum), the
// exponentials' sum and each value lane's weighted sum run key by key in increasing position. Keys
// are taken 16 at a time (widened to float32 once for all G heads) and values once per key for a
// tile of heads; that changes which work runs side by side, never an output's order of operations.
template <typename KT>
void attend_item(const float* qrows, int64_t qstride, const KT* kbase, int64_t ks, const KT* vbase, int64_t vs,
                 const int32_t* keys, int64_t n, int64_t G, int64_t D, float sc, float* s, int64_t padded,
                 float* kf, float* orows, int64_t ostride) {
  const int64_t DP = (D + 15) / 16 * 16;  // a widened key row, zero past D
  __m512 vmx[MAX_G];
  for (int64_t g = 0; g < G; ++g) vmx[g] = _mm512_set1_ps(-INFINITY);
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - i0);
    for (int64_t j = 0; j < 16; ++j) {  // past n: repeat the last key (its scores are dropped)
      const KT* krow = kbase + keys[i0 + std::min(j, m - 1)] * ks;
      for (int64_t d = 0; d < DP; d += 16) _mm512_storeu_ps(kf + j * DP + d, load16(krow + d, lanes(d, D)));
    }
    const __mmask16 valid = m == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << m) - 1);
    for (int64_t g = 0; g < G; ++g) {
      const float* qrow = qrows + g * qstride;
      __m512 acc[16];
      for (int64_t j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < DP; d += 16) {
        const __m512 qd = _mm512_maskz_loadu_ps(lanes(d, D), qrow + d);
        for (int64_t j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kf + j * DP + d), acc[j]);
      }
      const __m512 x = _mm512_mul_ps(sums16(acc), _mm512_set1_ps(sc));
      _mm512_storeu_ps(s + g * padded + i0, x);
      vmx[g] = _mm512_mask_max_ps(vmx[g], valid, vmx[g], x);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * padded;
    for (int64_t i = n; i < padded; ++i) sg[i] = -INFINITY;
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx[g]));
    for (int64_t i = 0; i < padded; i += 16) _mm512_storeu_ps(sg + i, exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + i), mx)));
  }
  for (int64_t g0 = 0; g0 < G; g0 += G_TILE) {
    switch (std::min<int64_t>(G_TILE, G - g0)) {
      case 1: weigh_values<1>(vbase, vs, keys, n, D, s + g0 * padded, padded, orows + g0 * ostride, ostride); break;
      case 2: weigh_values<2>(vbase, vs, keys, n, D, s + g0 * padded, padded, orows + g0 * ostride, ostride); break;
      case 3: weigh_values<3>(vbase, vs, keys, n, D, s + g0 * padded, padded, orows + g0 * ostride, ostride); break;
      default: weigh_values<4>(vbase, vs, keys, n, D, s + g0 * padded, padded, orows + g0 * ostride, ostride);
    }
  }
}

template <typename KT>
void run_items(const float* qp, const KT* kp, const KT* vp, const bool* mp, float* op, int64_t B, int64_t H,
               int64_t T, int64_t D, int64_t KVH, int64_t S, std::array<int64_t, 6> kv, int64_t mb, float sc) {
  const int64_t G = H / KVH;
  const auto [kb, kh, ks, vb, vh, vs] = kv;
  at::parallel_for(0, B * KVH * T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int32_t> keys(S);
    std::vector<float> s((S + 15) / 16 * 16 * G);
    std::vector<float> kf(16 * ((D + 15) / 16 * 16));
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / (KVH * T), h = item / T % KVH, t = item % T;
      const bool* m = mp + b * mb + t * S;
      int64_t n = 0;
      for (int64_t j = 0; j < S; ++j)
        if (m[j]) keys[n++] = static_cast<int32_t>(j);
      // q [B, H, T, D]: head h*G+g of row t; out [B, T, H, D]
      attend_item(qp + ((b * H + h * G) * T + t) * D, T * D, kp + b * kb + h * kh, ks, vp + b * vb + h * vh, vs,
                  keys.data(), n, G, D, sc, s.data(), (n + 15) / 16 * 16, kf.data(), op + ((b * T + t) * H + h * G) * D, D);
    }
  });
}

}  // namespace

// q [B, H, T, D] float32 contiguous; k, v [B, KVH, S, D] float32 or bfloat16 (the cache as it is: a
// bfloat16 value widens to float32 exactly, so both give the same bits) with unit stride in D; mask
// bool [Bm, T, S] contiguous, Bm = 1 or B. Returns [B, T, H, D] float32.
torch::Tensor row_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 4, "q: contiguous float32 [B, H, T, D]");
  TORCH_CHECK((k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16) &&
                  v.scalar_type() == k.scalar_type() && k.dim() == 4 && v.dim() == 4,
              "k, v: float32 or bfloat16 [B, KVH, S, D], the same dtype");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.sizes() == v.sizes(), "k, v: same shape, unit stride in D");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 3, "mask: contiguous bool [B, T, S]");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t KVH = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && H % KVH == 0, "shapes do not match");
  TORCH_CHECK(H / KVH <= MAX_G, "at most 16 query heads per key head");
  TORCH_CHECK((mask.size(0) == 1 || mask.size(0) == B) && mask.size(1) == T && mask.size(2) == S, "mask shape");
  auto out = torch::empty({B, T, H, D}, q.options());
  const std::array<int64_t, 6> kv = {k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2)};
  const int64_t mb = mask.size(0) == 1 ? 0 : T * S;
  const float sc = static_cast<float>(scale);
  if (k.scalar_type() == at::kFloat)
    run_items(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), mask.data_ptr<bool>(),
              out.data_ptr<float>(), B, H, T, D, KVH, S, kv, mb, sc);
  else
    run_items(q.data_ptr<float>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), mask.data_ptr<bool>(),
              out.data_ptr<float>(), B, H, T, D, KVH, S, kv, mb, sc);
  return out;
}
