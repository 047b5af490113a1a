"""Where an `m2r2` pass's time goes: the base model's layers timed per pass size (rows, tree mask or not)
inside real `m2r2` and `vanilla` generation on MT-Bench first turns, after a warm-up.

    python experiments/pass_sizes.py [PROMPTS] [THREADS]
"""

import collections
import statistics
import sys
import time

from warmed import GEN as gen
from warmed import warmed_first_turns

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 8
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
engine, ids = warmed_first_turns(n_prompts, threads)
model = engine.model
times: dict[tuple[int, bool], list[float]] = collections.defaultdict(list)
run_layers = model.run_layers


def timed(x, cache, start, hidden=None, stop=None, positions=None, mask=None):
    t = time.perf_counter()
    h = run_layers(x, cache, start, hidden, stop, positions=positions, mask=mask)
    times[(x.shape[1], mask is not None)].append(time.perf_counter() - t)
    return h


model.run_layers = timed
print(f"{engine.kernel} kernel, {threads} thread(s), {n_prompts - 1} prompts timed")
for method in ("vanilla", "m2r2"):
    times.clear()
    t0, tokens = time.perf_counter(), 0
    for prompt in ids[1:]:
        tokens += len(engine.generate_ids(prompt, method, gen).tokens)
    elapsed = time.perf_counter() - t0
    passes = sum(len(v) for k, v in times.items() if k[0] < 40)  # prefills excluded
    layers = sum(sum(v) for k, v in times.items() if k[0] < 40)
    print(f"{method}: {tokens / elapsed:.1f} tok/s, {passes} passes, layers {layers / elapsed:.2f} of the time")
    for (rows, tree), v in sorted(times.items()):
        if rows < 40:
            kind = " (tree mask)" if tree else ""
            print(f"  {rows:2d} rows{kind}: {len(v)} passes, median {statistics.median(v) * 1e3:.2f} ms")
