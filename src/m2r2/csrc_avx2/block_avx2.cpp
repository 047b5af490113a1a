// One decoder block over a few rows in one C++ call (AVX2 build): RMSNorm, the q/k/v projection (+ bias),
// RoPE, the K/V write into the cache, the row attention, the output projection, the residual add, RMSNorm,
// SwiGLU and the second residual add.
//
// Why: on a 2-vCPU Zen 3 a one-token SmolLM2 step's layers took 10.8 ms through the per-op path and 6.2 ms
// here (experiments/fused_block.py): ~25 small torch ops per layer (views, casts, RoPE's four, the adds, the
// cache write) and the Python around them cost about as much as the kernels. Every step here calls the same
// raw kernels as the ops in q4_avx2.cpp and rows_avx2.cpp and rounds where torch rounds (each bfloat16 op
// computes in float32 and rounds to nearest even), so a row gets the bits of the per-op path (tested) and
// stays independent of the pass: lossless verification and the server's batched steps (which keep the
// per-op path) are unaffected.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "kernels2.h"
#include "simd2.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace {

using namespace m2r2_avx2;

inline const at::BFloat16* as_bf16(const uint16_t* p) { return reinterpret_cast<const at::BFloat16*>(p); }

// block_rows' intermediate rows: the normed input, q|k|v, the attention output, the residual, gate|up, SwiGLU's
// product (bfloat16 bits), the rotated queries and the attention's float32 output
struct BlockScratch {
  Scratch<uint16_t> h, y, o, a, gu, act;
  Scratch<float> qf, of;
};

// out[i] = bf16(a[i] + b[i]) for n values (n a multiple of 8): torch's bfloat16 add, 8 lanes at a time
inline void add_bf16(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store8_bf16(out + i, _mm256_add_ps(load8(as_bf16(a + i), 8), load8(as_bf16(b + i), 8)));
}

struct Linear {
  torch::Tensor qbytes, scales, bias;  // bias: bfloat16 [N] or undefined
  int bits = 4;
  int64_t in = 0, out = 0;

  void run(const uint16_t* x, int64_t rows, uint16_t* y) const {
    linear_rows(bits, reinterpret_cast<const at::BFloat16*>(x), rows, in, static_cast<const uint8_t*>(qbytes.data_ptr()),
                scales.data_ptr<at::Half>(), qbytes.size(0), y);
    if (bias.defined()) {
      const auto* b = reinterpret_cast<const uint16_t*>(bias.data_ptr<at::BFloat16>());
      for (int64_t r = 0; r < rows; ++r) add_bf16(y + r * out, b, y + r * out, out);
    }
  }
};

Linear make_linear(torch::Tensor qbytes, torch::Tensor scales, int64_t bits, torch::Tensor bias, int64_t in, int64_t out) {
  if (bias.defined() && bias.numel() == 0) bias = torch::Tensor();  // an empty tensor: no bias
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(qbytes.element_size() == 1 && qbytes.is_contiguous() && qbytes.dim() == 3 && qbytes.size(0) * 8 == out,
              "qbytes: packed [out/8, ., 32]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && in % 32 == 0, "scales: half");
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kBFloat16 && bias.is_contiguous() && bias.numel() == out),
              "bias: contiguous bfloat16 [out]");
  Linear l;
  l.qbytes = qbytes;
  l.scales = scales;
  l.bias = bias;
  l.bits = static_cast<int>(bits);
  l.in = in;
  l.out = out;
  return l;
}

}  // namespace

// A decoder block's weights, held once per block (m2r2.model.Block keeps the object).
struct BlockWeights {
  torch::Tensor attn_norm, mlp_norm;  // bfloat16 [d]
  double eps;
  Linear qkv, o, w13, w2;
  int64_t heads, kv_heads, head_dim;
};

