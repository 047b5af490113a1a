"""Where in an answer `m2r2` gains: its rounds inside real greedy generation on MT-Bench first turns (bundled model,
after a warm-up), grouped by the round's index in its answer (passes 0-4, 5-9, ...; 40 and later together), with
tokens and rows a pass and the wall clock a pass and a token; then both methods' whole answers (prefill included),
their wall clock a token.

    python experiments/answer_position.py [PROMPTS] [THREADS]
"""

import collections
import sys
import time

from warmed import GEN, warmed_first_turns

from m2r2.decoding import tree as tree_mod

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 30
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine, ids = warmed_first_turns(n_prompts, threads)
groups: dict[int, list[float]] = collections.defaultdict(lambda: [0, 0, 0, 0.0])  # rounds, tokens, rows, seconds
one_round = tree_mod.TreeSpeculative.round


def timed(self, state, *args):
    t = time.perf_counter()
    out = one_round(self, state, *args)
    g = groups[min(state.passes - 1, 40) // 5]
    g[0] += 1
    g[1] += len(out[0])
    g[2] += out[2] + 1
    g[3] += time.perf_counter() - t
    return out


tree_mod.TreeSpeculative.round = timed
for prompt in ids[1:]:
    engine.generate_ids(prompt, "m2r2", GEN)
tree_mod.TreeSpeculative.round = one_round
whole = {}
for method in ("vanilla", "m2r2"):
    t, tokens = time.perf_counter(), 0
    for prompt in ids[1:]:
        tokens += len(engine.generate_ids(prompt, method, GEN).tokens)
    whole[method] = (time.perf_counter() - t) / tokens * 1e3
print(f"{engine.kernel} kernel, {threads} thread(s), MT-Bench first turns 2..{n_prompts}, 128 tokens")
print("| passes | rounds | tokens a pass | rows a pass | ms a pass | ms a token |")
print("|---|--:|--:|--:|--:|--:|")
for k in sorted(groups):
    n, tokens, rows, s = groups[k]
    label = f"{k * 5}-{k * 5 + 4}" if k < 8 else "40-"
    print(f"| {label} | {n} | {tokens / n:.2f} | {rows / n:.2f} | {s / n * 1e3:.2f} | {s / tokens * 1e3:.2f} |")
print(f"whole answers, ms a token: vanilla {whole['vanilla']:.2f}, m2r2 {whole['m2r2']:.2f}")
