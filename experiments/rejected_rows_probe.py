"""Would a verify pass's rejected rows make free proposals for the next round? When a round's accepted path ends at a
node with a child in the pass that the full model rejected (the copy or draft said c, the model said b), that child's
row already holds the model's next token after c. The next round starts from b; this counts how often the rejected
row's token is the token the model then emits after b (``hit1``), and, where it is and the rejected child's own
child in the pass carried that token, whether that row's token is the one after it too (``hit2``). `m2r2` greedy on
MT-Bench first turns 2..PROMPTS (the first answers once to warm up), 128 new tokens, 2 threads.

    python experiments/rejected_rows_probe.py [PROMPTS]
"""

import collections
import itertools
import sys

from warmed import GEN, warmed_first_turns

from m2r2.decoding import tree as tree_mod

n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
engine, ids = warmed_first_turns(n, 2)
TS = tree_mod.TreeSpeculative
accept, run_round = TS._accept, TS.round
last: dict[str, tuple] = {}
log: list[tuple] = []


def _accept(tree, rows, out, *args, **kwargs):
    result = accept(tree, rows, out, *args, **kwargs)
    last["pass"] = (tree, list(rows), out.tolist(), result)
    return result


def _round(self, *args, **kwargs):
    out = run_round(self, *args, **kwargs)
    log.append((last["pass"], out[0]))
    return out


TS._accept = staticmethod(_accept)
TS.round = _round
counts: collections.Counter = collections.Counter()
for prompt in ids[1:]:
    log.clear()
    engine.generate_ids(prompt, "m2r2", GEN)
    for ((tree, rows, out, (path, _)), _), (following, emitted_next) in itertools.pairwise(log):
        counts["rounds"] += 1
        rejected = [r for r in rows if tree.parents[r] == path[-1] and r not in path]
        if not rejected:
            continue
        counts["rounds with a rejected child of the path's end"] += 1
        child, t1 = rejected[0], emitted_next[0]
        if out[rows.index(child)] != t1:
            continue
        counts["hit1: the rejected row's token came next"] += 1
        counts["hit1 where the next round accepted nothing"] += len(following[3][0]) == 1
        kids = [r for r in rows if tree.parents[r] == child]
        after = len(emitted_next) > 1 and kids and out[rows.index(kids[0])] == emitted_next[1]
        if kids and tree.tokens[kids[0]] == t1 and after:
            counts["hit2: and the row after it"] += 1
for key, value in counts.items():
    print(f"{key}: {value}")