BlockWeights make_block(torch::Tensor attn_norm, torch::Tensor mlp_norm, double eps, std::vector<torch::Tensor> qbytes,
                        std::vector<torch::Tensor> scales, std::vector<int64_t> bits, std::vector<torch::Tensor> biases,
                        int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter) {
  TORCH_CHECK(qbytes.size() == 4 && scales.size() == 4 && bits.size() == 4 && biases.size() == 4,
              "four linears: qkv, o, w13, w2");
  TORCH_CHECK(attn_norm.scalar_type() == at::kBFloat16 && mlp_norm.scalar_type() == at::kBFloat16 &&
                  attn_norm.is_contiguous() && mlp_norm.is_contiguous(),
              "norm weights: contiguous bfloat16");
  TORCH_CHECK(head_dim % 16 == 0 && heads % kv_heads == 0, "head shape: head_dim a multiple of 16");
  TORCH_CHECK(attn_norm.numel() % 8 == 0 && inter % 8 == 0, "widths: multiples of 8");
  const int64_t d = attn_norm.numel(), q = heads * head_dim, kv = kv_heads * head_dim;
  BlockWeights w;
  w.attn_norm = attn_norm;
  w.mlp_norm = mlp_norm;
  w.eps = eps;
  w.qkv = make_linear(qbytes[0], scales[0], bits[0], biases[0], d, q + 2 * kv);
  w.o = make_linear(qbytes[1], scales[1], bits[1], biases[1], q, d);
  w.w13 = make_linear(qbytes[2], scales[2], bits[2], biases[2], d, 2 * inter);
  w.w2 = make_linear(qbytes[3], scales[3], bits[3], biases[3], inter, d);
  w.heads = heads;
  w.kv_heads = kv_heads;
  w.head_dim = head_dim;
  return w;
}

namespace {

// The block over T rows (raw pointers; the checks are the callers'): x, cos, sin, out as bfloat16 bits.
void block_rows(const BlockWeights& w, const uint16_t* xp, int64_t T, torch::Tensor& k_cache, torch::Tensor& v_cache,
                int64_t pos, const bool* mask, int64_t S, const uint16_t* cp, const uint16_t* sp, uint16_t* op) {
  const int64_t d = w.attn_norm.numel(), H = w.heads, KVH = w.kv_heads, D = w.head_dim;
  const float eps = static_cast<float>(w.eps);
  const int64_t nq = H * D, nkv = KVH * D, nqkv = nq + 2 * nkv, inter = w.w2.in;

  // The calling thread's scratch rows, kept from block to block: every step below writes them whole before reading
  // them, so reusing them gives the same bits and saves each block its allocations and zero fills (1.3 us a block at
  // one row, 0.5 us a row more; experiments/block_phases.py). Bound to references here, on the calling thread: the
  // parallel steps' lambdas run on other threads, where the name of a thread_local would be theirs.
  thread_local BlockScratch scratch;
  auto &h = scratch.h, &y = scratch.y, &o = scratch.o, &a = scratch.a, &gu = scratch.gu, &act = scratch.act;
  auto &qf = scratch.qf, &of = scratch.of;
  h.fit(T * d), y.fit(T * nqkv), o.fit(T * nq), a.fit(T * d), gu.fit(T * 2 * inter), act.fit(T * inter);
  qf.fit(H * T * D), of.fit(T * H * D);
  rms_norm_rows(reinterpret_cast<const at::BFloat16*>(xp), w.attn_norm.data_ptr<at::BFloat16>(), T, d, eps, h.data());
  w.qkv.run(h.data(), T, y.data());

  // RoPE of the q and k heads as bfloat16 ops: x * cos and roll(x, D/2) * sin each rounded, then their sum
  const bool k16 = k_cache.scalar_type() == at::kBFloat16;
  const int64_t ks[2] = {k_cache.stride(1), k_cache.stride(2)}, vs[2] = {v_cache.stride(1), v_cache.stride(2)};
  char* kb = static_cast<char*>(k_cache.data_ptr());
  char* vb = static_cast<char*>(v_cache.data_ptr());
  const int64_t el = k_cache.element_size();
  parallel_rows(T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* yt = y.data() + t * nqkv;
      const at::BFloat16 *ct = as_bf16(cp + t * D), *st = as_bf16(sp + t * D);
      for (int64_t hh = 0; hh < H + KVH; ++hh) {
        const at::BFloat16* src = as_bf16(yt + hh * D);
        for (int64_t i = 0; i < D; i += 8) {  // roll(x, D/2)'s chunk starts at (i + D/2) % D (D % 16 == 0)
          const __m256 a = round_bf16(_mm256_mul_ps(load8(src + i, 8), load8(ct + i, 8)));
          const __m256 b = round_bf16(_mm256_mul_ps(load8(src + (i + D / 2) % D, 8), load8(st + i, 8)));
          const __m256 r = _mm256_add_ps(a, b);
          if (hh < H) {
            _mm256_storeu_ps(qf.data() + (hh * T + t) * D + i, round_bf16(r));  // q as float32 [H, T, D]
          } else {
            char* dst = kb + ((hh - H) * ks[0] + (pos + t) * ks[1] + i) * el;
            if (k16)
              store8_bf16(reinterpret_cast<uint16_t*>(dst), r);
            else
              _mm256_storeu_ps(reinterpret_cast<float*>(dst), round_bf16(r));
          }
        }
      }
      for (int64_t hh = 0; hh < KVH; ++hh) {  // v: the remaining heads, unrotated
        const uint16_t* src = yt + nq + nkv + hh * D;
        char* dst = vb + (hh * vs[0] + (pos + t) * vs[1]) * el;
        if (k16)
          std::memcpy(dst, src, D * 2);
        else
          for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(reinterpret_cast<float*>(dst) + i, load8(as_bf16(src + i), 8));
      }
    }
  });
  const int64_t kv[6] = {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  attention_rows(qf.data(), k_cache.data_ptr(), v_cache.data_ptr(), k16, kv, mask, 0, of.data(), 1, H,
                 T, D, KVH, S, static_cast<float>(std::pow(static_cast<double>(D), -0.5)));
  parallel_rows(T, [&](int64_t t0, int64_t t1) {  // [T, H * D]
    for (int64_t i = t0 * nq; i < t1 * nq; i += 8) store8_bf16(o.data() + i, _mm256_loadu_ps(of.data() + i));
  });

  w.o.run(o.data(), T, a.data());
  parallel_rows(T, [&](int64_t t0, int64_t t1) { add_bf16(xp + t0 * d, a.data() + t0 * d, a.data() + t0 * d, (t1 - t0) * d); });
  rms_norm_rows(reinterpret_cast<const at::BFloat16*>(a.data()), w.mlp_norm.data_ptr<at::BFloat16>(), T, d, eps, h.data());
  w.w13.run(h.data(), T, gu.data());
  silu_mul_rows(reinterpret_cast<const at::BFloat16*>(gu.data()), T, inter, act.data());
  w.w2.run(act.data(), T, op);
  parallel_rows(T, [&](int64_t t0, int64_t t1) { add_bf16(a.data() + t0 * d, op + t0 * d, op + t0 * d, (t1 - t0) * d); });
}

