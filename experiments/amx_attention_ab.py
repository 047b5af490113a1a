"""A pass of the 30 layers with the row attention's scores on AMX tiles (csrc_avx2/attend_amx.cpp) against the AVX-512
build (attend_avx512.cpp), alternating pass by pass in one process: the bundled model over T = 1, 2, 4 rows after a
CTX-token context (MT-Bench's first prompt repeated), the mask showing the context and the rows causally, 300 passes
of each; medians in milliseconds. MIN_KEYS sets the fewest keys a vector needs for the tiles (1: every vector, to see
the tiles' own curve; default: the kernel's); CAP the cache's capacity (default CTX + 64; decoding passes a mask
padded to it); BLOCK > 1 alternates blocks of that many passes instead, each after 10 untimed ones (using the tiles
slows the core's other work for a while after: pass by pass, the AVX-512 passes pay part of the tiles' cost).

    [MIN_KEYS=N] [CAP=N] [BLOCK=N] python experiments/amx_attention_ab.py [THREADS] [CTX ...]
"""

import os
import statistics
import sys
import time

import torch
from warmed import warmed_first_turns

from m2r2 import amx
from m2r2.cache import KVCache

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
contexts = [int(a) for a in sys.argv[2:]] or [250, 500]
engine, ids = warmed_first_turns(2, threads)
ext = amx.avx2_extension()
if ext is None or not ext.set_amx_attention(True):
    sys.exit("the AMX row attention does not run on this CPU (it needs AMX-BF16)")
least = int(os.environ.get("MIN_KEYS", ext.set_amx_attention_min_keys(1)))
block = int(os.environ.get("BLOCK", 1))
settle = 10 if block > 1 else 0
ext.set_amx_attention_min_keys(least)
model = engine.model
print(
    f"{engine.kernel} kernel, {threads} thread(s), tiles for vectors that see {least}+ keys; "
    "ms per pass of the 30 blocks (medians of 300 alternating passes)"
)
print("| context | capacity | rows | AVX-512 | AMX | AMX / AVX-512 |")
print("|--:|--:|--:|--:|--:|--:|")
with torch.no_grad():
    for ctx in contexts:
        cap = int(os.environ.get("CAP", ctx + 64))
        cache = KVCache(model.cfg, cap, dtype=torch.bfloat16)
        toks = torch.tensor([(ids[0] * (ctx // len(ids[0]) + 1))[:ctx]])
        model.run_layers(model.embed_tokens(toks), cache, 0)
        for T in (1, 2, 4):
            x = model.embed_tokens(toks[:, :T])
            positions = torch.arange(ctx, ctx + T)
            mask = torch.ones(T, ctx + T, dtype=torch.bool).tril(ctx)
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(300 // block):
                for on in (True, False):
                    ext.set_amx_attention(on)
                    for i in range(block + settle):
                        t = time.perf_counter()
                        model.run_layers(x, cache, ctx, positions=positions, mask=mask)
                        if i >= settle:
                            times[on].append(time.perf_counter() - t)
            off, on = (statistics.median(times[k]) * 1e3 for k in (False, True))
            print(f"| {ctx} | {cap} | {T} | {off:.3f} | {on:.3f} | {on / off:.3f} |", flush=True)
ext.set_amx_attention(True)
