"""Copies of ``csrc_avx2/`` with one change each to how a pass streams its weights or splits its work between the
threads, written to OUT/<variant>/ for ``experiments/stream_ab.py OUT/<variant>`` (which times them against this
build in one process, alternating, and checks that every pass gives the same bits; its "old" column is the
variant). None changes a number, only when memory is asked for it or which thread does what. The question behind
them (thirtieth round): a verify row's layers cost ~0.6 ms more than one row in a pass (30 blocks, 2 threads), about
what its multiply-adds cost with the weights in cache, as if none of that work overlapped the weights' stream,
although one large linear layer from memory costs nearly the same at 1 and 4 rows
(``experiments/call_size_overlap.py``).

- ``burst``: each thread asks for the first 32 KB of its range (4 KB into L1, the rest into L2) before its loop,
  which otherwise asks 4 KB / 32 KB ahead of each line only once it runs;
- ``next``: while a linear layer runs, each thread also streams its share of the next linear layer's weights
  (q/k/v -> output projection -> gate|up -> down -> the next block's q/k/v) into L2, paced over its own blocks;
- ``attention``: the output projection's weights asked into L2 (each thread its share, in a burst) at the start of
  the row attention, the one phase of a block that reads no weights;
- ``cvt``: the loop's int32 -> float32 conversion (port 0 on Intel, as VPDPBUSD) replaced by the exact
  add-and-subtract of 1.5 * 2^23 (any port); the sums stay below 2^22, so the floats are the same;
- ``t0_1k`` / ``t0_none``: the L1 request 1 KB ahead instead of 4 KB / none (the L2 request stays);
- ``quantize``: a pass of up to 16 rows has every thread quantize the rows' inputs itself inside the linear layer's
  parallel region, instead of the calling thread alone before it (no serial step before the threads start; measured
  on the code before the scratch rows, with per-thread vectors, the same steps);
- ``grain``: the row-wise steps (norms, RoPE, SwiGLU's product, adds, quantizing) split over the threads from 2
  rows up instead of from 17.

    python experiments/pass_variants.py OUT && python experiments/stream_ab.py OUT/next 2 250 200

Its edits match the sources before the pass's blocks ran in one team of threads (commit 03637d1): run it on those
with ``SRC=DIR`` after ``git archive 03637d1 src/m2r2/csrc_avx2 | tar -x -C /tmp/prev`` (DIR =
/tmp/prev/src/m2r2/csrc_avx2), and compare with that build (``stream_ab.py OUT/<v>`` times against the current one).
"""

import os
import shutil
import sys
from pathlib import Path

from m2r2 import amx

out = Path(sys.argv[1])
src = Path(os.environ.get("SRC") or Path(amx.__file__).with_name("csrc_avx2"))

NEXT_DECL = """struct NextWeights {  // the next linear layer's weights (set by its caller; experiment only)
  const uint8_t* q = nullptr;
  const at::Half* s = nullptr;
  int64_t blocks = 0, K = 0;
  int bits = 4;
};
inline NextWeights next_weights;
struct Ahead {  // this thread's share of them
  const uint8_t* q = nullptr;
  int64_t qlen = 0;
  const uint8_t* s = nullptr;
  int64_t slen = 0;
};
inline thread_local Ahead ahead;
// y [M, blocks * 8] (bfloat16 bits)"""

SET_NEXT = (
    "struct Linear {\n  torch::Tensor qbytes, scales, bias;  // bias: bfloat16 [N] or undefined\n  int bits = 4;\n"
    "  int64_t in = 0, out = 0;\n",
    "struct Linear {\n  torch::Tensor qbytes, scales, bias;  // bias: bfloat16 [N] or undefined\n  int bits = 4;\n"
    "  int64_t in = 0, out = 0;\n\n  void set_next() const {\n    next_weights = {static_cast<const uint8_t*>"
    "(qbytes.data_ptr()), scales.data_ptr<at::Half>(), qbytes.size(0), in, bits};\n  }\n",
)

# a thread's share [ba, bb) of the next weights' blocks as byte ranges of their packed bytes and scales
SHARE = """      const int64_t gq = nw.bits == 4 ? 128 : 256, gs = (nw.bits == 4 ? 16 : 8) * 2, G2 = nw.K / 32;
      const int64_t ba = std::min(2 * a, nw.blocks), bb = std::min(2 * b, nw.blocks);
"""

