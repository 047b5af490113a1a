"""How many of a verify pass's rows need the LM head: `m2r2` on MT-Bench first turns, counting per pass
the rows verified, the rows of the main chain (from the root, each row's first child among the rows:
the most probable one, as `choose` orders them), the accepted path, and the passes whose accepted path
leaves the main chain. A greedy row's head is needed only where its parent was accepted; the rows off
the main chain are needed only in the passes whose path leaves it.

    python experiments/head_rows.py [PROMPTS]
"""

import sys

from m2r2.bench.datasets import load_dataset
from m2r2.decoding.base import GenerationConfig
from m2r2.decoding.tree import TreeSpeculative
from m2r2.engine import Engine

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 20
engine = Engine(threads=1, quiet=True)
prompts = load_dataset("mt_bench", n_prompts).prompts
ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}]) for p in prompts]
gen = GenerationConfig(max_new_tokens=128)
engine.generate_ids(ids[0], "m2r2", gen)  # warm-up (and the tree's cost measurement)

counts = {"passes": 0, "rows": 0, "chain": 0, "path": 0, "off_chain": 0, "off_rows": 0, "multi": 0}
accept = TreeSpeculative._accept


def counted(tree, rows, out, gen, sampler, exit_threshold=None):
    path, nxt = accept(tree, rows, out, gen, sampler, exit_threshold)
    chain, r = [0], 0
    while True:
        kids = [c for c in rows if tree.parents[c] == r]
        if not kids:
            break
        r = kids[0]
        chain.append(r)
    counts["passes"] += 1
    counts["multi"] += len(rows) > 1
    counts["rows"] += len(rows)
    counts["chain"] += len(chain)
    counts["path"] += len(path)
    if any(r not in chain for r in path):
        counts["off_chain"] += 1
        counts["off_rows"] += len(rows) - len(chain)
    return path, nxt


TreeSpeculative._accept = staticmethod(counted)
tokens = sum(len(engine.generate_ids(p, "m2r2", gen).tokens) for p in ids[1:])
n = counts["passes"]
print(f"{engine.kernel} kernel, MT-Bench first turns 2..{n_prompts}, 128 new tokens: {tokens} tokens, {n} passes")
rows, chain, path = (counts[k] / n for k in ("rows", "chain", "path"))
print(f"per pass: rows {rows:.2f}, main chain {chain:.2f}, accepted path {path:.2f}")
print(f"passes drafting: {counts['multi']}; passes whose path leaves the main chain: {counts['off_chain']}")
lazy, second = (counts["chain"] + counts["off_rows"]) / n, counts["off_chain"] / n
print(f"head rows per pass: all rows {rows:.2f}; main chain, then the rest where needed {lazy:.2f}")
print(f"(a second head call in {second:.1%} of passes)")
