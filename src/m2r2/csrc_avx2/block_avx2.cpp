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
#include <omp.h>
#include <torch/extension.h>

#include "kernels2.h"
#include "simd2.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using namespace m2r2_avx2;

inline const at::BFloat16* as_bf16(const uint16_t* p) { return reinterpret_cast<const at::BFloat16*>(p); }

// A barrier for one team's threads that spins (a pause an iteration) instead of going through OpenMP's: the threads
// are about to run again within microseconds
struct SpinBarrier {
  alignas(64) std::atomic<int> arrived{0};
  alignas(64) std::atomic<int> phase{0};
};

// The threads that run a pass's blocks together: one OpenMP region for a whole stack (stack_forward), each thread
// taking its share of every step, with a barrier where a step reads what another thread wrote. Why: a block of a
// few rows used to fork and join both threads for each of its linear layers and its attention (~5 regions a block,
// 150 a pass) and ran its row-wise steps (norms, the int8 inputs, RoPE, SwiGLU's product, the adds) on one thread
// while the other waited. A barrier costs less than a fork and join; RoPE, SwiGLU's product and the adds split
// between the threads, and each thread normalizes and rounds the rows a linear layer reads itself (no barrier
// before the layer). Every value is computed by the same operations as before, whichever thread computes it: the
// same bits. A pass's layers 8-10% faster at one row, 4-5% at 2-4 rows (BENCHMARKS.md, "Thirty-first round").
struct Team {
  int id = 0, size = 1;
  SpinBarrier* barrier = nullptr;
  // this thread's share [lo, hi) of n items, cut as at::parallel_for cuts them
  std::pair<int64_t, int64_t> share(int64_t n) const {
    const int64_t chunk = (n + size - 1) / size;
    return {std::min(n, id * chunk), std::min(n, (id + 1) * chunk)};
  }
  // wait until every thread of the team got here (and sees what the others wrote before)
  void sync() const {
    if (size == 1) return;
    const int phase = barrier->phase.load(std::memory_order_relaxed);
    if (barrier->arrived.fetch_add(1, std::memory_order_acq_rel) == size - 1) {  // the last one: release the rest
      barrier->arrived.store(0, std::memory_order_relaxed);
      barrier->phase.store(phase + 1, std::memory_order_release);
    } else {
      while (barrier->phase.load(std::memory_order_acquire) == phase) _mm_pause();
    }
  }
};

// f(team) on each of at::get_num_threads() threads, or on the calling thread alone where that is 1 or a parallel
// region is running already
template <typename F>
void in_team(const F& f) {
  const int n = at::get_num_threads();
  if (n <= 1 || at::in_parallel_region()) return f(Team{});
  SpinBarrier barrier;
#pragma omp parallel num_threads(n)
  f(Team{omp_get_thread_num(), omp_get_num_threads(), &barrier});
}

// A linear layer's inputs for a pass: its rows (bfloat16 bits), their int8 values and per-group terms
struct InputScratch {
  Scratch<uint16_t> x;
  Scratch<int8_t> q;
  Scratch<float> step, qsum;
};
struct Inputs {
  uint16_t* x;
  int8_t* q;
  float *step, *qsum;
};

// block_rows' intermediate rows: q|k|v, the residual, gate|up (bfloat16 bits), the rotated queries and the
// attention's float32 output; each thread's own inputs of the q/k/v, output and gate|up projections (every thread
// normalizes and rounds whole rows itself: the same values, and no barrier between those steps and the linear
// layer), and the down projection's inputs, SwiGLU's product, which the threads share (each computes and rounds its
// own columns)
struct BlockScratch {
  Scratch<uint16_t> y, a, gu;
  Scratch<float> qf, of;
  std::vector<InputScratch> mine;
  InputScratch down;
};

// Where a block pass's threads find the rows (pointers into the calling thread's BlockScratch, taken on that thread)
struct Rows {
  uint16_t *y, *a, *gu;
  float *qf, *of;
  std::vector<Inputs> mine;  // by thread
  Inputs down;
};

// out[i] = bf16(a[i] + b[i]) for n values (n a multiple of 8): torch's bfloat16 add, 8 lanes at a time
inline void add_bf16(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store8_bf16(out + i, _mm256_add_ps(load8(as_bf16(a + i), 8), load8(as_bf16(b + i), 8)));
}

struct Linear {
  torch::Tensor qbytes, scales, bias;  // bias: bfloat16 [N] or undefined
  int bits = 4;
  int64_t in = 0, out = 0;

  int64_t blocks() const { return qbytes.size(0); }

  // this thread's output blocks [b0, b1): whole pairs (q4_rows.h), cut as linear_rows cuts them
  std::pair<int64_t, int64_t> share(const Team& team) const {
    const auto [p0, p1] = team.share((blocks() + 1) / 2);
    return {2 * p0, std::min(2 * p1, blocks())};
  }

  // the loop a pass of T rows takes here: a prefill's bfloat16 tiles (prefill_amx.cpp), else linear_rows' loop
  Loop loop(int64_t T) const {
    if (T >= PREFILL_MIN_ROWS && blocks() % 2 == 0 && bf16_prefill_in_use()) return Loop::bf16;
    return loop_for(T, blocks());
  }

