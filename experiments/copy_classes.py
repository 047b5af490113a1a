"""Prompt lookup's chains in real greedy generation, by how the tree prices them (``copy_price``: ``match``, a hit-rate
table per match class, or ``depth``, one table for every chain), alternating the two answer by answer: per table
(named by its prior) the rounds whose chain was verified, the copied rows verified a round, those accepted, how often
the first was right, and the rows past the accepted ones; then each pricing's tokens and rows a verify pass and its
tokens a second. MT-Bench first turns PROMPTS (after a warm-up answer with each), REPS passes over them in
alternating order.

    python experiments/copy_classes.py [PROMPTS] [THREADS] [REPS]
"""

import collections
import sys
import time

from warmed import GEN, tally, warmed_first_turns

from m2r2.decoding.lookup import LookupStats

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 30
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 2
engine, ids = warmed_first_turns(n_prompts, threads)
tables: dict = collections.defaultdict(lambda: [0, 0, 0, 0])  # rounds, offered rows, accepted, first right
totals: dict = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])  # tokens, passes, rows, seconds
pricing = {"now": "warm-up"}
record = LookupStats.record


def counted(self: LookupStats, offered: int, accepted: int) -> None:
    row = tables[(pricing["now"], self.prior)]
    row[0], row[1], row[2], row[3] = row[0] + 1, row[1] + offered, row[2] + accepted, row[3] + (accepted > 0)
    record(self, offered, accepted)


LookupStats.record = counted
for price in ("depth", "match"):
    engine.generate_ids(ids[0], "m2r2", GEN, copy_price=price)
for rep in range(reps):
    for price in ("depth", "match") if rep % 2 == 0 else ("match", "depth"):
        pricing["now"] = price
        for prompt in ids[1:]:
            t = time.perf_counter()
            r = engine.generate_ids(prompt, "m2r2", GEN, copy_price=price)
            tally(totals[price], r, time.perf_counter() - t)
print(f"{engine.kernel} kernel, {threads} thread(s), MT-Bench first turns 2..{n_prompts}, {reps} passes each")
print("| pricing | table (prior) | rounds | copied rows verified | accepted | first right | rows past them |")
print("|---|--:|--:|--:|--:|--:|--:|")
for (price, prior), (rounds, offered, accepted, first) in sorted(tables.items()):
    if price != "warm-up":
        shares = (offered / rounds, accepted / rounds, first / rounds, (offered - accepted) / rounds)
        print(f"| {price} | {prior} | {rounds} | " + " | ".join(f"{x:.2f}" for x in shares) + " |")
print("| pricing | tokens a pass | rows a pass | tokens a second |")
print("|---|--:|--:|--:|")
for price, (tokens, passes, rows, seconds) in totals.items():
    print(f"| {price} | {tokens / passes:.3f} | {rows / passes:.3f} | {tokens / seconds:.1f} |")