void check_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t KVH, int64_t D) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == 1 && k_cache.size(1) == KVH && k_cache.size(3) == D &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kFloat) &&
                  k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "k_cache, v_cache: [1, KVH, capacity, D], bfloat16 or float32, unit stride in D");
}

}  // namespace

// x [T, d] bfloat16 contiguous (the rows' residual stream); k_cache, v_cache [1, KVH, capacity, D] (bfloat16 or
// float32, unit stride in D): this block's cache, written at slots pos..pos+T-1; mask [T, S] bool contiguous over
// slots 0..S-1; cos, sin [T, D] bfloat16 (sin sign-folded, m2r2.model.apply_rope). Returns the block's output [T, d].
torch::Tensor block_forward(const BlockWeights& w, torch::Tensor x, torch::Tensor k_cache, torch::Tensor v_cache,
                            int64_t pos, torch::Tensor mask, torch::Tensor cos, torch::Tensor sin) {
  const int64_t T = x.size(0), d = x.size(1), H = w.heads, KVH = w.kv_heads, D = w.head_dim;
  const int64_t S = mask.size(1), cap = k_cache.size(2);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && d == w.attn_norm.numel(),
              "x: contiguous bfloat16 [T, d]");
  check_cache(k_cache, v_cache, KVH, D);
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 2 && mask.size(0) == T && S <= cap,
              "mask: contiguous bool [T, S], S <= capacity");
  TORCH_CHECK(pos >= 0 && pos + T <= cap, "rows past the cache's capacity");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(0) == T && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "cos, sin: contiguous bfloat16 [T, D]");
  auto out = torch::empty({T, d}, x.options());
  block_rows(w, reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), T, k_cache, v_cache, pos,
             mask.data_ptr<bool>(), S, reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>()),
             reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>()),
             reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

// A model's decoder blocks, held once (m2r2.model.Transformer keeps the object): what stack_forward runs in order.
struct BlockStack {
  std::vector<BlockWeights> blocks;
};

BlockStack make_stack(std::vector<BlockWeights> blocks) {
  TORCH_CHECK(!blocks.empty(), "a stack needs at least one block");
  const int64_t d = blocks[0].attn_norm.numel();
  for (const auto& b : blocks) TORCH_CHECK(b.attn_norm.numel() == d, "blocks of one width");
  return BlockStack{std::move(blocks)};
}