  // output blocks [b0, b1) of `rows` rows from their inputs (x: bfloat16 bits, read by Loop::bf16; the other loops
  // read their int8 form xq, step, qsum), bias added
  void run_blocks(Loop loop, const uint16_t* x, const int8_t* xq, const float* step, const float* qsum, int64_t rows,
                  uint16_t* y, int64_t b0, int64_t b1) const {
    if (b0 >= b1) return;
    if (loop == Loop::bf16)
      block_range_bf16(bits, static_cast<const uint8_t*>(qbytes.data_ptr()), scales.data_ptr<at::Half>(), x, rows, in,
                       blocks(), y, b0, b1);
    else
      linear_blocks(loop, bits, static_cast<const uint8_t*>(qbytes.data_ptr()), scales.data_ptr<at::Half>(), xq, step,
                    qsum, rows, in, blocks(), y, b0, b1);
    if (bias.defined()) {
      const auto* b = reinterpret_cast<const uint16_t*>(bias.data_ptr<at::BFloat16>());
      for (int64_t r = 0; r < rows; ++r) add_bf16(y + r * out + b0 * 8, b + b0 * 8, y + r * out + b0 * 8, (b1 - b0) * 8);
    }
  }

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

// The calling thread's scratch rows for a pass of T rows through blocks shaped like w (grown to fit, kept from call to
// call: every step below writes its rows whole before reading them, so reusing them gives the same bits and saves each
// block its allocations and zero fills; experiments/block_phases.py). Taken on the calling thread, before a team's
// region: in it, the name of a thread_local would be each thread's own.
Rows rows_for(const BlockWeights& w, int64_t T) {
  thread_local BlockScratch sc;
  const int64_t d = w.attn_norm.numel(), nq = w.heads * w.head_dim, nqkv = w.qkv.out, inter = w.w2.in;
  const int64_t K = std::max(d, nq);
  sc.y.fit(T * nqkv), sc.a.fit(T * d), sc.gu.fit(T * 2 * inter), sc.qf.fit(T * nq), sc.of.fit(T * nq);
  const auto inputs = [](InputScratch& in, int64_t T, int64_t K) {
    in.x.fit(T * K), in.q.fit(T * K), in.step.fit(T * K / 32), in.qsum.fit(T * K / 32);
    return Inputs{in.x.data(), in.q.data(), in.step.data(), in.qsum.data()};
  };
  const size_t threads = std::max(1, at::get_num_threads());  // a team has at most this many
  if (sc.mine.size() < threads) sc.mine.resize(threads);
  Rows r{sc.y.data(), sc.a.data(), sc.gu.data(), sc.qf.data(), sc.of.data(), {}, inputs(sc.down, T, inter)};
  for (size_t i = 0; i < threads; ++i) r.mine.push_back(inputs(sc.mine[i], T, K));
  return r;
}

// A block's K/V cache: base pointers, element size and the strides of its [1, KVH, capacity, D] view
struct CacheView {
  char *k, *v;
  bool bf16;
  int64_t el, kv[6];  // k's strides (batch, head, slot), then v's
};

CacheView cache_view(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  return {static_cast<char*>(k_cache.data_ptr()),
          static_cast<char*>(v_cache.data_ptr()),
          k_cache.scalar_type() == at::kBFloat16,
          k_cache.element_size(),
          {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)}};
}

// The cached keys and values [0, pos) of the key heads whose query vectors this thread attends (its share of the
// H * T vectors, as block_rows cuts them), asked for at the block's start, at most 256 KB of them.
//
// Why: between two layers' attention a pass streams ~2 MB of weights through each core's caches, so a layer's keys
// and values come from L3 each pass, and the attention, which reads them key by key, waited on them. Asked for before
// the q/k/v projection, they arrive under it: the attention's own time fell 30-45% at 250-500 cached tokens (timed
// inside the pass), a pass's layers 0.2-1.5% at 1-4 rows and 100-500 tokens (experiments/pass_switch_ab.py set_cache_prefetch): the
// projection waits longer, as the pass is bound by what it reads. Prefetches change no value.
// M2R2_NO_CACHE_PREFETCH=1 or set_cache_prefetch(false) turns it off (experiments/pass_switch_ab.py's A/B).
std::atomic<bool> cache_prefetch_on{!turned_off("M2R2_NO_CACHE_PREFETCH")};

void prefetch_cache(const Team& team, const CacheView& c, int64_t pos, int64_t H, int64_t KVH, int64_t T, int64_t D) {
  const auto [u0, u1] = team.share(H * T);
  if (u0 >= u1 || pos <= 0 || !cache_prefetch_on.load(std::memory_order_relaxed)) return;
  const int64_t G = H / KVH, h0 = u0 / (T * G), h1 = (u1 - 1) / (T * G), row = D * c.el;
  const int64_t keys = std::min<int64_t>(pos, (256 << 10) / (2 * row * (h1 - h0 + 1)));
  for (int64_t h = h0; h <= h1; ++h)
    for (int64_t s = 0; s < keys; ++s) {
      const char* k = c.k + (h * c.kv[1] + s * c.kv[2]) * c.el;
      const char* v = c.v + (h * c.kv[4] + s * c.kv[5]) * c.el;
      for (int64_t i = 0; i < row; i += 64) {
        _mm_prefetch(k + i, _MM_HINT_T0);
        _mm_prefetch(v + i, _MM_HINT_T0);
      }
    }
}

// RMSNorm of T rows of x (d wide) with weight nw, then their int8 inputs for `next`, into this thread's own inputs;
// returns the normed rows `next` reads. A prefill's (Loop::bf16: many rows, no int8 inputs) go into one buffer
// instead (`shared`, the first thread's), each thread normalizing its share of the rows, then a barrier: the same
// values, half the work each on two threads.
const uint16_t* norm_rows(const Team& team, const uint16_t* x, const torch::Tensor& nw, float eps, int64_t T, int64_t d,
                          const Linear& next, Loop loop, const Inputs& in, uint16_t* shared) {
  const auto [t0, t1] = loop == Loop::bf16 ? team.share(T) : std::pair<int64_t, int64_t>{0, T};
  uint16_t* out = loop == Loop::bf16 ? shared : in.x;
  for (int64_t t = t0; t < t1; ++t) {
    const at::BFloat16* row = as_bf16(x + t * d);
    rms_norm_range(row, nw.data_ptr<at::BFloat16>(), rms_scale(row, d, eps), 0, d, out + t * d);
  }
  if (loop == Loop::bf16)
    team.sync();
  else
    quantize_groups(as_bf16(in.x), T, d, 0, d / 32, offset_inputs(next.bits, loop), in.q, in.step, in.qsum);
  return out;
}

// out[c] = bf16(a[c] + out[c]) over columns of output blocks [b0, b1) of T rows n wide: a residual add, this thread's
void add_blocks(const uint16_t* a, uint16_t* out, int64_t T, int64_t n, int64_t b0, int64_t b1) {
  for (int64_t t = 0; t < T; ++t) add_bf16(a + t * n + b0 * 8, out + t * n + b0 * 8, out + t * n + b0 * 8, (b1 - b0) * 8);
}

// The rows of a batched decoding step: row t is one new token of its own sequence, whose cache (this block's) is
// caches[t], written at slot slots[t] and attending the first keys[t] slots as its mask row marks. Why: several
// sequences decoding together (the server's requests, distillation) share each weight's one read, as a pass's rows
// do, and each row keeps a lone step's bits (its linears are row-invariant; its attention reads its own keys alone).
struct Steps {
  const CacheView* caches;
  const int64_t* slots;
  const int64_t* keys;
};

