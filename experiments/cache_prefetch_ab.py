"""A pass's layers with the blocks' early requests for their cached keys and values (csrc_avx2/block_avx2.cpp,
prefetch_cache) on and off, alternating pass by pass in one process: the bundled model over T = 1-4 rows after a
CTX-token context (MT-Bench's first prompt repeated), REPEATS passes of each; medians in milliseconds. Both settings
must give every pass the same bits.

    python experiments/cache_prefetch_ab.py [THREADS] [REPEATS] [CTX ...]
"""

import statistics
import sys

import torch
from warmed import filled_context, pass_inputs, timed_pass, warmed_first_turns

from m2r2 import amx

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 300
contexts = [int(a) for a in sys.argv[3:]] or [100, 250, 500]
engine, ids = warmed_first_turns(1, threads)
model, ext = engine.model, amx.avx2_extension()
stack = model.fused_stack()
print(f"{engine.kernel} kernel, {threads} thread(s); ms a pass of the 30 blocks, medians of {repeats} alternating")
print("| context | rows | off | on | on / off |")
print("|--:|--:|--:|--:|--:|")
with torch.no_grad():
    for ctx in contexts:
        cache, toks = filled_context(model, ids[0], ctx)
        for t in (1, 2, 3, 4):
            inputs = pass_inputs(model, cache, toks, ctx, t)
            times: dict[bool, list[float]] = {True: [], False: []}
            for i in range(repeats):
                outs = {}
                for on in (True, False) if i % 2 else (False, True):
                    ext.set_cache_prefetch(on)
                    h, ids_, layers_s, _ = timed_pass(model, ext, stack, cache, ctx, inputs)
                    times[on].append(layers_s)
                    outs[on] = (h, ids_)
                assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False], strict=True)), "bits differ"
            off, on = (1e3 * statistics.median(times[k]) for k in (False, True))
            print(f"| {ctx} | {t} | {off:.3f} | {on:.3f} | {on / off:.3f} |", flush=True)
ext.set_cache_prefetch(True)
print("every pass gave the same bits with and without the requests")