// Blocks 0..stop-1 of a stack over the same rows, one after another: block_forward's work for each, in one call.
// Why: a one-token SmolLM2 step spent ~60 us of Python per block around block_forward (the checks, the module
// call, finding the block's weights): ~1.8 ms of a ~8 ms step, during which a second thread only waits
// (experiments/stack_overhead.py). Each block runs the same block_rows as block_forward, so the bits are
// block_forward's (tested). k_all, v_all: the cache [layers, 1, KVH, capacity, D]; the rest as block_forward.
// Returns the last block's output [T, d], or with keep every block's output in order.
std::vector<torch::Tensor> stack_forward(const BlockStack& stack, torch::Tensor x, torch::Tensor k_all,
                                         torch::Tensor v_all, int64_t pos, torch::Tensor mask, torch::Tensor cos,
                                         torch::Tensor sin, int64_t stop, bool keep) {
  const int64_t n = static_cast<int64_t>(stack.blocks.size());
  TORCH_CHECK(stop >= 1 && stop <= n, "stop must be in 1..", n);
  TORCH_CHECK(k_all.dim() == 5 && k_all.size(0) >= stop && v_all.sizes() == k_all.sizes(),
              "k_all, v_all: [layers, 1, KVH, capacity, D]");
  std::vector<torch::Tensor> outs;
  torch::Tensor h = x;
  for (int64_t i = 0; i < stop; ++i) {
    h = block_forward(stack.blocks[i], h, k_all.select(0, i), v_all.select(0, i), pos, mask, cos, sin);
    if (keep || i == stop - 1) outs.push_back(h);
  }
  return outs;
}