// The block over T rows (raw pointers; the checks are the callers'): x, cos, sin, out as bfloat16 bits. Every thread
// of the team calls it; each takes its share of each step. `steps`: the rows are a batched step's (above); null: one
// sequence's rows, at slots pos..pos+T-1 of batch item 0.
void block_rows(const Team& team, const BlockWeights& w, const Rows& r, const uint16_t* xp, int64_t T,
                const CacheView& c, int64_t pos, const bool* mask, int64_t S, const uint16_t* cp, const uint16_t* sp,
                uint16_t* op, const Steps* steps = nullptr) {
  const int64_t d = w.attn_norm.numel(), H = w.heads, KVH = w.kv_heads, D = w.head_dim;
  const float eps = static_cast<float>(w.eps);
  const int64_t nq = H * D, nkv = KVH * D, nqkv = nq + 2 * nkv, inter = w.w2.in;
  const Loop lqkv = w.qkv.loop(T), lo = w.o.loop(T), l13 = w.w13.loop(T), l2 = w.w2.loop(T);

  const Inputs& mine = r.mine[team.id];
  if (!steps) prefetch_cache(team, c, pos, H, KVH, T, D);
  const uint16_t* normed = norm_rows(team, xp, w.attn_norm, eps, T, d, w.qkv, lqkv, mine, r.mine[0].x);
  {
    if ((steps ? steps->caches[0].bf16 : c.bf16) && (steps ? S : pos + T) >= amx_attention_min_keys() &&
        amx_attention_in_use())
      wake_amx_attention();
    const auto [b0, b1] = w.qkv.share(team);
    w.qkv.run_blocks(lqkv, normed, mine.q, mine.step, mine.qsum, T, r.y, b0, b1);
  }
  team.sync();

  // RoPE of the q and k heads as bfloat16 ops: x * cos and roll(x, D/2) * sin each rounded, then their sum; the
  // rotated keys and the values into the cache. Items (row, head) over the q, k and v heads. A batched step's q rows
  // go [T, H, D] (each row's heads together, as a one-row pass's), one sequence's [H, T, D].
  const int64_t heads = H + 2 * KVH;
  const auto [i0, i1] = team.share(T * heads);
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t t = item / heads, hh = item % heads;
    const CacheView& cv = steps ? steps->caches[t] : c;
    const int64_t slot = steps ? steps->slots[t] : pos + t;
    const uint16_t* src16 = r.y + t * nqkv + hh * D;
    if (hh >= H + KVH) {  // v: unrotated
      char* dst = cv.v + ((hh - H - KVH) * cv.kv[4] + slot * cv.kv[5]) * cv.el;
      if (cv.bf16)
        std::memcpy(dst, src16, D * 2);
      else
        for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(reinterpret_cast<float*>(dst) + i, load8(as_bf16(src16 + i), 8));
      continue;
    }
    const at::BFloat16 *ct = as_bf16(cp + t * D), *st = as_bf16(sp + t * D), *src = as_bf16(src16);
    for (int64_t i = 0; i < D; i += 8) {  // roll(x, D/2)'s chunk starts at (i + D/2) % D (D % 16 == 0)
      const __m256 a = round_bf16(_mm256_mul_ps(load8(src + i, 8), load8(ct + i, 8)));
      const __m256 b = round_bf16(_mm256_mul_ps(load8(src + (i + D / 2) % D, 8), load8(st + i, 8)));
      const __m256 sum = _mm256_add_ps(a, b);
      if (hh < H) {
        _mm256_storeu_ps(r.qf + (steps ? t * H + hh : hh * T + t) * D + i, round_bf16(sum));  // q as float32
      } else {
        char* dst = cv.k + ((hh - H) * cv.kv[1] + slot * cv.kv[2] + i) * cv.el;
        if (cv.bf16)
          store8_bf16(reinterpret_cast<uint16_t*>(dst), sum);
        else
          _mm256_storeu_ps(reinterpret_cast<float*>(dst), round_bf16(sum));
      }
    }
  }
  team.sync();
  {  // by query vectors, so that a one-row pass's 3 key heads of 3 queries each split 5 : 4, not 6 : 3
    const auto [u0, u1] = team.share(H * T);
    const float scale = static_cast<float>(std::pow(static_cast<double>(D), -0.5));
    if (!steps)
      attention_units(r.qf, c.k, c.v, c.bf16, c.kv, mask, 0, r.of, 1, H, T, D, KVH, S, scale, u0, u1);
    else  // each row over its own sequence's keys, as that sequence's one-row step attends them
      for (int64_t t = u0 / H; t * H < u1; ++t) {
        const CacheView& cv = steps->caches[t];
        const int64_t h0 = std::max(u0, t * H) - t * H, h1 = std::min(u1, (t + 1) * H) - t * H;
        attention_units(r.qf + t * H * D, cv.k, cv.v, cv.bf16, cv.kv, mask + t * S, 0, r.of + t * H * D, 1, H, 1, D,
                        KVH, steps->keys[t], scale, h0, h1);
      }
  }
  team.sync();
  {  // the attention's output [T, H * D] as bfloat16 and the output projection's int8 inputs (this thread's own), the
     // projection and the residual add, this thread's columns
    for (int64_t i = 0; i < T * nq; i += 8) store8_bf16(mine.x + i, _mm256_loadu_ps(r.of + i));
    if (lo != Loop::bf16)
      quantize_groups(as_bf16(mine.x), T, nq, 0, nq / 32, offset_inputs(w.o.bits, lo), mine.q, mine.step, mine.qsum);
    const auto [b0, b1] = w.o.share(team);
    w.o.run_blocks(lo, mine.x, mine.q, mine.step, mine.qsum, T, r.a, b0, b1);
    if (b0 < b1) add_blocks(xp, r.a, T, d, b0, b1);
  }
  team.sync();
  normed = norm_rows(team, r.a, w.mlp_norm, eps, T, d, w.w13, l13, mine, r.mine[0].x);
  {  // gate and up for this thread's groups of 32 intermediate columns (4 blocks of each: whole pairs), SwiGLU's
     // product there and the down projection's int8 inputs for those groups
    const auto [u0, u1] = team.share(inter / 32);
    const int64_t half = inter / 8;  // up's first block
    w.w13.run_blocks(l13, normed, mine.q, mine.step, mine.qsum, T, r.gu, 4 * u0, 4 * u1);
    w.w13.run_blocks(l13, normed, mine.q, mine.step, mine.qsum, T, r.gu, half + 4 * u0, half + 4 * u1);
    for (int64_t t = 0; t < T; ++t) {
      const at::BFloat16* g = as_bf16(r.gu + t * 2 * inter);
      silu_mul_range(g, g + inter, 32 * u0, 32 * u1, r.down.x + t * inter);
    }
    if (u0 < u1 && l2 != Loop::bf16)
      quantize_groups(as_bf16(r.down.x), T, inter, u0, u1, offset_inputs(w.w2.bits, l2), r.down.q, r.down.step, r.down.qsum);
  }
  team.sync();
  {  // the down projection and the second residual add, this thread's columns
    const auto [b0, b1] = w.w2.share(team);
    w.w2.run_blocks(l2, r.down.x, r.down.q, r.down.step, r.down.qsum, T, op, b0, b1);
    if (b0 < b1) add_blocks(r.a, op, T, d, b0, b1);
  }
  team.sync();
}

