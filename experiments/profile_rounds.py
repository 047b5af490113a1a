"""Where a drafting round's time goes: cProfile over greedy `m2r2` answers to the first turns of
MT-Bench prompts with drafting forced every round and no prompt lookup (1 thread).

    python experiments/profile_rounds.py [N_PROMPTS]

Prints the functions by cumulative time. The run quoted in BENCHMARKS.md ("Sixth round", at commit
77d342e, before the C++ row attention) found 35% of the time in attention (`attend` 4.4 s of 12.3 s
over three answers).
"""

import cProfile
import json
import pstats
import sys

from m2r2.bench.datasets import shared_eval_dir
from m2r2.decoding.base import GenerationConfig
from m2r2.decoding.tree import TreeSpeculative
from m2r2.engine import Engine

TreeSpeculative._worth_drafting = lambda self, state: True  # draft every round
engine = Engine(threads=1, quiet=True)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
rows = [json.loads(line) for line in (shared_eval_dir() / "mt_bench.jsonl").open()][:n]
gen = GenerationConfig(max_new_tokens=128)


def first_turn(row: dict) -> list[dict[str, str]]:
    return [{"role": "user", "content": row["turns"][0]}]


engine.chat(first_turn(rows[0]), "m2r2", gen, lookup=0)  # warm-up
profile = cProfile.Profile()
profile.enable()
for row in rows:
    engine.chat(first_turn(row), "m2r2", gen, lookup=0)
profile.disable()
pstats.Stats(profile).sort_stats("cumtime").print_stats(40)
