"""Where a fused decoder block's time goes, phase by phase: a copy of ``csrc_avx2/`` whose ``block_avx2.cpp`` has a
timer around each phase (norm, q/k/v, RoPE and the K/V write, attention, the output projection, residual and norm,
gate|up, SwiGLU's product, down, the last add) is built as its own extension and put in the engine's place; the
bundled model's first BLOCKS blocks then run over T = 1, 2, 4, 8 rows after a CTX-token context (MT-Bench's first
prompt repeated), the mask showing the whole context, 200 passes each. Prints microseconds per block at one row and
per extra row (from 1 to 8 rows) for the four linears, the attention, and each element-wise step (the block's scratch
buffers, the first RMSNorm, RoPE and the K/V write, the attention output's bfloat16 store, the residual add and the
second RMSNorm, SwiGLU's product, the last add; all on the calling thread up to 16 rows), then their sum.

    python experiments/block_phases.py [THREADS] [BLOCKS] [CTX ...]

Its edits match the block as it was before the pass's blocks ran in one team of threads (commit 03637d1; the team
splits every step between the threads, so phases are no longer one thread's): run it on those sources with
``SRC=DIR`` after ``git archive 03637d1 src/m2r2/csrc_avx2 | tar -x -C /tmp/prev`` (DIR =
/tmp/prev/src/m2r2/csrc_avx2).
"""

import os
import sys
import time
from pathlib import Path

import torch
from warmed import filled_context, patched_build, warmed_first_turns

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 10
contexts = [int(a) for a in sys.argv[3:]] or [250, 500]

# the timed copy: PH(i) adds the time since the previous mark to phase i (0 q/k/v, 2 attention, 4 output, 5 gate|up,
# 6 down; the element-wise steps between them: 7 scratch buffers, 8 first norm, 9 RoPE + K/V write, 10 output store,
# 1 residual add + second norm, 3 SwiGLU's product, 11 last add)
src = Path(os.environ["SRC"]) if os.environ.get("SRC") else None
edits = [
    (
        "namespace {\n\nusing namespace m2r2_avx2;\n\ninline const at::BFloat16* as_bf16",
        "#include <chrono>\ndouble phase_ns[12];\nlong phase_calls;\ninline double now_ns() {\n  return "
        "std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count();\n}\n"
        "#define PH(i) t2_ = now_ns(); phase_ns[i] += t2_ - t_; t_ = t2_;\n"
        "namespace {\n\nusing namespace m2r2_avx2;\n\ninline const at::BFloat16* as_bf16",
    ),
    (
        "  // The calling thread's scratch rows",
        "  double t_ = now_ns(), t2_;\n  ++phase_calls;\n  // The calling thread's scratch rows",
    ),
    (
        "  qf.fit(H * T * D), of.fit(T * H * D);\n",
        "  qf.fit(H * T * D), of.fit(T * H * D);\n  PH(7)\n",
    ),
    ("  w.qkv.run(h.data(), T, y.data());\n", "  PH(8) w.qkv.run(h.data(), T, y.data());\n  PH(0)\n"),
    ("  const int64_t kv[6] = {k_cache.stride(0)", "  PH(9)\n  const int64_t kv[6] = {k_cache.stride(0)"),
    (
        "  parallel_rows(T, [&](int64_t t0, int64_t t1) {  // [T, H * D]",
        "  PH(2) parallel_rows(T, [&](int64_t t0, int64_t t1) {",
    ),
    ("  w.o.run(o.data(), T, a.data());\n", "  PH(10) w.o.run(o.data(), T, a.data());\n  PH(4)\n"),
    ("  w.w13.run(h.data(), T, gu.data());\n", "  PH(1) w.w13.run(h.data(), T, gu.data());\n  PH(5)\n"),
    ("  w.w2.run(act.data(), T, op);\n", "  PH(3) w.w2.run(act.data(), T, op);\n  PH(6)\n"),
    (
        "(t1 - t0) * d); });\n}\n\nvoid check_cache",
        "(t1 - t0) * d); });\n  PH(11)\n}\n\nvoid check_cache",
    ),
    (
        "void bind_block(pybind11::module& m) {",
        "std::vector<double> phases() {\n  std::vector<double> v(phase_ns, phase_ns + 12);\n"
        "  v.push_back(phase_calls);\n"
        "  for (auto& x : phase_ns) x = 0;\n  phase_calls = 0;\n  return v;\n}\n"
        'void bind_block(pybind11::module& m) {\n  m.def("phases", &phases, "phase times (ns), then calls");',
    ),
]
ext = patched_build("phases", edits, src)

# after the swap: the engine builds its blocks on load

engine, ids = warmed_first_turns(2, threads)
model = engine.model
parts = {
    "the four linears": (0, 4, 5, 6),
    "row attention": (2,),
    "scratch buffers": (7,),
    "first RMSNorm": (8,),
    "RoPE, K/V write": (9,),
    "attention output store": (10,),
    "residual add, second RMSNorm": (1,),
    "SwiGLU's product": (3,),
    "last add": (11,),
    "element-wise, all (one thread)": (7, 8, 9, 10, 1, 3, 11),
}
print(f"{engine.kernel}, {threads} thread(s), the first {blocks} blocks; us per block (means of 200 passes)")
print("| context | part | one row | per extra row (1 to 8 rows) |")
print("|--:|---|--:|--:|")
with torch.no_grad():
    for ctx in contexts:
        cache, toks = filled_context(model, ids[0], ctx)
        per_t = {}
        for T in (1, 2, 4, 8):
            x = model.embed_tokens(toks[:, :T])
            positions = torch.arange(ctx, ctx + T)
            mask = torch.ones(T, ctx + T, dtype=torch.bool).tril(ctx)
            for _ in range(20):
                model.run_layers(x, cache, ctx, positions=positions, mask=mask, stop=blocks)
            ext.phases()
            t = time.perf_counter()
            for _ in range(200):
                model.run_layers(x, cache, ctx, positions=positions, mask=mask, stop=blocks)
            v = ext.phases()
            per_t[T] = [ns / v[-1] / 1e3 for ns in v[:-1]]
        for name, idx in parts.items():
            one, eight = (sum(per_t[T][i] for i in idx) for T in (1, 8))
            print(f"| {ctx} | {name} | {one:.1f} | {(eight - one) / 7:.1f} |")