void check_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t KVH, int64_t D) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == 1 && k_cache.size(1) == KVH && k_cache.size(3) == D &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kFloat) &&
                  k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "k_cache, v_cache: [1, KVH, capacity, D], bfloat16 or float32, unit stride in D");
}

// What a pass over T rows through blocks shaped like w takes (block_forward's arguments): checked before any work
void check_pass(const BlockWeights& w, const torch::Tensor& x, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                int64_t pos, const torch::Tensor& mask, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) == w.attn_norm.numel(),
              "x: contiguous bfloat16 [T, d]");
  check_cache(k_cache, v_cache, w.kv_heads, w.head_dim);
  const int64_t T = x.size(0), cap = k_cache.size(2);
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 2 && mask.size(0) == T &&
                  mask.size(1) <= cap,
              "mask: contiguous bool [T, S], S <= capacity");
  TORCH_CHECK(pos >= 0 && pos + T <= cap, "rows past the cache's capacity");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(0) == T && cos.size(1) == w.head_dim && sin.sizes() == cos.sizes(),
              "cos, sin: contiguous bfloat16 [T, D]");
}

}  // namespace

// x [T, d] bfloat16 contiguous (the rows' residual stream); k_cache, v_cache [1, KVH, capacity, D] (bfloat16 or
// float32, unit stride in D): this block's cache, written at slots pos..pos+T-1; mask [T, S] bool contiguous over
// slots 0..S-1; cos, sin [T, D] bfloat16 (sin sign-folded, m2r2.model.apply_rope). Returns the block's output [T, d].
torch::Tensor block_forward(const BlockWeights& w, torch::Tensor x, torch::Tensor k_cache, torch::Tensor v_cache,
                            int64_t pos, torch::Tensor mask, torch::Tensor cos, torch::Tensor sin) {
  check_pass(w, x, k_cache, v_cache, pos, mask, cos, sin);
  const int64_t T = x.size(0), d = x.size(1), S = mask.size(1);
  auto out = torch::empty({T, d}, x.options());
  const Rows rows = rows_for(w, T);
  const CacheView c = cache_view(k_cache, v_cache);
  in_team([&](const Team& team) {
    block_rows(team, w, rows, reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), T, c, pos,
               mask.data_ptr<bool>(), S, reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>()),
               reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>()),
               reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  });
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

// Blocks 0..stop-1 of a stack over rows x [T, d] (checked by the callers), one team for all: stack_forward's and
// greedy_steps' work. Returns the last block's output [T, d], or with keep every block's output in order.
static std::vector<torch::Tensor> run_stack(const BlockStack& stack, const torch::Tensor& x, const torch::Tensor& k_all,
                                     const torch::Tensor& v_all, int64_t pos, const torch::Tensor& mask,
                                     const torch::Tensor& cos, const torch::Tensor& sin, int64_t stop, bool keep,
                                     const std::vector<Steps>& steps) {
  const BlockWeights& w0 = stack.blocks[0];
  const int64_t T = x.size(0), d = x.size(1), S = mask.size(1);
  for (int64_t i = 0; i < stop; ++i) {
    const BlockWeights& w = stack.blocks[i];
    TORCH_CHECK(w.kv_heads == w0.kv_heads && w.head_dim == w0.head_dim, "blocks of one head shape");
    rows_for(w, T);  // grown to the largest block first: the pointers taken below then hold for every block
  }
  const Rows rows = rows_for(w0, T);
  std::vector<CacheView> caches;  // one sequence's (a batched step's rows bring their own: steps, a layer each)
  if (steps.empty())
    for (int64_t i = 0; i < stop; ++i) caches.push_back(cache_view(k_all.select(0, i), v_all.select(0, i)));
  // every block's output (keep), or two buffers taken in turn: a block reads its input until its last step
  auto outs = torch::empty({keep ? stop : std::min<int64_t>(stop, 2), T, d}, x.options());
  const auto out_of = [&](int64_t i) {
    return reinterpret_cast<uint16_t*>(outs.select(0, keep ? i : i % 2).data_ptr<at::BFloat16>());
  };
  std::vector<uint16_t*> out_rows;
  for (int64_t i = 0; i < stop; ++i) out_rows.push_back(out_of(i));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* cp = reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>());
  const auto* sp = reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>());
  const bool* mp = mask.data_ptr<bool>();
  in_team([&](const Team& team) {
    for (int64_t i = 0; i < stop; ++i)
      block_rows(team, stack.blocks[i], rows, i == 0 ? xp : out_rows[i - 1], T, steps.empty() ? caches[i] : CacheView{},
                 pos, mp, S, cp, sp, out_rows[i], steps.empty() ? nullptr : &steps[i]);
  });
  if (!keep) return {outs.select(0, (stop - 1) % 2)};
  std::vector<torch::Tensor> all;
  for (int64_t i = 0; i < stop; ++i) all.push_back(outs.select(0, i));
  return all;
}

// Blocks 0..stop-1 of a stack over the same rows, one after another: block_forward's work for each, in one call and
// one team (see Team). Why: a one-token SmolLM2 step spent ~60 us of Python per block around block_forward (the
// checks, the module call, finding the block's weights): ~1.8 ms of a ~8 ms step, during which a second thread only
// waits (experiments/stack_overhead.py). Each block runs the same block_rows as block_forward, so the bits are
// block_forward's (tested). k_all, v_all: the cache [layers, 1, KVH, capacity, D]; the rest as block_forward.
// Returns the last block's output [T, d], or with keep every block's output in order.
std::vector<torch::Tensor> stack_forward(const BlockStack& stack, torch::Tensor x, torch::Tensor k_all,
                                         torch::Tensor v_all, int64_t pos, torch::Tensor mask, torch::Tensor cos,
                                         torch::Tensor sin, int64_t stop, bool keep) {
  const int64_t n = static_cast<int64_t>(stack.blocks.size());
  TORCH_CHECK(stop >= 1 && stop <= n, "stop must be in 1..", n);
  TORCH_CHECK(k_all.dim() == 5 && k_all.size(0) >= stop && v_all.sizes() == k_all.sizes() &&
                  k_all.strides() == v_all.strides(),
              "k_all, v_all: [layers, 1, KVH, capacity, D], the same strides");
  check_pass(stack.blocks[0], x, k_all.select(0, 0), v_all.select(0, 0), pos, mask, cos, sin);
  return run_stack(stack, x, k_all, v_all, pos, mask, cos, sin, stop, keep, {});
}

