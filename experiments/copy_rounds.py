"""In `m2r2` rounds where prompt lookup or the answer store offers a copied chain, what does the fast
stream's draft add? Greedy generation on MT-Bench conversations (both turns, cache carried, 1 thread);
each round's accepted path is split into nodes only the fast stream drafted and nodes a copy proposed
(a node both proposed counts as copied). Prints, for rounds with and without a copied chain: rounds,
drafting rounds, accepted tokens per round from copies and from the fast stream alone.

    python experiments/copy_rounds.py [PROMPTS]

(Commit 4765123 held this script's A/B of judging drafting apart in the two kinds of round,
``TreeSpeculative.split_by_copies``: more tokens per pass, the same wall clock; not kept. Its output is in
``copy_rounds.out.txt``.)
"""

import collections
import sys

from m2r2.bench.datasets import load_dataset
from m2r2.bench.harness import answer
from m2r2.decoding import tree as tree_mod
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 20
engine = Engine(threads=1, quiet=True)
prompts = load_dataset("mt_bench", n_prompts).prompts
gen = GenerationConfig(max_new_tokens=128)
stats: dict[str, collections.Counter] = {"chain": collections.Counter(), "no chain": collections.Counter()}
accept = tree_mod.TreeSpeculative._accept


def recording(tree, rows, out, gen, sampler, exit_threshold=None):
    """The verifier's own acceptance, with the round's path split by who proposed each node."""
    path, nxt = accept(tree, rows, out, gen, sampler, exit_threshold)
    s = stats["chain" if tree.copy_probs else "no chain"]
    s["rounds"] += 1
    s["drafting rounds"] += any(sc > 0 for sc in tree.scores[1:])
    s["accepted from copies"] += sum(1 for r in path[1:] if r in tree.copy_probs)
    fast = sum(1 for r in path[1:] if r not in tree.copy_probs)
    s["accepted from the fast stream alone"] += fast
    s["rounds the fast stream alone added to"] += fast > 0
    return path, nxt


tree_mod.TreeSpeculative._accept = staticmethod(recording)
for p in prompts:
    answer(engine, p, "m2r2", gen)
print(f"{engine.kernel} kernel, 1 thread, MT-Bench 1..{n_prompts}, both turns, 128 tokens a turn")
for kind, s in stats.items():
    r = max(s["rounds"], 1)
    print(
        f"{kind:8s}: {s['rounds']} rounds ({s['drafting rounds']} drafted); per round "
        f"{s['accepted from copies'] / r:.2f} accepted from copies, "
        f"{s['accepted from the fast stream alone'] / r:.2f} from the fast stream alone; "
        f"the fast stream alone added tokens in {s['rounds the fast stream alone added to'] / r:.0%} of them"
    )
