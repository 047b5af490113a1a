"""Whole draft trees in one C++ call (``draft_tree``, the default) against the same trees drafted level by level
(``draft_level`` per level, Python between), side by side in one process: MT-Bench first turns, each answered by
`vanilla`, then both `m2r2` variants in an order that rotates prompt by prompt, each variant with its own measured
costs (trees timed as trees, levels as levels). Prints each variant's tokens/s, the median of per-prompt speedups
over `vanilla`, tokens, rows and draft levels a pass, its measured level and start costs, and checks that every
answer is `vanilla`'s.

    python experiments/draft_tree_ab.py [PROMPTS] [THREADS]
"""

import copy
import statistics
import sys
import time

from warmed import GEN, warmed_first_turns

from m2r2.decoding.tree import SeededDrafter, measure_tree_costs


class LevelByLevel(SeededDrafter):
    """The shipped drafter without its one-call trees: ``TreeSpeculative.draft`` runs its levels one by one."""

    grow = None


n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 60
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine, ids = warmed_first_turns(n_prompts, threads)
trees = engine.strategy("m2r2")
levels = copy.copy(trees)
levels.drafter = LevelByLevel(trees.drafter.fast)
levels.costs = measure_tree_costs(engine.model, levels.drafter, trees.max_nodes)
variants = {"trees": trees, "levels": levels}
levels.generate(ids[0], GEN)  # warm-up of the second variant (the first warmed up in warmed_first_turns)

spent = {name: 0.0 for name in ["vanilla", *variants]}
tokens = dict.fromkeys(spent, 0)
counts = {name: {"passes": 0, "rows": 0.0, "levels": 0.0} for name in variants}
ratios = {name: [] for name in variants}
order = list(variants)
for i, prompt in enumerate(ids[1:]):
    t = time.perf_counter()
    ref = engine.generate_ids(prompt, "vanilla", GEN)
    base = time.perf_counter() - t
    spent["vanilla"] += base
    tokens["vanilla"] += len(ref.tokens)
    for name in order[i % 2 :] + order[: i % 2]:
        t = time.perf_counter()
        out = variants[name].generate(prompt, GEN)
        seconds = time.perf_counter() - t
        assert out.tokens == ref.tokens, f"{name} changed the answer to prompt {i + 1}"
        spent[name] += seconds
        tokens[name] += len(out.tokens)
        ratios[name].append(base / seconds)
        n = out.stats["verify_passes"]
        counts[name]["passes"] += n
        counts[name]["rows"] += out.stats["verify_rows_per_pass"] * n
        counts[name]["levels"] += out.stats["draft_layers_per_token"] * len(out.tokens)

print(
    f"{engine.kernel}, {threads} thread(s), MT-Bench first turns 2..{n_prompts}, 128 new tokens; all vanilla's answers"
)
print(
    "| variant | tok/s | median speedup | tokens a pass | rows a pass | draft levels a pass | level (2 nodes) | start |"
)
print("|---|--:|--:|--:|--:|--:|--:|--:|")
print(f"| vanilla | {tokens['vanilla'] / spent['vanilla']:.1f} | 1.00x | 1.00 | 1.00 | - | - | - |")
for name, strat in variants.items():
    c = counts[name]
    step = strat.costs.verify[0]
    print(
        f"| {name} | {tokens[name] / spent[name]:.1f} | {statistics.median(ratios[name]):.2f}x | "
        f"{tokens[name] / c['passes']:.2f} | {c['rows'] / c['passes']:.2f} | {c['levels'] / c['passes']:.2f} | "
        f"{strat.costs.draft[1] / step:.3f} | {strat.costs.start / step:.3f} |"
    )