// A greedy pass in one call: the rows' embeddings (`tokens`, rows of `embed` [vocab, d] bfloat16), every block of
// the stack (stack_forward's work), the final RMSNorm (`norm_w`), the LM head (`head`) and each row's argmax: what
// Transformer.run_layers, head and argmax_rows do one op at a time, with the same kernels in the same order, so the
// same tokens and states (tested). Why: a pass streams ~80 MB of weights through the cores' caches, and every Python
// or torch op after it runs cold: an embedding of 3 rows took ~60 us after the layers against ~7 us warm, the norm
// ~50 against ~6, the argmax ~50 against ~17 (experiments/cold_ops.py). A `vanilla` step or a verify pass paid four
// or five such ops around its kernels. mask, cos, sin and the cache as stack_forward takes them. Returns each row's
// token and the rows' final states [T, d] (before the norm: what the drafters seed from).
// The rows' embeddings (`tokens`, rows of `embed` [vocab, d] bfloat16): a greedy pass's or step's first work.
static torch::Tensor embed_rows(const torch::Tensor& embed, const std::vector<int64_t>& tokens, int64_t d) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  TORCH_CHECK(T >= 1, "a pass needs at least one row");
  TORCH_CHECK(embed.dim() == 2 && embed.size(1) == d && embed.scalar_type() == at::kBFloat16 && embed.is_contiguous(),
              "embed: contiguous bfloat16 [vocab, d]");
  auto x = torch::empty({T, d}, embed.options());
  const auto* ep = reinterpret_cast<const uint16_t*>(embed.data_ptr<at::BFloat16>());
  auto* xp = reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < T; ++i) {
    TORCH_CHECK(tokens[i] >= 0 && tokens[i] < embed.size(0), "token id out of the vocabulary");
    std::memcpy(xp + i * d, ep + tokens[i] * d, d * 2);
  }
  return x;
}

// The final RMSNorm (`norm_w`), the LM head (`head`) and each row's argmax over the stack's outputs h [T, d]: a greedy
// pass's or step's last work.
static std::vector<int64_t> greedy_rows(const torch::Tensor& h, const torch::Tensor& norm_w, double eps, const Linear& head) {
  const int64_t T = h.size(0), d = h.size(1), V = head.out;
  TORCH_CHECK(norm_w.scalar_type() == at::kBFloat16 && norm_w.is_contiguous() && norm_w.numel() == d,
              "norm weight: contiguous bfloat16 [d]");
  TORCH_CHECK(head.in == d && !head.bias.defined(), "head: d -> V, no bias");
  std::vector<uint16_t> hn(T * d), logits(T * V);
  rms_norm_rows(h.data_ptr<at::BFloat16>(), norm_w.data_ptr<at::BFloat16>(), T, d, static_cast<float>(eps), hn.data());
  head.run(hn.data(), T, logits.data());
  std::vector<int64_t> out(T);
  for (int64_t i = 0; i < T; ++i) out[i] = argmax_bf16(logits.data() + i * V, V);
  return out;
}

std::tuple<std::vector<int64_t>, torch::Tensor> greedy_pass(const BlockStack& stack, const Linear& head,
                                                            torch::Tensor norm_w, double eps, torch::Tensor embed,
                                                            const std::vector<int64_t>& tokens, torch::Tensor k_all,
                                                            torch::Tensor v_all, int64_t pos, torch::Tensor mask,
                                                            torch::Tensor cos, torch::Tensor sin) {
  const torch::Tensor x = embed_rows(embed, tokens, stack.blocks[0].attn_norm.numel());
  torch::Tensor h = stack_forward(stack, x, k_all, v_all, pos, mask, cos, sin,
                                  static_cast<int64_t>(stack.blocks.size()), false)[0];
  return {greedy_rows(h, norm_w, eps, head), h};
}

// A batched greedy decoding step in one call: one new token of each of several sequences (`tokens`), sequence t's
// cache ks[t], vs[t] [layers, 1, KVH, capacity_t, D] (lone or lent by a pool; bfloat16 or float32), written at its
// slot slots[t] (its length) and attending, as its lone step does, the first capacity_t slots as its row of mask
// [T, S] marks (its own 0..slots[t]; S the widest capacity); cos, sin [T, D] each row's rotation. Returns each row's
// greedy token and the rows' final states [T, d]: row t has the bits of that sequence's lone greedy_pass (its linears
// are row-invariant, its attention reads its own keys; tested). Why: through the per-op path a batched step cost
// ~1.5 ms a row at 32 sequences (step_rows and the head), so distillation and the server's batches ran well below
// what the machine's rows cost.
std::tuple<std::vector<int64_t>, torch::Tensor> greedy_steps(const BlockStack& stack, const Linear& head,
                                                             torch::Tensor norm_w, double eps, torch::Tensor embed,
                                                             const std::vector<int64_t>& tokens,
                                                             const std::vector<torch::Tensor>& ks,
                                                             const std::vector<torch::Tensor>& vs,
                                                             const std::vector<int64_t>& slots, torch::Tensor mask,
                                                             torch::Tensor cos, torch::Tensor sin) {
  const BlockWeights& w0 = stack.blocks[0];
  const int64_t T = static_cast<int64_t>(tokens.size()), n = static_cast<int64_t>(stack.blocks.size());
  const torch::Tensor x = embed_rows(embed, tokens, w0.attn_norm.numel());
  TORCH_CHECK(static_cast<int64_t>(ks.size()) == T && static_cast<int64_t>(vs.size()) == T &&
                  static_cast<int64_t>(slots.size()) == T,
              "one cache and one slot a row");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.dim() == 2 && mask.size(0) == T,
              "mask: contiguous bool [T, S]");
  std::vector<int64_t> keys(T);
  for (int64_t t = 0; t < T; ++t) {
    const torch::Tensor &k = ks[t], &v = vs[t];
    TORCH_CHECK(k.dim() == 5 && k.size(0) >= n && k.size(1) == 1 && v.sizes() == k.sizes() && k.strides() == v.strides(),
                "a row's cache: k, v [layers, 1, KVH, capacity, D], the same strides");
    check_cache(k.select(0, 0), v.select(0, 0), w0.kv_heads, w0.head_dim);
    keys[t] = k.size(3);
    TORCH_CHECK(keys[t] <= mask.size(1) && slots[t] >= 0 && slots[t] < keys[t], "a row's slot past its cache");
    for (int64_t u = 0; u < t; ++u) TORCH_CHECK(ks[u].data_ptr() != k.data_ptr(), "two rows of one sequence");
  }
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(0) == T && cos.size(1) == w0.head_dim && sin.sizes() == cos.sizes(),
              "cos, sin: contiguous bfloat16 [T, D]");
  std::vector<CacheView> views(n * T);  // layer i's caches of the rows at views[i * T ..], offset (no tensor a view)
  for (int64_t t = 0; t < T; ++t) {
    const CacheView first = cache_view(ks[t].select(0, 0), vs[t].select(0, 0));
    const int64_t kl = ks[t].stride(0) * first.el, vl = vs[t].stride(0) * first.el;
    for (int64_t i = 0; i < n; ++i) {
      views[i * T + t] = first;
      views[i * T + t].k += i * kl;
      views[i * T + t].v += i * vl;
    }
  }
  std::vector<Steps> steps;
  for (int64_t i = 0; i < n; ++i) steps.push_back(Steps{views.data() + i * T, slots.data(), keys.data()});
  torch::Tensor h = run_stack(stack, x, ks[0], vs[0], 0, mask, cos, sin, n, false, steps)[0];
  return {greedy_rows(h, norm_w, eps, head), h};
}

