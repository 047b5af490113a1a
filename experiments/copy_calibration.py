"""How often a copied node is accepted against the chance the tree prices it at, inside real greedy generation on
MT-Bench first turns (bundled model, shipped stream and answer store, after a warm-up). Every verified copied node
(prompt lookup's or the answer store's chain) whose parent lies on the accepted path is counted by source, by
whether the fast stream drafted the same token there, and by its chance given its parent; for the nodes both
drafted and copied, also by the two ways of joining the drafter's chance ``d`` and the copy's ``c``: the larger of
the two, or ``1 - (1 - d)(1 - c)`` (two independent witnesses, noisy-OR). Noise-free counts.

    python experiments/copy_calibration.py [PROMPTS] [THREADS]
"""

import collections
import sys

from warmed import GEN, warmed_first_turns

from m2r2.decoding import answer_store, lookup
from m2r2.decoding import tree as tree_mod

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 30
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine, ids = warmed_first_turns(n_prompts, threads)
source = {"now": ""}  # which proposer ran last in this round: its chain is the next one added


def tagged(cls, name):
    propose = cls.propose

    def wrapper(self, *args, **kwargs):
        source["now"] = name
        return propose(self, *args, **kwargs)

    cls.propose = wrapper


tagged(lookup.NgramIndex, "lookup")
tagged(answer_store.AnswerStore, "store")
add_copies = tree_mod.Tree.add_copies


def add_tagged(self, tokens, probs):
    nodes = add_copies(self, tokens, probs)
    self.__dict__.setdefault("source", {}).update(dict.fromkeys(nodes, source["now"]))
    return nodes


tree_mod.Tree.add_copies = add_tagged
copies: dict[tuple, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0])  # n, accepted, sum of chances
joined: dict[tuple, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0])
accept = tree_mod.TreeSpeculative._accept


def count(table, key, chance, hit):
    cell = table[(*key, min(int(chance * 5), 4))]
    cell[0] += 1
    cell[1] += hit
    cell[2] += chance


def counted(tree, rows, out, gen, sampler, exit_threshold=None):
    path, nxt = accept(tree, rows, out, gen, sampler, exit_threshold)
    target, on_path = out.tolist(), set(path)
    for r in rows[1:]:
        parent = tree.parents[r]
        if r not in tree.copy_probs or parent not in on_path:
            continue
        above = 1.0 if parent == 0 else tree.copy_probs.get(parent, 0.0)
        if above <= 0:
            continue
        c = tree.copy_probs[r] / above
        hit = tree.tokens[r] == target[rows.index(parent)]
        src, drafted = tree.source.get(r, "?"), tree.scores[r] > 0
        count(copies, (src, "drafted too" if drafted else "copy only"), c, hit)
        if drafted and tree.scores[parent] > 0:  # the drafter's own chance given the same parent
            d = tree.own(r)
            count(joined, (src, "larger"), max(c, d), hit)
            count(joined, (src, "noisy-OR"), 1 - (1 - c) * (1 - d), hit)
    return path, nxt


tree_mod.TreeSpeculative._accept = staticmethod(counted)
for prompt in ids[1:]:
    engine.generate_ids(prompt, "m2r2", GEN)
print(f"{engine.kernel} kernel, MT-Bench first turns 2..{n_prompts}; copied nodes under the accepted path")
for title, table in (("by the copy's own chance", copies), ("drafted and copied: the two chances joined", joined)):
    print(f"\n{title}\n| source | kind | chance | nodes | mean chance | accepted | accepted / chance |")
    print("|---|---|---|--:|--:|--:|--:|")
    for (src, kind, b), (n, hits, p) in sorted(table.items()):
        print(
            f"| {src} | {kind} | {b / 5:.1f}-{(b + 1) / 5:.1f} | {n} | {p / n:.3f} | {hits / n:.3f} | {hits / p:.2f} |"
        )
