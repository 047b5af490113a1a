"""Draft-level cost of several seeded streams, interleaved in one process (so machine noise hits all alike).

    python experiments/level_costs.py FILE [FILE ...]     # each a seeded adapter file; the shipped one is always first

For 1, 2 and 4 open nodes at a 200-token context: 60 rounds, in each a start + one level of every
stream and one headless one-token step; printed as minimum and median relative to the step's.
"""

import statistics
import sys
import time

import torch

from m2r2.decoding.tree import Tree
from m2r2.engine import Engine

engine = Engine(None, threads=1, quiet=True)
model = engine.model
drafters = {"shipped": engine.strategy("m2r2").drafter}
for path in sys.argv[1:]:
    drafters[path] = engine.strategy("m2r2", adapters=path).drafter
ctx = 200
cache = model.new_cache(ctx + 8)
h = torch.zeros(1, 1, model.cfg.hidden_size, dtype=model.dtype)
one = torch.ones(1, 1, dtype=torch.long)
with torch.inference_mode():
    model(torch.arange(ctx)[None], cache, 0, last_only=True)
    for n in (1, 2, 4):
        tree = Tree(list(range(1, n + 1)), [-1] * n, [0] * n, [1.0] * n)
        times: dict[str, list[float]] = {k: [] for k in drafters}
        steps = []
        for _ in range(60):
            for name, d in drafters.items():
                t = time.perf_counter()
                d.start(h, cache, ctx)
                d.top(tree, list(range(n)), 2)
                times[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            model.run_layers(model.embed_tokens(one), cache, ctx)
            steps.append(time.perf_counter() - t)
        lo, mid = min(steps), statistics.median(steps)
        print(f"{n} open node(s); one-token step (no head) median {mid * 1e3:.2f} ms")
        for name, v in times.items():
            print(f"  {name}: min {min(v) / lo:.3f}, median {statistics.median(v) / mid:.3f} of a step")