// What one draft level reads besides its rows: the fast block, the fuse ([h | e | token taps] -> d), the draft head
// (the final RMSNorm's weight, the draft-vocabulary rows of the LM head), the embedding and RoPE tables, the fast
// layer's cache; for a stream with token taps, the base's first blocks (`pre`, blocks 0..pre.size()-1), which of
// their outputs join the seed (`tap_at`) and the whole cache (k_all, v_all [layers, 1, KVH, capacity, D]) whose
// first layers' slots they write.
struct LevelParts {
  const BlockWeights& w;
  const Linear &fuse, &head;
  const std::vector<BlockWeights>& pre;
  std::vector<int64_t> tap_at;
  torch::Tensor norm_w;
  float eps;
  torch::Tensor embed, rope_cos, rope_sin;
  CacheView cache;
  std::vector<CacheView> pre_caches;
  int64_t capacity, verified;

  LevelParts(const BlockWeights& w_, const Linear& fuse_, const Linear& head_, const std::vector<BlockWeights>& pre_,
             std::vector<int64_t> tap_at_, torch::Tensor norm, double eps_, torch::Tensor embed_, torch::Tensor cos,
             torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_all, torch::Tensor v_all,
             int64_t verified_, int64_t k)
      : w(w_), fuse(fuse_), head(head_), pre(pre_), tap_at(std::move(tap_at_)), norm_w(norm), eps(static_cast<float>(eps_)),
        embed(embed_), rope_cos(cos), rope_sin(sin), cache(cache_view(k_cache, v_cache)), capacity(k_cache.size(2)),
        verified(verified_) {
    const int64_t d = w.attn_norm.numel(), npre = static_cast<int64_t>(pre.size());
    check_cache(k_cache, v_cache, w.kv_heads, w.head_dim);
    TORCH_CHECK(fuse.in == (2 + static_cast<int64_t>(tap_at.size())) * d && fuse.out == d && head.in == d && k >= 1 &&
                    k <= head.out,
                "fuse: (2 + token taps) d -> d, head: d -> V");
    for (const int64_t t : tap_at) TORCH_CHECK(t >= 0 && t < npre, "token taps: outputs of the blocks run first");
    if (npre) {
      TORCH_CHECK(k_all.dim() == 5 && k_all.size(0) >= npre && v_all.sizes() == k_all.sizes(),
                  "k_all, v_all: [layers, 1, KVH, capacity, D]");
      for (int64_t i = 0; i < npre; ++i) {
        const BlockWeights& b = pre[i];
        TORCH_CHECK(b.attn_norm.numel() == d && b.kv_heads == w.kv_heads && b.head_dim == w.head_dim &&
                        b.heads == w.heads && b.w2.in == w.w2.in,
                    "first blocks shaped like the fast block");
        check_cache(k_all.select(0, i), v_all.select(0, i), w.kv_heads, w.head_dim);
        TORCH_CHECK(k_all.size(3) == capacity, "one capacity");
        pre_caches.push_back(cache_view(k_all.select(0, i), v_all.select(0, i)));
      }
    }
    TORCH_CHECK(embed.dim() == 2 && embed.size(1) == d && embed.scalar_type() == at::kBFloat16 && embed.is_contiguous(),
                "embed: contiguous bfloat16 [vocab, d]");
    TORCH_CHECK(rope_cos.scalar_type() == at::kBFloat16 && rope_sin.scalar_type() == at::kBFloat16 &&
                    rope_cos.is_contiguous() && rope_sin.is_contiguous() && rope_cos.size(1) == w.head_dim,
                "rope tables: contiguous bfloat16 [positions, D]");
    TORCH_CHECK(norm_w.scalar_type() == at::kBFloat16 && norm_w.is_contiguous() && norm_w.numel() == d,
                "norm weight: contiguous bfloat16 [d]");
    TORCH_CHECK(verified >= 0, "verified must be >= 0");
  }

