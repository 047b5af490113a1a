"""A pass's layers with one of the q4-avx2 build's same-bits switches on and off, alternating pass by pass in one
process: the bundled model over T rows after a CTX-token context (MT-Bench's first prompt repeated), REPEATS passes of
each; medians in milliseconds. Both settings must give every pass the same bits. SWITCH is one of the extension's
same-bits setters: ``set_cache_prefetch`` (the blocks' early requests for their cached keys and values,
csrc_avx2/block_avx2.cpp), ``set_avx512_attention``, ``set_avx512_silu``, or, with experiments/shared-attention.patch
applied (``git apply``; tried in the forty-second round, not kept), ``set_shared_attention`` (a pass's rows scoring
and weighing the prefix they share together).

    python experiments/pass_switch_ab.py SWITCH [THREADS] [REPEATS] [CTX ...]   (ROWS=1,2,3,4 by default)
"""

import os
import statistics
import sys

import torch
from warmed import filled_context, pass_inputs, timed_pass, warmed_first_turns

from m2r2 import amx

switch_name = sys.argv[1]
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 300
contexts = [int(a) for a in sys.argv[4:]] or [100, 250, 500]
rows = [int(a) for a in os.environ.get("ROWS", "1,2,3,4").split(",")]
engine, ids = warmed_first_turns(1, threads)
model, ext = engine.model, amx.avx2_extension()
switch = getattr(ext, switch_name)
stack = model.fused_stack()
print(f"{switch_name}: {engine.kernel} kernel, {threads} thread(s); ms a pass of the 30 blocks, medians of {repeats}")
print("| context | rows | off | on | on / off |")
print("|--:|--:|--:|--:|--:|")
with torch.no_grad():
    for ctx in contexts:
        cache, toks = filled_context(model, ids[0], ctx)
        for t in rows:
            inputs = pass_inputs(model, cache, toks, ctx, t)
            times: dict[bool, list[float]] = {True: [], False: []}
            for i in range(repeats):
                outs = {}
                for on in (True, False) if i % 2 else (False, True):
                    switch(on)
                    h, ids_, layers_s, _ = timed_pass(model, ext, stack, cache, ctx, inputs)
                    times[on].append(layers_s)
                    outs[on] = (h, ids_)
                assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False], strict=True)), "bits differ"
            off, on = (1e3 * statistics.median(times[k]) for k in (False, True))
            print(f"| {ctx} | {t} | {off:.3f} | {on:.3f} | {on / off:.3f} |", flush=True)
switch(True)
print(f"every pass gave the same bits with {switch_name} on and off")
