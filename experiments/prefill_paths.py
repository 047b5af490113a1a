"""A prompt's prefill on the fused C++ blocks (now: the whole prompt in one call per piece of ``PREFILL_MAX_ROWS``,
its element-wise steps and attention on every thread) against the per-op path every prefill of more than 32 rows
took before (torch's fused attention over the filled slots, one thread between the linears), alternating in one
process on the bundled model; medians of REPEATS of each per prompt length. Both paths run the same 4-bit linears.

    python experiments/prefill_paths.py [THREADS] [REPEATS]
"""

import statistics
import sys
import time

import torch

from m2r2 import model as model_mod
from m2r2.engine import Engine

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 7
engine = Engine(threads=threads, quiet=True)
model = engine.model
print(f"{engine.kernel}, {threads} thread(s), medians of {repeats} alternating prefills (ms)")
print("| prompt tokens | per-op path (before) | fused blocks (now) | now / before |")
print("|--:|--:|--:|--:|")
with torch.inference_mode():
    for n in (40, 67, 128, 256, 600):
        toks = torch.randint(100, 40000, (1, n), generator=torch.Generator().manual_seed(n))
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(repeats + 1):
            for fused in (True, False) if i % 2 else (False, True):
                model_mod.FUSED_BLOCKS = fused
                cache = model.new_cache(n + 160)
                t0 = time.perf_counter()
                model.run_layers(model.embed_tokens(toks), cache, 0)
                if i:  # the first round warms both paths
                    times[fused].append(time.perf_counter() - t0)
        before, now = (1e3 * statistics.median(times[f]) for f in (False, True))
        print(f"| {n} | {before:.1f} | {now:.1f} | {now / before:.2f} |")
model_mod.FUSED_BLOCKS = True