  // n nodes (seeds [n, d] bfloat16 rows, their tokens and RoPE positions, fast_mask [n, drafted + n] over the
  // earlier draft rows and their own) after `drafted` draft rows: their fast states into fp [n, d] (their K/V written
  // at verified + drafted + i), and each one's k best draft-vocabulary indices and probabilities (softmax over the
  // draft vocabulary; lower index first on ties)
  void run(const uint16_t* seeds, const int64_t* tokens, const int64_t* positions, const bool* fast_mask,
           int64_t n, int64_t drafted, int64_t k, uint16_t* fp, int64_t* ids, float* probs) const {
    const int64_t d = w.attn_norm.numel(), D = w.head_dim, V = head.out;
    const int64_t at = verified + drafted, S = at + n, P = fuse.in, npre = static_cast<int64_t>(pre.size());
    TORCH_CHECK(drafted >= 0 && S <= capacity, "draft rows past the cache's capacity");
    const auto* ep = reinterpret_cast<const uint16_t*>(embed.data_ptr<at::BFloat16>());
    std::vector<uint16_t> x(n * P), f0(n * d), cs(n * D), sn(n * D), hn(n * d), logits(n * V);
    std::vector<char> mask(n * S);
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(tokens[i] >= 0 && tokens[i] < embed.size(0) && positions[i] >= 0 && positions[i] < rope_cos.size(0),
                  "token or position");
      std::memcpy(x.data() + i * P, seeds + i * d, d * 2);
      std::memcpy(x.data() + i * P + d, ep + tokens[i] * d, d * 2);
      std::memcpy(cs.data() + i * D, reinterpret_cast<const uint16_t*>(rope_cos.data_ptr<at::BFloat16>()) + positions[i] * D, D * 2);
      std::memcpy(sn.data() + i * D, reinterpret_cast<const uint16_t*>(rope_sin.data_ptr<at::BFloat16>()) + positions[i] * D, D * 2);
      std::memset(mask.data() + i * S, 1, verified);
      std::memcpy(mask.data() + i * S + verified, fast_mask + i * (drafted + n), drafted + n);
    }
    if (npre) {  // the base's first blocks over the nodes, as the verify pass runs them; the token taps into x
      std::vector<uint16_t> e(n * d), outs(npre * n * d);
      for (int64_t i = 0; i < n; ++i) std::memcpy(e.data() + i * d, ep + tokens[i] * d, d * 2);
      const Rows pre_rows = rows_for(w, n);  // the first blocks are shaped like the fast one (checked)
      in_team([&](const Team& team) {
        for (int64_t b = 0; b < npre; ++b)
          block_rows(team, pre[b], pre_rows, b == 0 ? e.data() : outs.data() + (b - 1) * n * d, n, pre_caches[b], at,
                     reinterpret_cast<const bool*>(mask.data()), S, cs.data(), sn.data(), outs.data() + b * n * d);
      });
      for (size_t j = 0; j < tap_at.size(); ++j)
        for (int64_t i = 0; i < n; ++i)
          std::memcpy(x.data() + i * P + (2 + j) * d, outs.data() + (tap_at[j] * n + i) * d, d * 2);
    }
    fuse.run(x.data(), n, f0.data());
    const Rows rows = rows_for(w, n);  // after the fuse: its scratch may be the same thread's
    in_team([&](const Team& team) {
      block_rows(team, w, rows, f0.data(), n, cache, at, reinterpret_cast<const bool*>(mask.data()), S, cs.data(),
                 sn.data(), fp);
    });
    rms_norm_rows(as_bf16(fp), norm_w.data_ptr<at::BFloat16>(), n, d, eps, hn.data());
    head.run(hn.data(), n, logits.data());
    std::vector<float> l(V + 8);
    for (int64_t i = 0; i < n; ++i) {
      const at::BFloat16* row = as_bf16(logits.data() + i * V);
      std::fill(l.begin(), l.end(), -INFINITY);
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
        ids[i * k + j] = best[j];
        alignas(32) float e[8] = {l[best[j]] - mx};
        _mm256_store_ps(e, exp8(_mm256_load_ps(e)));
        probs[i * k + j] = e[0] / tot;
      }
    }
  }
};

// One greedy draft level of a seeded fast stream whose one fast layer is a full (merged) block: node i is seeded
// by its parent's fast state fused with its token's embedding (`fuse`: [h | e] -> d), runs the block at RoPE
// position positions[i] over the slow cache 0..verified-1 and the fast K/V of earlier draft rows
// (verified..verified+drafted-1) as fast_mask [n, drafted + n] allows (its own K/V written at
// verified+drafted+i), then the draft head: the final RMSNorm, the draft-vocabulary rows of the LM head
// (`head`), softmax and the k best. What m2r2.multirate.seeded's step + draft_top do, in one call (the same
// kernels; the softmax's exp is this build's). Returns the fast states [n, d] bfloat16, the k best
// draft-vocabulary indices [n, k] int64 and their probabilities [n, k] float32.
std::vector<torch::Tensor> draft_level(const BlockWeights& w, const Linear& fuse, const Linear& head,
                                       const std::vector<BlockWeights>& pre, std::vector<int64_t> tap_at,
                                       torch::Tensor norm_w, double eps, torch::Tensor embed, torch::Tensor seeds,
                                       torch::Tensor tokens, torch::Tensor positions, torch::Tensor rope_cos,
                                       torch::Tensor rope_sin, torch::Tensor k_cache, torch::Tensor v_cache,
                                       torch::Tensor k_all, torch::Tensor v_all, int64_t verified, int64_t drafted,
                                       torch::Tensor fast_mask, int64_t k) {
  const LevelParts parts(w, fuse, head, pre, std::move(tap_at), norm_w, eps, embed, rope_cos, rope_sin, k_cache, v_cache,
                         k_all, v_all, verified, k);
  const int64_t n = seeds.size(0), d = w.attn_norm.numel();
  TORCH_CHECK(seeds.dim() == 2 && seeds.size(1) == d && seeds.scalar_type() == at::kBFloat16 && seeds.is_contiguous(),
              "seeds: contiguous bfloat16 [n, d]");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && tokens.numel() == n &&
                  positions.numel() == n && tokens.is_contiguous() && positions.is_contiguous(),
              "tokens, positions: contiguous int64 [n]");
  TORCH_CHECK(fast_mask.scalar_type() == at::kBool && fast_mask.is_contiguous() && fast_mask.size(0) == n &&
                  fast_mask.size(1) == drafted + n,
              "fast_mask: contiguous bool [n, drafted + n]");
  auto states = torch::empty({n, d}, seeds.options());
  auto ids = torch::empty({n, k}, tokens.options());
  auto probs = torch::empty({n, k}, seeds.options().dtype(at::kFloat));
  parts.run(reinterpret_cast<const uint16_t*>(seeds.data_ptr<at::BFloat16>()), tokens.data_ptr<int64_t>(),
            positions.data_ptr<int64_t>(), fast_mask.data_ptr<bool>(), n, drafted, k,
            reinterpret_cast<uint16_t*>(states.data_ptr<at::BFloat16>()), ids.data_ptr<int64_t>(), probs.data_ptr<float>());
  return {states, ids, probs};
}

