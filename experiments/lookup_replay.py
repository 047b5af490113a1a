"""How much prompt lookup could copy, replayed on a benchmark run's own `vanilla` answers.

Usage: ``git show b58a273:benchmarks/paper/results.json > /tmp/paper3.json`` (the third round's paper
suite), then ``.venv/bin/python experiments/lookup_replay.py /tmp/paper3.json``. Each turn's answer
is replayed greedily: every round proposes up to 6 tokens that followed the latest earlier
occurrence of the longest n-gram (``--max-n`` down to ``--min-n`` tokens) ending the earlier turns' answers and
this answer so far (:class:`m2r2.decoding.lookup.NgramIndex`), accepts the matching prefix, then one token.
Without ``--prompts`` the prompt text is not included, so this undercounts; with it each turn's context is the
conversation in the chat template as the bundled model's tokenizer writes it (the user turns, the earlier answers
as text), as `m2r2` indexes it. Outputs quoted in BENCHMARKS.md: ``lookup_replay.out.txt`` ("Fourth round", max-n
3) and ``lookup_replay.orders.out.txt`` ("Forty-second round": ``--prompts --max-n 3,4,6,8,12``; the
longer n-grams saved 0.1-0.5% of the rounds, so 3 stays).
"""

import argparse
import json
from collections import defaultdict

from m2r2.decoding.lookup import NgramIndex

ap = argparse.ArgumentParser(description="prompt lookup replayed on a run's vanilla answers")
ap.add_argument("results", help="a bench results.json")
ap.add_argument("--k", type=int, default=6, help="tokens per proposal (m2r2's lookup option)")
ap.add_argument("--max-n", default="3", help="longest n-gram; several, comma-separated, are compared")
ap.add_argument("--prompts", action="store_true", help="index each turn's chat prompt too (loads the bundled model)")
ap.add_argument(
    "--second",
    action="store_true",
    help="also count, per round, a second branch: the continuation of the latest earlier occurrence (of the longest "
    "3- or 2-gram) whose next token differs from the proposal's; how often one exists, and what it would add where "
    "the proposal's first token is wrong",
)
ap.add_argument("--min-n", type=int, default=2)
args = ap.parse_args()


def matched(seq: list[int], start: int, answer: list[int], i: int, k: int) -> int:
    """How many of the (up to ``k``) tokens after ``seq[start - 1]`` match ``answer`` from ``i`` (the last token of an
    answer is never a copy: the round's own token)."""
    m = 0
    while m < k and start + m < len(seq) and i + m < len(answer) - 1 and seq[start + m] == answer[i + m]:
        m += 1
    return m


with open(args.results) as f:
    runs = json.load(f)["prompts"]
contexts: dict[tuple[str, str, int], list[int]] = {}  # (dataset, id, turn) -> the turn's prompt ids
if args.prompts:
    from m2r2.bench.datasets import load_dataset
    from m2r2.engine import Engine

    tokenizer = Engine(threads=1, quiet=True).tokenizer
    known = {(d, str(p.id)): p for d in {p["dataset"] for p in runs} for p in load_dataset(d, 0).prompts}
    for p in runs:
        messages = []
        for turn, answer in enumerate(p["methods"]["vanilla"]["ids"]):
            messages.append({"role": "user", "content": known[(p["dataset"], p["id"])].turns[turn]})
            contexts[(p["dataset"], p["id"], turn)] = tokenizer.encode_chat(messages)
            messages.append({"role": "assistant", "content": tokenizer.decode(answer)})
for max_n in (int(n) for n in args.max_n.split(",")):
    totals: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # tokens, rounds, proposals, matched
    for p in runs:
        earlier: list[int] = []
        for turn, answer in enumerate(p["methods"]["vanilla"]["ids"]):
            context = contexts.get((p["dataset"], p["id"], turn), earlier)
            index = NgramIndex(context, max_n=max_n, min_n=args.min_n)
            t = totals[(p["dataset"], turn + 1)]
            i = 0
            while i < len(answer):
                proposal = index.propose(args.k)
                m = 0
                while m < len(proposal) and i + m < len(answer) - 1 and proposal[m] == answer[i + m]:
                    m += 1
                t[1] += 1
                t[2] += bool(proposal)
                t[3] += m
                index.extend(answer[i : i + m + 1])
                i += m + 1
            t[0] += len(answer)
            earlier += answer
    if args.second:
        branch: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # rounds, offered, hits, tokens
        for p in runs:
            earlier = []
            for turn, answer in enumerate(p["methods"]["vanilla"]["ids"]):
                seq, b = list(contexts.get((p["dataset"], p["id"], turn), earlier)), branch[(p["dataset"], turn + 1)]
                i = 0
                while i < len(answer):
                    ends = []  # where each earlier occurrence of the longest final 3- or 2-gram ended
                    for n in (3, 2):
                        ends = [j + n for j in range(len(seq) - n) if seq[j : j + n] == seq[-n:]]
                        if ends:
                            break
                    first = matched(seq, ends[-1], answer, i, args.k) if ends else 0
                    other = next((e for e in reversed(ends) if seq[e] != seq[ends[-1]]), None) if ends else None
                    b[0] += 1
                    if other is not None:
                        b[1] += 1
                        if first == 0:
                            m = matched(seq, other, answer, i, args.k)
                            b[2] += m > 0
                            b[3] += m
                    seq += answer[i : i + first + 1]
                    i += first + 1
                earlier += answer
        for (dataset, turn), (rounds, offered, hits, tokens) in sorted(branch.items()):
            print(
                f"  second branch, {dataset} turn {turn}: exists in {offered / rounds:.1%} of {rounds} rounds; right "
                f"where the proposal is not in {hits} ({hits / max(offered, 1):.0%} of them), {tokens / rounds:.3f} "
                "more tokens a round"
            )
    print(f"max-n {max_n}{', with the prompts' if args.prompts else ''}:")
    for (dataset, turn), (tokens, rounds, proposals, matched) in sorted(totals.items()):
        print(
            f"  {dataset} turn {turn}: {tokens} tokens in {rounds} rounds ({tokens / rounds:.3f} per round); "
            f"a proposal in {proposals / rounds:.0%} of rounds, "
            f"{matched / max(proposals, 1):.2f} tokens matched per proposal"
        )
