"""A pass's layers and head on this build against the ``csrc_avx2`` sources in DIR (a copy of older ones), both in
one process, on the same weights in memory and alternating pass by pass, so that neither the machine's drift nor
where the weights lie favours one. One engine (the bundled model) and one CTX-token context (MT-Bench's first
prompt repeated); each build makes its own fused stack of the same weight tensors; then, for T = 1, 2, 4 rows,
REPEATS passes of each over T rows after the context (the pass writes the same cache slots every time) and the
certified head argmax, as a verify pass runs them; then the 8-bit head's linear alone, back to back (its 28 MB then
sit in the L3 cache), 1-8 rows. Prints medians in milliseconds, and checks that both builds give every pass the same
bits.

    python experiments/stream_ab.py DIR [THREADS] [CTX] [REPEATS]
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from m2r2 import amx

src = Path(sys.argv[1])
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 250
repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 300

builds = {
    "new": amx.avx2_extension(),
    "old": amx._build("stream_old", sorted(src.glob("*.cpp")), sorted(src.glob("*.h")), list(amx.AVX2_FLAGS)),
}
assert all(builds.values()), "a build failed"

from warmed import filled_context, pass_inputs, timed_pass, warmed_first_turns  # noqa: E402

engine, ids = warmed_first_turns(1, threads)
model = engine.model
cache, toks = filled_context(model, ids[0], ctx)
stacks = {}
for name, ext in builds.items():  # each build's fused blocks and stack over the same weight tensors
    amx.avx2_extension = lambda ext=ext: ext
    for block in model.layers:
        block.__dict__.pop("_fused", None)
    model.__dict__.pop("_stack", None)
    stacks[name] = model.fused_stack()
    assert stacks[name] is not None, "no fused stack"

times = {(name, t, part): [] for name in builds for t in (1, 2, 4) for part in ("layers", "head")}
with torch.no_grad():
    for t in (1, 2, 4):
        inputs = pass_inputs(model, cache, toks, ctx, t)
        for i in range(repeats):
            outs = {}
            for name in builds if i % 2 else reversed(builds):
                ext = builds[name]
                amx.avx2_extension = lambda ext=ext: ext
                h, out, layers_s, head_s = timed_pass(model, ext, stacks[name], cache, ctx, inputs)
                times[(name, t, "layers")].append(layers_s)
                times[(name, t, "head")].append(head_s)
                outs[name] = (h, out)
            assert torch.equal(outs["new"][0], outs["old"][0]) and torch.equal(outs["new"][1], outs["old"][1])

print(f"{engine.kernel}, {threads} thread(s), context {ctx}, medians of {repeats} alternating passes (ms)")
print("every pass gave the same bits on both builds")
print("| rows | layers old | layers new | head old | head new |")
print("|--:|--:|--:|--:|--:|")
for t in (1, 2, 4):
    med = {k: 1e3 * statistics.median(v) for k, v in times.items() if k[1] == t}
    print(
        f"| {t} | {med[('old', t, 'layers')]:.3f} | {med[('new', t, 'layers')]:.3f} | "
        f"{med[('old', t, 'head')]:.3f} | {med[('new', t, 'head')]:.3f} |"
    )

head = model.lm_head
print("the 8-bit head's linear alone, back to back (L3-hot), medians of 60 alternating calls (ms)")
print("| rows | " + " | ".join(f"{r}" for r in range(1, 9)) + " |")
print("|---|" + "--:|" * 8)
hot = {(name, r): [] for name in builds for r in range(1, 9)}
with torch.no_grad():
    for r in range(1, 9):
        x = torch.randn(r, head.in_features, generator=torch.Generator().manual_seed(r)).bfloat16()
        for i in range(60):
            got = {}
            for name in builds if i % 2 else reversed(builds):
                op = getattr(builds[name], head.op)
                t0 = time.perf_counter()
                got[name] = op(x, head.qbytes, head.scales)
                hot[(name, r)].append(time.perf_counter() - t0)
            assert torch.equal(got["old"], got["new"])
for name in builds:
    print(f"| {name} | " + " | ".join(f"{1e3 * statistics.median(hot[(name, r)]):.3f}" for r in range(1, 9)) + " |")
