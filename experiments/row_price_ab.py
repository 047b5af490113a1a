"""What the tree's decisions gain from pricing an extra verify row above its fitted cost, inside real greedy generation
(bundled model, MT-Bench first turns 2..PROMPTS after a warm-up): `m2r2` with every increment of its verify curve (as
corrected online) scaled by each FACTOR, alternating the factors prompt set by prompt set, REPS passes in rotated order.

Why: the chances the tree weighs against a row run high where a row is marginal (``experiments/waste_by_source.py``),
so a dearer row may pay; a factor that helps first turns may cost second turns, which copy long chains
(``experiments/row-price.patch`` adds it as an option for ``m2r2 bench``).

    python experiments/row_price_ab.py [PROMPTS] [THREADS] [REPS] [FACTORS]   (e.g. 40 2 3 1.0,1.3,1.6,2.0)
"""

import sys
import time

from warmed import GEN, tally, warmed_first_turns

from m2r2.decoding import tree as tree_mod

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 40
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
factors = [float(f) for f in (sys.argv[4] if len(sys.argv) > 4 else "1.0,1.3,1.6,2.0").split(",")]
engine, ids = warmed_first_turns(n_prompts, threads)
costs_for, now = tree_mod.TreeSpeculative.costs_for, {"factor": 1.0}


def priced(self, state):
    costs = costs_for(self, state)
    if costs is None or now["factor"] == 1.0:
        return costs
    v0 = costs.verify[0]
    return tree_mod.TreeCosts(costs.draft, [v0 + now["factor"] * (v - v0) for v in costs.verify], costs.start)


tree_mod.TreeSpeculative.costs_for = priced
totals = {f: [0, 0, 0.0, 0.0] for f in factors}  # tokens, passes, rows, seconds
for rep in range(reps):
    for factor in factors if rep % 2 == 0 else factors[::-1]:
        now["factor"] = factor
        for prompt in ids[1:]:
            t = time.perf_counter()
            r = engine.generate_ids(prompt, "m2r2", GEN)
            tally(totals[factor], r, time.perf_counter() - t)
print(f"{engine.kernel} kernel, {threads} thread(s), MT-Bench first turns 2..{n_prompts}, {reps} passes")
print("| row priced at | tokens a second | tokens a pass | rows a pass | seconds |")
print("|--:|--:|--:|--:|--:|")
for factor, (tokens, passes, rows, seconds) in totals.items():
    print(f"| {factor:.1f}x | {tokens / seconds:.1f} | {tokens / passes:.3f} | {rows / passes:.3f} | {seconds:.2f} |")
