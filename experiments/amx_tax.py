"""Where a pass's time goes, section by section, with the row attention on AMX tiles and on AVX-512: a build of
``csrc_avx2/`` whose blocks add each thread's time stamp counter ticks in four sections (the attention, the output
projection, gate and up with SwiGLU, the down projection) to a table read through ctypes; the bundled model over T
rows after a CTX-token context, every vector on the tiles (threshold 1 key) or none, alternating pass by pass, 400
passes each. Prints the layers' median and each section's mean microseconds a thread and pass (ticks at the TSC's
rate, read from /proc/cpuinfo's first "cpu MHz").

    python experiments/amx_tax.py [THREADS] [CTX,...] [T,...]
"""

import ctypes
import statistics
import sys

import torch
from warmed import filled_context, pass_inputs, patched_build, timed_pass, warmed_first_turns

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
contexts = [int(a) for a in (sys.argv[2] if len(sys.argv) > 2 else "64,250").split(",")]
rows = [int(a) for a in (sys.argv[3] if len(sys.argv) > 3 else "1,4").split(",")]
SECTIONS = ("attention", "o-proj", "gate/up", "down")
edits = [
    ("struct Team {", 'extern "C" { uint64_t m2r2_ticks[4][8]; }\nstruct Team {'),
    ("    attention_units(r.qf", "    const uint64_t p0 = __rdtsc();\n    attention_units(r.qf"),
    (
        "static_cast<float>(std::pow(static_cast<double>(D), -0.5)), u0, u1);",
        "static_cast<float>(std::pow(static_cast<double>(D), -0.5)), u0, u1);\n"
        "    m2r2_ticks[team.id][0] += __rdtsc() - p0;",
    ),
    (
        "    for (int64_t i = 0; i < T * nq; i += 8) store8_bf16",
        "    const uint64_t p1 = __rdtsc();\n    for (int64_t i = 0; i < T * nq; i += 8) store8_bf16",
    ),
    (
        "if (b0 < b1) add_blocks(xp, r.a, T, d, b0, b1);",
        "if (b0 < b1) add_blocks(xp, r.a, T, d, b0, b1);\n    m2r2_ticks[team.id][1] += __rdtsc() - p1;",
    ),
    ("    const int64_t half = inter / 8;", "    const uint64_t p2 = __rdtsc();\n    const int64_t half = inter / 8;"),
    (
        "offset_inputs(w.w2.bits, l2), r.down.q, r.down.step, r.down.qsum);",
        "offset_inputs(w.w2.bits, l2), r.down.q, r.down.step, r.down.qsum);\n"
        "    m2r2_ticks[team.id][2] += __rdtsc() - p2;",
    ),
    ("    w.w2.run_blocks(l2", "    const uint64_t p3 = __rdtsc();\n    w.w2.run_blocks(l2"),
    (
        "if (b0 < b1) add_blocks(r.a, op, T, d, b0, b1);",
        "if (b0 < b1) add_blocks(r.a, op, T, d, b0, b1);\n    m2r2_ticks[team.id][3] += __rdtsc() - p3;",
    ),
]
ext = patched_build("q4_sections", edits)
ticks = (ctypes.c_uint64 * 32).in_dll(ctypes.CDLL(ext.__file__), "m2r2_ticks")
with open("/proc/cpuinfo") as f:
    mhz = next(float(line.split(":")[1]) for line in f if line.startswith("cpu MHz"))
engine, ids = warmed_first_turns(1, threads)
model = engine.model
stack = model.fused_stack()
ext.set_amx_attention_min_keys(1)
print(f"{threads} thread(s); microseconds a thread and pass by section (TSC at {mhz:.0f} MHz); layers: median ms")
print("| context | rows | path | layers | " + " | ".join(SECTIONS) + " |")
print("|--:|--:|---|--:|" + "--:|" * len(SECTIONS))
with torch.no_grad():
    for ctx in contexts:
        cache, toks = filled_context(model, ids[0], ctx)
        for t in rows:
            inputs = pass_inputs(model, cache, toks, ctx, t)
            total = {p: [0] * len(SECTIONS) for p in ("AVX-512", "AMX")}
            layers = {p: [] for p in total}
            for i in range(400):
                for path in ("AVX-512", "AMX") if i % 2 else ("AMX", "AVX-512"):
                    ext.set_amx_attention(path == "AMX")
                    for j in range(32):
                        ticks[j] = 0
                    layers[path].append(timed_pass(model, ext, stack, cache, ctx, inputs)[2])
                    for s in range(len(SECTIONS)):
                        total[path][s] += sum(ticks[th * 8 + s] for th in range(threads))
            for path in total:
                secs = " | ".join(f"{v / 400 / threads / mhz:.0f}" for v in total[path])
                print(f"| {ctx} | {t} | {path} | {1e3 * statistics.median(layers[path]):.3f} | {secs} |", flush=True)
ext.set_amx_attention(True)
