"""A pass's layers and head with the packed weights on huge pages (one buffer, ``m2r2.hugepages``: what the engine
now does) against each linear layer's weights in its own allocation on 4 KB pages (before), in one process on one
engine, alternating pass by pass. Each placement gets its own fused stack. CTX-token context (MT-Bench's first prompt
repeated); T = 1, 2, 4, 8 rows; REPEATS passes of each, the fused blocks and the certified head argmax as a verify
pass runs them. Prints medians in milliseconds and the process's AnonHugePages; checks that both placements give
every pass the same bits. (The KV cache on huge pages as well, tried the same way, changed nothing measurable:
one-row layers 2.85 -> 2.52 ms with it, 2.93 -> 2.52 without.)

    python experiments/huge_pages_ab.py [THREADS] [CTX] [REPEATS]
"""

import statistics
import sys
from pathlib import Path

import torch

from m2r2 import amx
from m2r2.kernels import _AmxLinear

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 250
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 200

from warmed import filled_context, pass_inputs, timed_pass, warmed_first_turns  # noqa: E402

engine, ids = warmed_first_turns(1, threads)
model = engine.model
cache, toks = filled_context(model, ids[0], ctx)
linears = [m for m in model.modules() if isinstance(m, _AmxLinear)]
placed = {"huge pages": [(m.qbytes, m.scales) for m in linears]}
placed["4 KB pages"] = [(q.clone(), s.clone()) for q, s in placed["huge pages"]]  # each its own allocation


def use(name: str) -> None:
    for m, (q, s) in zip(linears, placed[name], strict=True):
        m.qbytes, m.scales = q, s


stacks = {}
for name in placed:  # each placement's fused blocks and stack
    use(name)
    for block in model.layers:
        block.__dict__.pop("_fused", None)
    model.__dict__.pop("_stack", None)
    stacks[name] = model.fused_stack()
    assert stacks[name] is not None, "no fused stack"

ext = amx.avx2_extension()
rows = (1, 2, 4, 8)
times = {(name, t, part): [] for name in placed for t in rows for part in ("layers", "head")}
with torch.no_grad():
    for t in rows:
        inputs = pass_inputs(model, cache, toks, ctx, t)
        for i in range(repeats):
            outs = {}
            for name in placed if i % 2 else reversed(list(placed)):
                use(name)
                h, out, layers_s, head_s = timed_pass(model, ext, stacks[name], cache, ctx, inputs)
                times[(name, t, "layers")].append(layers_s)
                times[(name, t, "head")].append(head_s)
                outs[name] = (h, out)
            (a, b), (c, d) = outs.values()
            assert torch.equal(a, c) and torch.equal(b, d)

huge = next(line for line in Path("/proc/self/smaps_rollup").read_text().splitlines() if "AnonHuge" in line)
print(f"{engine.kernel}, {threads} thread(s), context {ctx}, medians of {repeats} alternating passes (ms); {huge}")
print("every pass gave the same bits with either placement")
print("| rows | layers, 4 KB pages | layers, huge pages | head, 4 KB pages | head, huge pages |")
print("|--:|--:|--:|--:|--:|")
for t in rows:
    med = {(k[0], k[2]): 1e3 * statistics.median(v) for k, v in times.items() if k[1] == t}
    print(
        f"| {t} | {med[('4 KB pages', 'layers')]:.3f} | {med[('huge pages', 'layers')]:.3f} | "
        f"{med[('4 KB pages', 'head')]:.3f} | {med[('huge pages', 'head')]:.3f} |"
    )