// One greedy draft level of a seeded fast stream whose one fast layer is a full (merged) block: node i is seeded
// by its parent's fast state fused with its token's embedding (`fuse`: [h | e] -> d), runs the block at RoPE
// position positions[i] over the slow cache 0..verified-1 and the fast K/V of earlier draft rows
// (verified..verified+drafted-1) as fast_mask [n, drafted + n] allows (its own K/V written at
// verified+drafted+i), then the draft head: the final RMSNorm, the draft-vocabulary rows of the LM head
// (`head`), softmax and the k best. What m2r2.multirate.seeded's step + draft_top do, in one call (the same
// kernels; the softmax's exp is this build's). Returns the fast states [n, d] bfloat16, the k best
// draft-vocabulary indices [n, k] int64 and their probabilities [n, k] float32.
std::vector<torch::Tensor> draft_level(const BlockWeights& w, const Linear& fuse, const Linear& head, torch::Tensor norm_w,
                                       double eps, torch::Tensor embed, torch::Tensor seeds, torch::Tensor tokens,
                                       torch::Tensor positions, torch::Tensor rope_cos, torch::Tensor rope_sin,
                                       torch::Tensor k_cache, torch::Tensor v_cache, int64_t verified, int64_t drafted,
                                       torch::Tensor fast_mask, int64_t k) {
  const int64_t n = seeds.size(0), d = w.attn_norm.numel(), D = w.head_dim, V = head.out;
  check_cache(k_cache, v_cache, w.kv_heads, D);
  TORCH_CHECK(seeds.dim() == 2 && seeds.size(1) == d && seeds.scalar_type() == at::kBFloat16 && seeds.is_contiguous(),
              "seeds: contiguous bfloat16 [n, d]");
  TORCH_CHECK(fuse.in == 2 * d && fuse.out == d && head.in == d && k >= 1 && k <= V, "fuse: 2d -> d, head: d -> V");
  TORCH_CHECK(embed.dim() == 2 && embed.size(1) == d && embed.scalar_type() == at::kBFloat16 && embed.is_contiguous(),
              "embed: contiguous bfloat16 [vocab, d]");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && tokens.numel() == n &&
                  positions.numel() == n && tokens.is_contiguous() && positions.is_contiguous(),
              "tokens, positions: contiguous int64 [n]");
  TORCH_CHECK(rope_cos.scalar_type() == at::kBFloat16 && rope_sin.scalar_type() == at::kBFloat16 &&
                  rope_cos.is_contiguous() && rope_sin.is_contiguous() && rope_cos.size(1) == D,
              "rope tables: contiguous bfloat16 [positions, D]");
  TORCH_CHECK(fast_mask.scalar_type() == at::kBool && fast_mask.is_contiguous() && fast_mask.size(0) == n &&
                  fast_mask.size(1) == drafted + n,
              "fast_mask: contiguous bool [n, drafted + n]");
  const int64_t at = verified + drafted, S = at + n;
  TORCH_CHECK(verified >= 0 && drafted >= 0 && S <= k_cache.size(2), "draft rows past the cache's capacity");
  const auto* tp = tokens.data_ptr<int64_t>();
  const auto* pp = positions.data_ptr<int64_t>();
  const auto* ep = reinterpret_cast<const uint16_t*>(embed.data_ptr<at::BFloat16>());
  const auto* sp = reinterpret_cast<const uint16_t*>(seeds.data_ptr<at::BFloat16>());
  std::vector<uint16_t> x(n * 2 * d), f0(n * d), cs(n * D), sn(n * D), hn(n * d), logits(n * V);
  std::vector<char> mask(n * S);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(tp[i] >= 0 && tp[i] < embed.size(0) && pp[i] >= 0 && pp[i] < rope_cos.size(0), "token or position");
    std::memcpy(x.data() + i * 2 * d, sp + i * d, d * 2);
    std::memcpy(x.data() + i * 2 * d + d, ep + tp[i] * d, d * 2);
    std::memcpy(cs.data() + i * D, reinterpret_cast<const uint16_t*>(rope_cos.data_ptr<at::BFloat16>()) + pp[i] * D, D * 2);
    std::memcpy(sn.data() + i * D, reinterpret_cast<const uint16_t*>(rope_sin.data_ptr<at::BFloat16>()) + pp[i] * D, D * 2);
    std::memset(mask.data() + i * S, 1, verified);
    std::memcpy(mask.data() + i * S + verified, fast_mask.data_ptr<bool>() + i * (drafted + n), drafted + n);
  }
  fuse.run(x.data(), n, f0.data());
  auto states = torch::empty({n, d}, seeds.options());
  auto* fp = reinterpret_cast<uint16_t*>(states.data_ptr<at::BFloat16>());
  block_rows(w, f0.data(), n, k_cache, v_cache, at, reinterpret_cast<const bool*>(mask.data()), S, cs.data(), sn.data(), fp);
  rms_norm_rows(as_bf16(fp), norm_w.data_ptr<at::BFloat16>(), n, d, static_cast<float>(eps), hn.data());
  head.run(hn.data(), n, logits.data());
  auto ids = torch::empty({n, k}, tokens.options());
  auto probs = torch::empty({n, k}, seeds.options().dtype(at::kFloat));
  auto ia = ids.accessor<int64_t, 2>();
  auto pa = probs.accessor<float, 2>();
  for (int64_t i = 0; i < n; ++i) {  // softmax over the draft vocabulary, the k largest (lower index first on ties)
    const at::BFloat16* row = as_bf16(logits.data() + i * V);
    std::vector<float> l(V + 8, -INFINITY);
    for (int64_t j = 0; j < V; ++j) l[j] = static_cast<float>(row[j]);
    float mx = -INFINITY;
    for (int64_t j = 0; j < V; ++j) mx = std::max(mx, l[j]);
    __m256 tot8 = _mm256_setzero_ps();
    for (int64_t j = 0; j < V; j += 8)
      tot8 = _mm256_add_ps(tot8, exp8(_mm256_sub_ps(_mm256_loadu_ps(l.data() + j), _mm256_set1_ps(mx))));
    const float tot = hsum(tot8);
    std::vector<int64_t> best;
    for (int64_t j = 0; j < V; ++j) {
      if (static_cast<int64_t>(best.size()) == k && l[j] <= l[best.back()]) continue;
      auto pos = best.begin();
      while (pos != best.end() && l[*pos] >= l[j]) ++pos;
      best.insert(pos, j);
      if (static_cast<int64_t>(best.size()) > k) best.pop_back();
    }
    for (int64_t j = 0; j < k; ++j) {
      ia[i][j] = best[j];
      alignas(32) float e[8] = {l[best[j]] - mx};
      _mm256_store_ps(e, exp8(_mm256_load_ps(e)));
      pa[i][j] = e[0] / tot;
    }
  }
  return {states, ids, probs};
}

void bind_block(pybind11::module& m) {
  pybind11::class_<BlockWeights>(m, "BlockWeights", pybind11::module_local());  // local: two builds can load side by side
  m.def("make_block", &make_block, "a decoder block's weights for block_forward");
  m.def("block_forward", &block_forward, "one decoder block over a few rows (the per-op path's bits)");
  pybind11::class_<BlockStack>(m, "BlockStack", pybind11::module_local());
  m.def("make_stack", &make_stack, "a model's blocks for stack_forward");
  m.def("stack_forward", &stack_forward, "blocks 0..stop-1 over a few rows, block_forward's bits, in one call");
  pybind11::class_<Linear>(m, "PackedLinearWeights", pybind11::module_local());
  m.def("make_linear", &make_linear, "a packed linear layer's weights for draft_level");
  m.def("draft_level", &draft_level, "one greedy draft level of a one-layer seeded fast stream");
}
