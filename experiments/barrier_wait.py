"""How long a pass's threads wait at the team's barriers (csrc_avx2/block_avx2.cpp, Team::sync): a copy of
``csrc_avx2/`` whose barrier adds each thread's time from arriving to leaving to a per-thread, per-barrier counter is
built as its own extension; the bundled model (or M2R2_MODEL's) then runs REPEATS passes of its whole stack over
T = 1, 2, 4 rows after a CTX-token context, back to back (no head between them, so more of the weights stay in L3
than in generation). Prints, per thread, the pass's layers, the time spent waiting at each of
a block's 6 barriers (summed over the blocks), and its total; the difference between the threads' waits at a barrier
is the imbalance of the step before it, the smaller of the two about the barrier's own latency.

    python experiments/barrier_wait.py [THREADS] [CTX] [REPEATS]
"""

import sys
import time

import torch
from warmed import filled_context, pass_inputs, patched_build, warmed_first_turns

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 250
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 200

edits = [
    (  # counters: [thread][barrier] nanoseconds, and which barrier of the block a thread is at
        "struct Team {\n",
        "#include <chrono>\ndouble wait_ns[4][6];\nthread_local int barrier_no;\ninline double now_ns() {\n  return "
        "std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count();\n}\n\n"
        "struct Team {\n",
    ),
    (
        "    if (size == 1) return;\n    const int phase",
        "    if (size == 1) return;\n    const double t0 = now_ns();\n    struct Done {\n      int id;\n"
        "      double t0;\n"
        "      ~Done() {\n        if (id < 4) wait_ns[id][barrier_no % 6] += now_ns() - t0;\n        ++barrier_no;\n"
        "      }\n    } done{id, t0};\n    const int phase",
    ),
    (
        "void bind_block(pybind11::module& m) {\n",
        'void bind_block(pybind11::module& m) {\n  m.def("wait_ns", [] {\n    std::vector<double> v(&wait_ns[0][0], '
        "&wait_ns[0][0] + 24);\n    for (auto& row : wait_ns)\n      for (auto& x : row) x = 0;\n"
        "    return v;\n  });\n",
    ),
]
ext = patched_build("barrier_wait", edits)


engine, ids = warmed_first_turns(1, threads)
model = engine.model
for block_ in model.layers:
    block_.__dict__.pop("_fused", None)
model.__dict__.pop("_stack", None)
stack = model.fused_stack()
assert stack is not None, "no fused stack"
cache, toks = filled_context(model, ids[0], ctx)
n = len(model.layers)
names = ["qkv", "RoPE", "attention", "o + add", "gate/up + SwiGLU", "down"]
print(f"{engine.kernel}, {threads} threads, context {ctx}, {n} blocks, {repeats} passes each; us a pass")
print("| rows | thread | layers | " + " | ".join(f"after {x}" for x in names) + " | waited |")
print("|--:|--:|--:|" + "--:|" * (len(names) + 1))
with torch.no_grad():
    for t in (1, 2, 4):
        x, mask, cos, sin = pass_inputs(model, cache, toks, ctx, t)
        for _ in range(20):
            ext.stack_forward(stack, x, cache.k, cache.v, ctx, mask, cos, sin, n, False)
        ext.wait_ns()
        spent = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ext.stack_forward(stack, x, cache.k, cache.v, ctx, mask, cos, sin, n, False)
            spent.append(time.perf_counter() - t0)
        w = ext.wait_ns()
        layers = 1e6 * sorted(spent)[len(spent) // 2]
        for th in range(min(threads, 4)):
            row = [w[th * 6 + b] / repeats / 1e3 for b in range(6)]
            cells = " | ".join(f"{v:.0f}" for v in row)
            print(f"| {t} | {th} | {layers:.0f} | {cells} | {sum(row):.0f} |")
