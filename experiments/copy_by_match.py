"""Prompt lookup's proposals by how long a match they follow, replayed on a benchmark run's own `vanilla` answers
(each turn's context: the conversation in the chat template, as `m2r2` indexes it). Every round follows the latest
earlier occurrence of the longest n-gram ending the context (n = 8, 6, 4, 3, then 2), accepts the matching prefix
of up to 6 copied tokens, then one token. Printed per match length, source (the prompt or the answer so far),
whether every earlier occurrence had the same next token, and turn: rounds, how often the first copied token was
right, copied tokens a round, and how many rounds matched 0..6 tokens. Then the same replay with longer chains
(up to K tokens) where the match is at least N tokens long: tokens a round, and rounds.

Why: `m2r2` prices a copied node by its depth's hit rate in the sequence so far (``LookupStats``), whatever match
proposed it; a long match is right far more often, and a 6-token chain caps it.

    python experiments/copy_by_match.py RESULTS.json   (e.g. benchmarks/round41-spr-2threads/mt60/results.json)
"""

import collections
import json
import sys

from m2r2.bench.datasets import load_dataset
from m2r2.engine import Engine

with open(sys.argv[1]) as f:
    runs = json.load(f)["prompts"]
tokenizer = Engine(threads=1, quiet=True).tokenizer
known = {(d, str(p.id)): p for d in {p["dataset"] for p in runs} for p in load_dataset(d, 0).prompts}
turns = []  # (turn, prompt ids, answer ids)
for p in runs:
    messages = []
    for turn, answer in enumerate(p["methods"]["vanilla"]["ids"]):
        messages.append({"role": "user", "content": known[(p["dataset"], p["id"])].turns[turn]})
        turns.append((turn, tokenizer.encode_chat(messages), answer))
        messages.append({"role": "assistant", "content": tokenizer.decode(answer)})


def earlier_ends(seq: list[int], n: int) -> list[int]:
    """Where each earlier occurrence of ``seq``'s final n-gram ended."""
    key = seq[-n:]
    return [j + n for j in range(len(seq) - n) if seq[j : j + n] == key]


def replay(long_k: int, strong: int, table: dict | None = None) -> tuple[int, int]:
    """Rounds and tokens over every turn, chains of up to ``long_k`` tokens after matches of ``strong``+ tokens."""
    rounds = tokens = 0
    for turn, prompt, answer in turns:
        seq, i = list(prompt), 0
        while i < len(answer):
            n, ends = next(((n, e) for n in (8, 6, 4, 3, 2) if (e := earlier_ends(seq, n))), (0, []))
            m = 0
            if ends:
                k, start = (long_k if n >= strong else 6), ends[-1]
                while m < k and start + m < len(seq) and i + m < len(answer) - 1 and seq[start + m] == answer[i + m]:
                    m += 1
                if table is not None:
                    same = len({seq[e] for e in ends if e < len(seq)}) == 1
                    key = (f"{n}" if n < 4 else f">={n}", "prompt" if start <= len(prompt) else "answer",
                           "one" if same else "several", turn + 1)  # fmt: skip
                    row = table[key]
                    row[0], row[1], row[2], row[3 + m] = row[0] + 1, row[1] + (m > 0), row[2] + m, row[3 + m] + 1
            rounds, tokens = rounds + 1, tokens + m + 1
            seq += answer[i : i + m + 1]
            i += m + 1
    return rounds, tokens


table: dict = collections.defaultdict(lambda: [0] * 10)
replay(6, 99, table)
print("| match | source | next tokens | turn | rounds | first copy right | copied a round | rounds by copied 0..6 |")
print("|---|---|---|--:|--:|--:|--:|---|")
for key in sorted(table, key=lambda k: (k[3], k[0], k[1], k[2])):
    r, first, copied, *hist = table[key]
    if r >= 30:
        print(f"| {' | '.join(map(str, key))} | {r} | {first / r:.2f} | {copied / r:.2f} | {hist[:7]} |")
print("\n| chains of up to | after matches of | tokens a round | rounds |")
print("|--:|--:|--:|--:|")
for long_k, strong in ((6, 99), (8, 8), (12, 8), (16, 8), (12, 6), (12, 4)):
    rounds, tokens = replay(long_k, strong)
    print(f"| {long_k} | {strong if strong < 99 else '-'} | {tokens / rounds:.3f} | {rounds} |")
