"""Is a verify pass dearer in situ than the same pass run again at once? Every slow pass of a few rows in
real greedy generation (MT-Bench first turns, after a warm-up) is run twice more right after it, on the same
inputs and cache slots (so it writes the same K/V and leaves the same state), and the three timings'
medians are printed per row count, for `vanilla` and `m2r2`.

Why: the tree's online cost fit (``VerifyFit``) finds a verify row costing ~2.2x what the measured curve
says (BENCHMARKS.md, twenty-fourth and twenty-fifth rounds). If the draft levels between passes left the
caches cold, the first run would be dearer than its repeats; if the rows themselves cost that much, the
three agree.

    python experiments/repeat_pass.py [PROMPTS] [THREADS]
"""

import collections
import itertools
import statistics
import sys
import time

from warmed import GEN, warmed_first_turns

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 12
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine, ids = warmed_first_turns(n_prompts, threads)
model = engine.model
run_layers = model.run_layers
timings: dict[tuple[str, int], list[tuple[float, ...]]] = collections.defaultdict(list)
method = ""


def timed_thrice(x, cache, pos, *args, **kwargs):
    """The pass as generation runs it, then twice more on the same inputs (prefills run once)."""
    t = [time.perf_counter()]
    out = run_layers(x, cache, pos, *args, **kwargs)
    t.append(time.perf_counter())
    if x.shape[1] < 40:
        for _ in range(2):
            run_layers(x, cache, pos, *args, **kwargs)
            t.append(time.perf_counter())
        timings[(method, x.shape[1])].append(tuple(b - a for a, b in itertools.pairwise(t)))
    return out


model.run_layers = timed_thrice
for method in ("vanilla", "m2r2"):
    for prompt in ids[1:]:
        engine.generate_ids(prompt, method, GEN)
print(f"{engine.kernel} kernel, {threads} thread(s), MT-Bench first turns 2..{n_prompts}; medians of the layers' pass")
print("| method | rows | passes | in situ (ms) | repeated at once (ms) | again (ms) |")
print("|---|--:|--:|--:|--:|--:|")
for (name, rows), runs in sorted(timings.items()):
    if len(runs) >= 5:
        med = [statistics.median(r[i] for r in runs) * 1e3 for i in range(3)]
        print(f"| {name} | {rows} | {len(runs)} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} |")
