"""How much prompt lookup could copy, replayed on a benchmark run's own `vanilla` answers.

Usage: ``git show b58a273:benchmarks/paper/results.json > /tmp/paper3.json`` (the third round's paper
suite), then ``.venv/bin/python experiments/lookup_replay.py /tmp/paper3.json``. Each turn's answer
is replayed greedily: every round proposes up to 6 tokens that followed the latest earlier
occurrence of the last 3 (else 2) tokens of the earlier turns' answers and this answer so far
(:class:`m2r2.decoding.lookup.NgramIndex`; the prompt text is not included, so this undercounts),
accepts the matching prefix, then one token. Output quoted in BENCHMARKS.md ("Fourth round"):
``lookup_replay.out.txt``.
"""

import argparse
import json
from collections import defaultdict

from m2r2.decoding.lookup import NgramIndex

ap = argparse.ArgumentParser(description="prompt lookup replayed on a run's vanilla answers")
ap.add_argument("results", help="a bench results.json")
ap.add_argument("--k", type=int, default=6, help="tokens per proposal (m2r2's lookup option)")
ap.add_argument("--max-n", type=int, default=3)
ap.add_argument("--min-n", type=int, default=2)
args = ap.parse_args()
with open(args.results) as f:
    runs = json.load(f)["prompts"]
totals: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # tokens, rounds, proposals, matched
for p in runs:
    earlier: list[int] = []
    for turn, answer in enumerate(p["methods"]["vanilla"]["ids"]):
        index = NgramIndex(earlier, max_n=args.max_n, min_n=args.min_n)
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
for (dataset, turn), (tokens, rounds, proposals, matched) in sorted(totals.items()):
    print(
        f"{dataset} turn {turn}: {tokens} tokens in {rounds} rounds ({tokens / rounds:.2f} per round); "
        f"a proposal in {proposals / rounds:.0%} of rounds, "
        f"{matched / max(proposals, 1):.2f} tokens matched per proposal"
    )
