"""Where `m2r2`'s wasted verify rows come from, inside real greedy generation (bundled model, MT-Bench first turns
2..PROMPTS after a warm-up): per round, the copied chain's source (prompt lookup, by the hit-rate table that priced
it, or the answer store), its rows verified and accepted. Then the answer store's nodes whose parent was accepted,
by depth and by the chance the tree gave them given their parent (its share times the sequence's calibration):
how many, the mean chance, and how often they were accepted (its calibration).

Why: skipping every row that will be rejected would make copies alone 1.44x instead of 1.25x on these prompts
(``WASTE_FREE=1 python experiments/oracle_stream.py``); this says which source those rows come from and whether
their prices are off.

    python experiments/waste_by_source.py [PROMPTS] [THREADS]
"""

import collections
import sys

from warmed import GEN, warmed_first_turns

from m2r2.decoding import tree as tree_mod

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 30
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine, ids = warmed_first_turns(n_prompts, threads)
sources: dict = collections.defaultdict(lambda: [0, 0, 0])  # source -> rounds, copied rows verified, accepted
calibration: dict = collections.defaultdict(lambda: [0, 0.0, 0])  # (depth, fifth) -> nodes, chance sum, accepted
copy_in, accept, now = tree_mod.TreeSpeculative._copy_in, tree_mod.TreeSpeculative._accept, {}
TABLES = {  # the hit-rate tables of TreeState.copies, by what priced a chain
    **{m: f"{name} match" for m, name in enumerate(("plain", "split", "long"))},
    tree_mod.EVERY_MATCH: "any match",
    **{
        tree_mod.opinion_table(m, o): f"{name} match, the store {said}"
        for m, name in enumerate(("plain", "split", "long"))
        for o, said in ((tree_mod.AGREES, "agrees"), (tree_mod.NO_OPINION, "silent"), (tree_mod.DIFFERS, "differs"))
    },
}


def counted_copy_in(tree, state, looked, stored, *rest):
    nodes, from_store = copy_in(tree, state, looked, stored, *rest)
    match = rest[0] if rest else tree_mod.PLAIN
    now["source"] = f"lookup: {TABLES[match]}" if looked else "answer store" if stored[0] else "none"
    now["nodes"], now["store"] = {*nodes, *(r for r, _ in from_store)}, [r for r, _ in from_store]
    return nodes, from_store


def counted_accept(tree, rows, out, gen, sampler, exit_threshold=None):
    path, nxt = accept(tree, rows, out, gen, sampler, exit_threshold)
    if "source" in now:
        row = sources[now["source"]]
        row[0] += 1
        row[1] += sum(1 for r in rows if r in now["nodes"])
        row[2] += sum(1 for r in path if r in now["nodes"])
        for r in now["store"]:
            if r in rows and tree.parents[r] in path:  # tried: its parent was accepted
                above = tree.copy_probs.get(tree.parents[r], 1.0)
                chance = tree.copy_probs[r] / above if above > 0 else 0.0
                cell = calibration[(min(tree.depths[r], 4), min(int(chance * 5), 4))]
                cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + chance, cell[2] + (r in path)
    now.clear()
    return path, nxt


tree_mod.TreeSpeculative._copy_in = staticmethod(counted_copy_in)
tree_mod.TreeSpeculative._accept = staticmethod(counted_accept)
tokens = passes = rows = 0.0
for prompt in ids[1:]:
    r = engine.generate_ids(prompt, "m2r2", GEN)
    tokens, passes = tokens + len(r.tokens), passes + r.stats["verify_passes"]
    rows += r.stats["verify_rows_per_pass"] * r.stats["verify_passes"]
print(f"{engine.kernel} kernel, {threads} thread(s), MT-Bench first turns 2..{n_prompts}")
print(f"{passes:.0f} passes: {tokens / passes:.3f} tokens and {rows / passes:.3f} rows a pass")
print("| copied chain from | rounds | its rows verified a round | accepted | wasted | wasted rows a pass |")
print("|---|--:|--:|--:|--:|--:|")
for name, (n, verified, accepted) in sorted(sources.items(), key=lambda kv: kv[1][2] - kv[1][1]):
    print(
        f"| {name} | {n} | {verified / n:.2f} | {accepted / n:.2f} | {(verified - accepted) / n:.2f} "
        f"| {(verified - accepted) / passes:.3f} |"
    )
print("\n| answer store node: depth | chance given its parent | nodes tried | mean chance | accepted |")
print("|--:|---|--:|--:|--:|")
for (depth, fifth), (n, chance, hits) in sorted(calibration.items()):
    label = f"{fifth / 5:.1f}-{(fifth + 1) / 5:.1f}"
    print(f"| {depth}{'+' if depth == 4 else ''} | {label} | {n} | {chance / n:.3f} | {hits / n:.3f} |")
