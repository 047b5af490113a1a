"""A pass's layers with the weights where the last pass left them (in the L3 cache) and after a sweep through 1 GiB
(from memory): REPEATS rounds of one flushed pass then two back-to-back ones, 1/2/4/8 rows after a 250-token context,
medians in ms. The extra rows cost the same either way: they are bound by their multiply-adds, not the weights' stream.

    python experiments/hot_cold_pass.py [THREADS] [REPEATS]
"""

import statistics
import sys
import time

import torch
from warmed import filled_context, pass_inputs, warmed_first_turns

from m2r2 import amx

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 40
engine, ids = warmed_first_turns(1, threads)
model = engine.model
ctx = 250
cache, toks = filled_context(model, ids[0], ctx)
ext = amx.avx2_extension()
stack = model.fused_stack()
junk = torch.zeros(1 << 28, dtype=torch.int32)  # 1 GiB, past the L3 cache


def flush():
    junk.add_(1)


res = {}
with torch.no_grad():
    for t in (1, 2, 4, 8):
        x, mask, cos, sin = pass_inputs(model, cache, toks, ctx, t)

        def f(x=x, mask=mask, cos=cos, sin=sin):
            return ext.stack_forward(stack, x, cache.k, cache.v, ctx, mask, cos, sin, len(model.layers), False)

        hot, cold = [], []
        for _ in range(repeats):
            flush()
            for runs in (cold, hot, hot):
                start = time.perf_counter()
                f()
                runs.append(time.perf_counter() - start)
        res[t] = (statistics.median(cold) * 1e3, statistics.median(hot) * 1e3)
        print(f"{t} rows: from memory {res[t][0]:.3f} ms, from L3 {res[t][1]:.3f} ms", flush=True)
