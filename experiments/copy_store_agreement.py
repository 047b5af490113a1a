"""Whether the answer store's opinion tells a right copy from a wrong one, replayed on a benchmark run's own `vanilla`
answers (each turn's context: the conversation in the chat template, as `m2r2` indexes it).

Every round asks prompt lookup (the real :class:`NgramIndex`, its match class) for up to 6 tokens (a long match's up
to 8), and the shipped answer store for its proposal after the same context; it accepts lookup's matching prefix, then
one token (where lookup proposes nothing, the store's matching prefix). Printed per match class and whether the
store's first token equals lookup's (``agrees``), differs (``differs``) or the store has none: rounds, how often the
first copied token was right, and copied tokens accepted a round. Then each copied token at depth 2+ by whether the
store, asked after the context and the copied tokens before it, proposes the same token; and, where the store's first
token differs, how often the store's own chain was right (what a second branch beside lookup's would win).

Why: a copied node is priced by its depth's hit rate in its match class; rows spent on copies that miss are most of a
round's waste (on MT-Bench 60, ~0.8 of ~3 rows a pass). A free second opinion that splits the hit rates would let the
tree spend those rows where they pay.

    python experiments/copy_store_agreement.py RESULTS.json
    (e.g. benchmarks/round42-spr-2threads/final-mt60/results.json)
"""

import collections
import json
import sys

from m2r2.bench.datasets import load_dataset
from m2r2.decoding.answer_store import answer_store_for
from m2r2.decoding.lookup import LONG, NgramIndex
from m2r2.engine import Engine

CLASSES = ("plain", "split", "long")
with open(sys.argv[1]) as f:
    runs = json.load(f)["prompts"]
engine = Engine(threads=1, quiet=True)
tokenizer, store = engine.tokenizer, answer_store_for(engine.fingerprint, None)
assert store is not None, "no answer store ships for this model"
known = {(d, str(p.id)): p for d in {p["dataset"] for p in runs} for p in load_dataset(d, 0).prompts}
rounds: dict = collections.defaultdict(lambda: [0, 0, 0])  # (class, opinion) -> rounds, first right, accepted
deeper: dict = collections.defaultdict(lambda: [0, 0])  # (class, opinion) -> copied tokens at depth 2+ tried, right
stored = [0, 0, 0]  # rounds with only the store's proposal: rounds, first right, accepted
rival = collections.defaultdict(lambda: [0, 0, 0])  # class -> rounds where the store differs: rounds, its first right,
# its tokens accepted had it been verified beside lookup's chain
for p in runs:
    messages = []
    for turn, answer in enumerate(p["methods"]["vanilla"]["ids"]):
        messages.append({"role": "user", "content": known[(p["dataset"], p["id"])].turns[turn]})
        index, i = NgramIndex(tokenizer.encode_chat(messages)), 0
        messages.append({"role": "assistant", "content": tokenizer.decode(answer)})
        while i < len(answer):
            index.extend([answer[i]])  # the round's root: the token the last pass gave
            i += 1
            chain = index.propose(8)
            kind = index.match_class() if chain else None
            if kind is not None and kind != LONG:
                chain = chain[:6]
            own, _ = store.propose(index.tokens, 6)
            m = 0
            if chain:
                opinion = "none" if not own else ("agrees" if own[0] == chain[0] else "differs")
                while m < len(chain) and i + m < len(answer) and chain[m] == answer[i + m]:
                    m += 1
                if opinion == "differs":
                    cell, r = rival[CLASSES[kind]], 0
                    while r < len(own) and i + r < len(answer) and own[r] == answer[i + r]:
                        r += 1
                    cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + (r > 0), cell[2] + r
                row = rounds[(CLASSES[kind], opinion)]
                row[0], row[1], row[2] = row[0] + 1, row[1] + (m > 0), row[2] + m
                for d in range(1, min(len(chain), m + 1)):  # depth d+1, tried because depth d was right
                    ahead, _ = store.propose([*index.tokens, *chain[:d]], 1)
                    said = "none" if not ahead else ("agrees" if ahead[0] == chain[d] else "differs")
                    cell = deeper[(CLASSES[kind], said)]
                    cell[0], cell[1] = cell[0] + 1, cell[1] + (d < m)
            elif own:
                while m < len(own) and i + m < len(answer) and own[m] == answer[i + m]:
                    m += 1
                stored[0], stored[1], stored[2] = stored[0] + 1, stored[1] + (m > 0), stored[2] + m
            index.extend(answer[i : i + m])
            i += m
total = sum(r[0] for r in rounds.values()) + stored[0]
print(f"{len(runs)} prompts of {runs[0]['dataset']}, `vanilla` answers; {total} rounds with a proposal")
print("| lookup's match | the store's first token | rounds | first copy right | copies accepted a round |")
print("|---|---|--:|--:|--:|")
for (kind, opinion), (n, first, acc) in sorted(rounds.items()):
    print(f"| {kind} | {opinion} | {n} | {first / n:.2f} | {acc / n:.2f} |")
if stored[0]:
    n, first, acc = stored
    print(f"| (none) | the store's chain alone | {n} | {first / n:.2f} | {acc / n:.2f} |")
print("\n| lookup's match | the store after the copies before | copied tokens at depth 2+ tried | right |")
print("|---|---|--:|--:|")
for (kind, said), (n, right) in sorted(deeper.items()):
    print(f"| {kind} | {said} | {n} | {right / n:.2f} |")
print("\n| lookup's match | rounds the store's first token differs | the store's first right | its tokens a round |")
print("|---|--:|--:|--:|")
for kind, (n, first, acc) in sorted(rival.items()):
    print(f"| {kind} | {n} | {first / n:.2f} | {acc / n:.2f} |")