VARIANTS = {
    "burst": [
        (
            "q4_rows.h",
            "  const int64_t paired = blocks / 2 * 2;  // blocks [0, paired) come in pairs\n",
            "  const int64_t paired = blocks / 2 * 2;  // blocks [0, paired) come in pairs\n"
            "  const uint8_t* start = qp + (b0 - b0 % 2) * block_bytes;\n"
            "  const int64_t span = std::min<int64_t>(PREFETCH_L2, (b1 - b0 + 1) * block_bytes);\n"
            "  for (int64_t o = 0; o < span; o += 64)\n"
            "    _mm_prefetch(reinterpret_cast<const char*>(start + o), o < PREFETCH ? _MM_HINT_T0 : _MM_HINT_T1);\n",
        )
    ],
    "next": [
        ("kernels2.h", "// y [M, blocks * 8] (bfloat16 bits)", NEXT_DECL),
        (
            "q4_avx2.cpp",
            "  at::parallel_for(0, (blocks + 1) / 2, 8, [&](int64_t p0, int64_t p1) {  // whole pairs of blocks "
            "(q4_rows.h)\n    const int64_t b0 = 2 * p0, b1 = std::min(2 * p1, blocks);\n",
            "  const m2r2_avx2::NextWeights nw = m2r2_avx2::next_weights;\n  m2r2_avx2::next_weights = {};\n"
            "  const int64_t pairs = (blocks + 1) / 2;\n"
            "  at::parallel_for(0, pairs, 8, [&](int64_t p0, int64_t p1) {\n"
            "    const int64_t b0 = 2 * p0, b1 = std::min(2 * p1, blocks);\n    m2r2_avx2::ahead = {};\n"
            "    if (nw.q) {\n      const int64_t np = (nw.blocks + 1) / 2, a = p0 * np / pairs, b = p1 * np / pairs;\n"
            + SHARE
            + "      m2r2_avx2::ahead = {nw.q + ba * G2 * gq, (bb - ba) * G2 * gq,\n"
            "                          reinterpret_cast<const uint8_t*>(nw.s) + ba * G2 * gs, (bb - ba) * G2 * gs};\n"
            "    }\n",
        ),
        (
            "q4_rows.h",
            "  const int64_t paired = blocks / 2 * 2;  // blocks [0, paired) come in pairs\n"
            "  for (int64_t b = b0; b < b1; ++b) {\n",
            "  const int64_t paired = blocks / 2 * 2;  // blocks [0, paired) come in pairs\n"
            "  const m2r2_avx2::Ahead ah = m2r2_avx2::ahead;\n  int64_t qdone = 0, sdone = 0;\n"
            "  for (int64_t b = b0; b < b1; ++b) {\n    if (ah.q) {\n"
            "      const int64_t qt = (b + 2 - b0) * ah.qlen / (b1 - b0 + 1), "
            "st = (b + 2 - b0) * ah.slen / (b1 - b0 + 1);\n"
            "      for (; qdone < std::min(qt, ah.qlen); qdone += 64)\n"
            "        _mm_prefetch(reinterpret_cast<const char*>(ah.q + qdone), _MM_HINT_T1);\n"
            "      for (; sdone < std::min(st, ah.slen); sdone += 64)\n"
            "        _mm_prefetch(reinterpret_cast<const char*>(ah.s + sdone), _MM_HINT_T1);\n    }\n",
        ),
        ("block_avx2.cpp", *SET_NEXT),
        (
            "block_avx2.cpp",
            "  w.qkv.run(h.data(), T, y.data());\n",
            "  w.o.set_next();\n  w.qkv.run(h.data(), T, y.data());\n",
        ),
        (
            "block_avx2.cpp",
            "  w.o.run(o.data(), T, a.data());",
            "  w.w13.set_next();\n  w.o.run(o.data(), T, a.data());",
        ),
        (
            "block_avx2.cpp",
            "  w.w13.run(h.data(), T, gu.data());",
            "  w.w2.set_next();\n  w.w13.run(h.data(), T, gu.data());",
        ),
        (
            "block_avx2.cpp",
            "  w.w2.run(act.data(), T, op);",
            "  if (after_block) after_block->set_next();\n  w.w2.run(act.data(), T, op);",
        ),
        (
            "block_avx2.cpp",
            "namespace {\n\n// The block over T rows",
            "const Linear* after_block = nullptr;\nnamespace {\n\n// The block over T rows",
        ),
        (
            "block_avx2.cpp",
            "    h = block_forward(stack.blocks[i], h,",
            "    after_block = i + 1 < stop ? &stack.blocks[i + 1].qkv : nullptr;\n"
            "    h = block_forward(stack.blocks[i], h,",
        ),
        (
            "block_avx2.cpp",
            "    if (keep || i == stop - 1) outs.push_back(h);\n  }\n",
            "    if (keep || i == stop - 1) outs.push_back(h);\n  }\n  after_block = nullptr;\n",
        ),
    ],
    "attention": [
        ("kernels2.h", "// y [M, blocks * 8] (bfloat16 bits)", NEXT_DECL),
        (
            "rows_avx2.cpp",
            "  at::parallel_for(0, B * KVH * T, 1, [&](int64_t i0, int64_t i1) {\n"
            "    thread_local std::vector<int32_t> keys;\n    thread_local std::vector<float> e, tots;\n",
            "  const NextWeights nw = next_weights;\n  next_weights = {};\n  const int64_t items = B * KVH * T;\n"
            "  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {\n"
            "    thread_local std::vector<int32_t> keys;\n    thread_local std::vector<float> e, tots;\n"
            "    if (nw.q) {  // two threads: the first half of the pairs to the first\n"
            "      const int64_t np = (nw.blocks + 1) / 2, half = i1 - i0 < items ? (np + 1) / 2 : np;\n"
            "      const int64_t a = i0 == 0 ? 0 : half, b = i0 == 0 ? half : np;\n"
            + SHARE
            + "      for (int64_t o = ba * G2 * gq; o < bb * G2 * gq; o += 64)\n"
            "        _mm_prefetch(reinterpret_cast<const char*>(nw.q + o), _MM_HINT_T1);\n"
            "      const auto* s8 = reinterpret_cast<const uint8_t*>(nw.s);\n"
            "      for (int64_t o = ba * G2 * gs; o < bb * G2 * gs; o += 64)\n"
            "        _mm_prefetch(reinterpret_cast<const char*>(s8 + o), _MM_HINT_T1);\n    }\n",
        ),
        ("block_avx2.cpp", *SET_NEXT),
        ("block_avx2.cpp", "  attention_rows(qf.data(),", "  w.o.set_next();\n  attention_rows(qf.data(),"),
    ],
    "cvt": [
        (
            "q4_rows.h",
            "    out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum(r)), scaled, out[r]);",
            "    const __m512 f = _mm512_sub_ps(_mm512_castsi512_ps("
            "_mm512_add_epi32(sum(r), _mm512_set1_epi32(0x4B400000))),\n"
            "                                   _mm512_set1_ps(12582912.0f));\n"
            "    out[r] = _mm512_fmadd_ps(f, scaled, out[r]);",
        )
    ],
    "quantize": [
        (
            "q4_avx2.cpp",
            "  parallel_rows(M, [&](int64_t r0, int64_t r1) {\n",
            "  const bool few = M <= 16;\n  if (!few) parallel_rows(M, [&](int64_t r0, int64_t r1) {\n",
        ),
        ("q4_avx2.cpp", "  if (BITS == 8 && vnni && !amx)\n", "  if (BITS == 8 && vnni && !amx && !few)\n"),
        (
            "q4_avx2.cpp",
            "    const int64_t b0 = 2 * p0, b1 = std::min(2 * p1, blocks);\n    if (amx)\n",
            "    const int64_t b0 = 2 * p0, b1 = std::min(2 * p1, blocks);\n"
            "    const int8_t* xq_ = xq;\n    const float *step_ = step, *qsum_ = qsum;\n"
            "    thread_local Scratch<int8_t> own_xq;\n    thread_local Scratch<float> own_step, own_qsum;\n"
            "    if (few) {\n      own_xq.fit(M * K), own_step.fit(M * G), own_qsum.fit(M * G);\n"
            "      quantize_rows(x, M, K, own_xq.data(), own_step.data(), own_qsum.data());\n"
            "      if (BITS == 8 && vnni && !amx)\n"
            "        for (int64_t i = 0; i < M * K; ++i)\n"
            "          own_xq.data()[i] = static_cast<int8_t>(static_cast<uint8_t>(own_xq.data()[i]) ^ 0x80u);\n"
            "      xq_ = own_xq.data(), step_ = own_step.data(), qsum_ = own_qsum.data();\n"
            "    }\n    if (amx)\n",
        ),
        *[
            ("q4_avx2.cpp", f"{call}qp, sp, xq, step, qsum,", f"{call}qp, sp, xq_, step_, qsum_,")
            for call in ("block_range_amx(BITS, ", "block_range_vnni(BITS, ", "block_range<BITS>(")
        ],
    ],
    "grain": [("kernels2.h", "  at::parallel_for(0, rows, 16, f);", "  at::parallel_for(0, rows, 1, f);")],
    "t0_1k": [("q4_rows.h", "#define M2R2_PREFETCH 4096", "#define M2R2_PREFETCH 1024")],
    "t0_none": [("q4_rows.h", "  _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH), _MM_HINT_T0);\n", "")],
}

for name, edits in VARIANTS.items():
    dst = out / name
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix in (".cpp", ".h"):
            shutil.copy(f, dst / f.name)
    for file, old, new in edits:
        text = (dst / file).read_text()
        assert text.count(old) == 1, f"{name}: {file} changed ({old[:50]!r})"
        (dst / file).write_text(text.replace(old, new))
    print(f"python experiments/stream_ab.py {dst} 2 250 200")
