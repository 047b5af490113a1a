"""Would the answer store's runner-up follower pay as a second branch?

The store keeps, per n-gram, only the token that most often followed it. Where lookup has nothing to copy and the
store's first token is wrong (~0.64 of its rounds), the n-gram's second most frequent follower may be the model's
token. A sibling row at the chain's first depth pays only where it is right more often than a verify row costs
against a pass (~0.15-0.19 of a step on this CPU, forty-first round). This counts, on a benchmark run's `vanilla`
answers replayed round by round as ``root_confidence.py`` does (lookup's chain, else the store's), how often the
runner-up of the n-gram the store followed is the model's next token, binned by its share of the followers; and how
often the first follower is, by the n-gram's order, the first follower's share and how often the n-gram was seen (the
store prices a node by its share alone: does the order or the support say more?).

The counts are rebuilt here from distill-data files: the 4/3/2-grams seen at least twice, whatever followed them
(``m2r2 answer-store`` keeps a follower seen at least twice; the first follower here is its most frequent, as there).

    python experiments/store_runner_up.py RESULTS.json ANSWERS.jsonl [ANSWERS.jsonl ...]
"""

import collections
import json
import sys
from pathlib import Path

from m2r2.bench.datasets import load_dataset
from m2r2.decoding.answer_store import ORDERS, read_answers
from m2r2.decoding.lookup import NgramIndex
from m2r2.engine import Engine

EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 1.01)
with open(sys.argv[1]) as f:
    runs = [p for p in json.load(f)["prompts"] if p["dataset"] == "mt_bench"]
followers: dict = collections.defaultdict(collections.Counter)  # n-gram -> Counter of followers
for ans in read_answers([Path(p) for p in sys.argv[2:]]):
    for n in ORDERS:
        for i in range(len(ans) - n):
            followers[tuple(ans[i : i + n])][ans[i + n]] += 1
engine = Engine(threads=1, quiet=True)
tokenizer = engine.tokenizer
known = {str(p.id): p for p in load_dataset("mt_bench", 0).prompts}


def proposal(context: list[int]) -> tuple[list[tuple[int, int]], int, int] | None:
    """The followers (token, count) of the longest n-gram ending ``context`` seen at least twice, most frequent
    first, how often it was seen and its order."""
    for n in ORDERS:
        seen = followers.get(tuple(context[-n:]))
        if seen is not None and (total := sum(seen.values())) >= 2:
            return seen.most_common(2), total, n
    return None


bins = [[0, 0, 0] for _ in EDGES[:-1]]  # rounds with a runner-up, the first right, the runner-up right
# (order, first follower's share bin, times the n-gram was seen: 2-4 / 5-19 / 20+) -> rounds, first right
by_order: dict = collections.defaultdict(lambda: [0, 0])
SHARES = (0.0, 0.3, 0.6, 0.9, 1.01)
rounds = first_right = 0
for p in runs:
    messages = []
    for turn, answer in enumerate(p["methods"]["vanilla"]["ids"]):
        messages.append({"role": "user", "content": known[p["id"]].turns[turn]})
        index, i = NgramIndex(tokenizer.encode_chat(messages)), 0
        messages.append({"role": "assistant", "content": tokenizer.decode(answer)})
        while i < len(answer):
            index.extend([answer[i]])
            i += 1
            if i >= len(answer):
                break
            chain = index.propose(6)
            if chain:  # lookup's round: accept its matching prefix
                m = 0
                while m < len(chain) and i + m < len(answer) and chain[m] == answer[i + m]:
                    m += 1
                index.extend(answer[i : i + m])
                i += m
                continue
            found = proposal(index.tokens)
            if found is None:
                continue
            (top, top_count), *rest = found[0]
            rounds += 1
            first_right += top == answer[i]
            s1 = next(k for k in range(len(SHARES) - 1) if top_count / found[1] < SHARES[k + 1])
            seen = "2-4" if found[1] < 5 else "5-19" if found[1] < 20 else "20+"
            cell = by_order[(found[2], s1, seen)]
            cell[0], cell[1] = cell[0] + 1, cell[1] + (top == answer[i])
            if rest:
                second, count = rest[0]
                share = count / found[1]
                b = bins[next(k for k in range(len(EDGES) - 1) if share < EDGES[k + 1])]
                b[0], b[1], b[2] = b[0] + 1, b[1] + (top == answer[i]), b[2] + (second == answer[i])
print(f"{len(runs)} MT-Bench prompts (both turns), `vanilla` answers; counts from {', '.join(sys.argv[2:])}")
print(f"store rounds (lookup has nothing): {rounds}, its first follower right {first_right / max(rounds, 1):.3f}")
print("| runner-up's share | rounds with a runner-up | first follower right | runner-up right |")
print("|---|--:|--:|--:|")
for k, (n, a, b) in enumerate(bins):
    if n:
        print(f"| {EDGES[k]:.1f}-{min(EDGES[k + 1], 1.0):.1f} | {n} | {a / n:.3f} | {b / n:.3f} |")
print("\n| n-gram order | first follower's share | times the n-gram was seen | rounds | first follower right |")
print("|--:|---|---|--:|--:|")
for (order, s1, seen), (n, a) in sorted(by_order.items(), key=lambda kv: (-kv[0][0], kv[0][1], kv[0][2])):
    if n >= 20:
        print(f"| {order} | {SHARES[s1]:.1f}-{min(SHARES[s1 + 1], 1.0):.1f} | {seen} | {n} | {a / n:.3f} |")
