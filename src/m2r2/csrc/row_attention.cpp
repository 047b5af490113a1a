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

// lanes d..d+15 of a row of D floats that exist (the last chunk of a D not divisible by 16 is partial)
inline __mmask16 lanes(int64_t d, int64_t D) {
  return D - d >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (D - d)) - 1);
}

// sum of a[0..D) * b[0..D) in a fixed order
inline float dot(const float* a, const float* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = lanes(d, D);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + d), _mm512_maskz_loadu_ps(m, b + d), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

}  // namespace

// q [B, H, T, D] float32 contiguous; k, v [B, KVH, S, D] float32 with unit stride in D; mask bool
// [Bm, T, S] contiguous, Bm = 1 or B. Returns [B, T, H, D] float32.
torch::Tensor row_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 4, "q: contiguous float32 [B, H, T, D]");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 4 && v.dim() == 4,
              "k, v: float32 [B, KVH, S, D]");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.sizes() == v.sizes(), "k, v: same shape, unit stride in D");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 3, "mask: contiguous bool [B, T, S]");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t KVH = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && H % KVH == 0, "shapes do not match");
  TORCH_CHECK((mask.size(0) == 1 || mask.size(0) == B) && mask.size(1) == T && mask.size(2) == S, "mask shape");
  const int64_t G = H / KVH;
  auto out = torch::empty({B, T, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t kb = k.stride(0), kh = k.stride(1), ks = k.stride(2);
  const int64_t vb = v.stride(0), vh = v.stride(1), vs = v.stride(2);
  const int64_t mb = mask.size(0) == 1 ? 0 : T * S;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * KVH * T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int32_t> keys(S);
    std::vector<float> s((S + 15) / 16 * 16 * G);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / (KVH * T), h = item / T % KVH, t = item % T;
      const bool* m = mp + b * mb + t * S;
      int64_t n = 0;
      for (int64_t j = 0; j < S; ++j)
        if (m[j]) keys[n++] = static_cast<int32_t>(j);
      const int64_t padded = (n + 15) / 16 * 16;
      const float* kbase = kp + b * kb + h * kh;
      const float* vbase = vp + b * vb + h * vh;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        const float* qrow = qp + ((b * H + hq) * T + t) * D;
        float* sg = s.data() + g * padded;
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; ++i) {
          sg[i] = dot(qrow, kbase + keys[i] * ks, D) * sc;
          mx = std::max(mx, sg[i]);
        }
        for (int64_t i = n; i < padded; ++i) sg[i] = -INFINITY;
        const __m512 vmx = _mm512_set1_ps(mx);
        for (int64_t i = 0; i < padded; i += 16)
          _mm512_storeu_ps(sg + i, exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + i), vmx)));
        float total = 0.0f;
        for (int64_t i = 0; i < n; ++i) total += sg[i];
        float* orow = op + ((b * T + t) * H + hq) * D;
        for (int64_t d = 0; d < D; d += 16) {
          const __mmask16 lm = lanes(d, D);
          __m512 acc = _mm512_setzero_ps();
          for (int64_t i = 0; i < n; ++i)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(sg[i]), _mm512_maskz_loadu_ps(lm, vbase + keys[i] * vs + d), acc);
          _mm512_mask_storeu_ps(orow + d, lm, _mm512_div_ps(acc, _mm512_set1_ps(n ? total : 1.0f)));
        }
      }
    }
  });
  return out;
}
