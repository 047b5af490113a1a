"""In `m2r2` rounds where prompt lookup or the answer store offers a copied chain, what does the fast
stream's draft add, and what does judging drafting apart in those rounds (`TreeSpeculative.split_by_copies`)
buy? MT-Bench conversations (both turns, cache carried, 1 thread, after a warm-up): vanilla, `m2r2` with one
running estimate for every round (``one``, the old accounting) and with the two kinds of round judged apart
(``split``), interleaved prompt by prompt. Each round's accepted path is split into nodes only the fast stream
drafted and nodes a copy proposed (a node both proposed counts as copied).

    python experiments/copy_rounds.py [PROMPTS]
"""

import collections
import statistics
import sys

from m2r2.bench.datasets import load_dataset
from m2r2.bench.harness import answer
from m2r2.decoding import tree as tree_mod
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 20
engine = Engine(threads=1, quiet=True)
strategy = engine.strategy("m2r2")
prompts = load_dataset("mt_bench", n_prompts + 1).prompts
gen = GenerationConfig(max_new_tokens=128)
policy = "one"
stats: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
accept = tree_mod.TreeSpeculative._accept


def recording(tree, rows, out, gen, sampler, exit_threshold=None):
    """The verifier's own acceptance, with the round's path split by who proposed each node."""
    path, nxt = accept(tree, rows, out, gen, sampler, exit_threshold)
    s = stats[(policy, "chain" if tree.copy_probs else "no chain")]
    s["rounds"] += 1
    s["drafting rounds"] += any(sc > 0 for sc in tree.scores[1:])
    s["accepted from copies"] += sum(1 for r in path[1:] if r in tree.copy_probs)
    fast = sum(1 for r in path[1:] if r not in tree.copy_probs)
    s["accepted from the fast stream alone"] += fast
    s["rounds the fast stream alone added to"] += fast > 0
    return path, nxt


tree_mod.TreeSpeculative._accept = staticmethod(recording)
runs: dict[str, list[dict]] = {"vanilla": [], "one": [], "split": []}


def run(name: str, p) -> dict:
    global policy
    if name == "vanilla":
        return answer(engine, p, "vanilla", gen)
    policy = name
    strategy.split_by_copies = name == "split"
    return answer(engine, p, "m2r2", gen)


for name in runs:
    run(name, prompts[0])  # warm-up (and the tree's cost measurement)
stats.clear()
for i, p in enumerate(prompts[1:]):
    order = list(runs)
    for name in order[i % 3 :] + order[: i % 3]:
        runs[name].append(run(name, p))

print(f"{engine.kernel} kernel, 1 thread, MT-Bench prompts 2..{n_prompts + 1}, both turns, 128 tokens a turn")
for (pol, kind), s in sorted(stats.items()):
    r = max(s["rounds"], 1)
    print(
        f"{pol:5s} {kind:8s}: {s['rounds']} rounds ({s['drafting rounds']} drafted); per round "
        f"{s['accepted from copies'] / r:.2f} accepted from copies, "
        f"{s['accepted from the fast stream alone'] / r:.2f} from the fast stream alone "
        f"(in {s['rounds the fast stream alone added to'] / r:.0%} of them)"
    )
base = runs["vanilla"]
for name, rs in runs.items():
    ratio = statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, base, strict=True))
    same = sum(r["ids"] == b["ids"] for r, b in zip(rs, base, strict=True))
    passes = sum(s.get("verify_passes", 0) for r in rs for s in r["stats"])
    tokens = sum(r["tokens"] for r in rs)
    print(
        f"{name:7s} {sum(r['seconds'] for r in rs):6.1f} s, median {ratio:.3f}x of vanilla, {same}/{len(rs)} identical"
        + (f", {tokens / passes:.2f} tokens per pass" if passes else "")
    )