// A whole greedy draft tree in one call: TreeSpeculative.draft's loop over draft_level's levels (m2r2.decoding.tree),
// with the same numbers in the same order. Node 0 is the root (root_token, seeded by h_last [d], the final slow state
// of the last verified position, at depth 0); each level runs its open nodes, gives each `branch` children (draft
// tokens through `vocab` [V] int64 where it is given, else the indices; path probability = parent's * own, in double
// as Python multiplies), sorts that level's children by path probability (stable: frontier order, then rank), keeps
// them all and opens the first `width`. It stops after depth_cap levels, when the tree has max_total drafted nodes
// or more, or (level_cost > 0) when calib times the best open node's path probability is below level_cost. Why:
// a level's Python (the mask, the seeds, the tensors to and from the C++ level, the candidates) took ~100 us beside
// the level's ~165 us of kernels on a fast 2-vCPU Xeon, and the cost model prices levels by the wall clock.
// Returns the drafted nodes' tokens, parents and path probabilities in creation order (the root not included).
std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<double>> draft_tree(
    const BlockWeights& w, const Linear& fuse, const Linear& head, const std::vector<BlockWeights>& pre,
    std::vector<int64_t> tap_at, torch::Tensor norm_w, double eps, torch::Tensor embed, torch::Tensor vocab,
    torch::Tensor h_last, int64_t root_token, torch::Tensor rope_cos, torch::Tensor rope_sin, torch::Tensor k_cache,
    torch::Tensor v_cache, torch::Tensor k_all, torch::Tensor v_all, int64_t verified, int64_t depth_cap, int64_t width,
    int64_t branch, int64_t max_total, double calib, double level_cost) {
  const LevelParts parts(w, fuse, head, pre, std::move(tap_at), norm_w, eps, embed, rope_cos, rope_sin, k_cache, v_cache,
                         k_all, v_all, verified, branch);
  const int64_t d = w.attn_norm.numel();
  TORCH_CHECK(h_last.numel() == d && h_last.scalar_type() == at::kBFloat16 && h_last.is_contiguous(),
              "h_last: contiguous bfloat16 [d]");
  TORCH_CHECK(!vocab.defined() || vocab.numel() == 0 ||
                  (vocab.scalar_type() == at::kLong && vocab.is_contiguous() && vocab.numel() == head.out),
              "vocab: contiguous int64 [draft vocabulary] or empty");
  TORCH_CHECK(width >= 1 && branch >= 1 && depth_cap >= 0, "width, branch >= 1; depth_cap >= 0");
  const int64_t* vp = vocab.defined() && vocab.numel() ? vocab.data_ptr<int64_t>() : nullptr;
  std::vector<int64_t> tokens{root_token}, parents{-1}, depths{0};
  std::vector<double> scores{1.0};
  std::vector<std::vector<uint16_t>> state(1);  // node -> its fast state (the seed of its children)
  const auto* hp = reinterpret_cast<const uint16_t*>(h_last.data_ptr<at::BFloat16>());
  std::vector<uint16_t> root_seed(hp, hp + d);
  std::vector<int64_t> kv_rows, frontier{0};  // the tree node of each fast K/V row so far; the open nodes
  for (int64_t level = 0; level < depth_cap; ++level) {
    const int64_t n = static_cast<int64_t>(frontier.size()), drafted = static_cast<int64_t>(kv_rows.size());
    std::vector<int64_t> rows(kv_rows);
    rows.insert(rows.end(), frontier.begin(), frontier.end());
    std::vector<char> vis(n * (drafted + n), 0);  // an open node sees itself and its ancestors among the rows
    std::vector<uint16_t> seeds(n * d);
    std::vector<int64_t> toks(n), pos(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = frontier[i];
      for (int64_t a = r; a >= 0; a = parents[a]) {
        const auto at = std::find(rows.begin(), rows.end(), a);
        if (at != rows.end()) vis[i * (drafted + n) + (at - rows.begin())] = 1;
      }
      const int64_t p = parents[r];
      std::memcpy(seeds.data() + i * d, p < 0 ? root_seed.data() : state[p].data(), d * 2);
      toks[i] = tokens[r];
      pos[i] = verified + depths[r];
    }
    std::vector<uint16_t> f(n * d);
    std::vector<int64_t> ids(n * branch);
    std::vector<float> probs(n * branch);
    parts.run(seeds.data(), toks.data(), pos.data(), reinterpret_cast<const bool*>(vis.data()), n, drafted, branch,
              f.data(), ids.data(), probs.data());
    kv_rows = rows;
    for (int64_t i = 0; i < n; ++i) state[frontier[i]].assign(f.data() + i * d, f.data() + (i + 1) * d);
    struct Cand {
      double score;
      int64_t token, parent;
    };
    std::vector<Cand> cands;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < branch; ++j) {
        const int64_t idx = ids[i * branch + j];
        cands.push_back({scores[frontier[i]] * static_cast<double>(probs[i * branch + j]), vp ? vp[idx] : idx, frontier[i]});
      }
    std::stable_sort(cands.begin(), cands.end(), [](const Cand& a, const Cand& b) { return a.score > b.score; });
    std::vector<int64_t> fresh;
    for (const Cand& c : cands) {
      tokens.push_back(c.token);
      parents.push_back(c.parent);
      depths.push_back(depths[c.parent] + 1);
      scores.push_back(c.score);
      state.emplace_back();
      fresh.push_back(static_cast<int64_t>(tokens.size()) - 1);
    }
    frontier.assign(fresh.begin(), fresh.begin() + std::min<int64_t>(width, fresh.size()));
    if (frontier.empty() || static_cast<int64_t>(tokens.size()) - 1 >= max_total) break;
    if (level_cost > 0 && calib * scores[frontier[0]] < level_cost) break;
  }
  return {std::vector<int64_t>(tokens.begin() + 1, tokens.end()), std::vector<int64_t>(parents.begin() + 1, parents.end()),
          std::vector<double>(scores.begin() + 1, scores.end())};
}

void bind_block(pybind11::module& m) {
  pybind11::class_<BlockWeights>(m, "BlockWeights", pybind11::module_local());  // local: two builds can load side by side
  m.def("make_block", &make_block, "a decoder block's weights for block_forward");
  m.def("block_forward", &block_forward, "one decoder block over a few rows (the per-op path's bits)");
  pybind11::class_<BlockStack>(m, "BlockStack", pybind11::module_local());
  m.def("make_stack", &make_stack, "a model's blocks for stack_forward");
  m.def("stack_forward", &stack_forward, "blocks 0..stop-1 over a few rows, block_forward's bits, in one call");
  m.def("greedy_pass", &greedy_pass, "embeddings, every block, the norm, the LM head and each row's argmax, in one call");
  m.def("greedy_steps", &greedy_steps, "a batched greedy step of several sequences of one cache, in one call");
  pybind11::class_<Linear>(m, "PackedLinearWeights", pybind11::module_local());
  m.def("make_linear", &make_linear, "a packed linear layer's weights for draft_level");
  m.def("draft_level", &draft_level, "one greedy draft level of a one-layer seeded fast stream (token taps: the base's first blocks too)");
  m.def("draft_tree", &draft_tree, "a greedy draft tree of a one-layer seeded fast stream, its levels in one call");
  m.def("set_cache_prefetch", [](bool on) { return cache_prefetch_on.exchange(on); },
        "turn the blocks' early requests for their cached keys and values on or off (the same bits); the old setting");
}
