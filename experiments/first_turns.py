"""First turns only (copies rare), no prompt lookup: `m2r2` with its wall-clock drafting rule, and
drafting every round, against `vanilla`, interleaved prompt by prompt in one process.

    python experiments/first_turns.py N_PROMPTS

Why: on first turns the tree drafter's own rule decides whether drafting pays; forcing it to draft
every round shows what a drafting round really costs (tokens per pass against wall clock). Prints
the median of per-prompt speed ratios over `vanilla`, and per prompt the tokens per verify pass and
the rows verified per pass. Output of the runs quoted in BENCHMARKS.md: ``first_turns.out.txt``.
"""

import json
import statistics
import sys

from m2r2.bench.datasets import shared_eval_dir
from m2r2.decoding.base import GenerationConfig
from m2r2.decoding.tree import TreeSpeculative
from m2r2.engine import Engine

engine = Engine(threads=1, quiet=True)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
rows = [json.loads(line) for line in (shared_eval_dir() / "mt_bench.jsonl").open()][:n]
gen = GenerationConfig(max_new_tokens=128)
rule = TreeSpeculative._worth_drafting
times: dict[str, list[tuple[float, float, float]]] = {}
for row in rows:
    messages = [{"role": "user", "content": row["turns"][0]}]
    for name in ("vanilla", "rule", "every round"):
        if name == "vanilla":
            c = engine.chat(messages, "vanilla", gen)
        else:
            TreeSpeculative._worth_drafting = rule if name == "rule" else (lambda self, state: True)
            c = engine.chat(messages, "m2r2", gen, lookup=0)
        s = c.result.stats
        times.setdefault(name, []).append(
            (c.result.seconds / len(c.result.tokens), s.get("mean_accepted", 1.0), s.get("verify_rows_per_pass", 1.0))
        )
base = [t[0] for t in times["vanilla"]]
for name, v in times.items():
    ratio = statistics.median(b / x[0] for b, x in zip(base, v, strict=True))
    per_pass, rows_per_pass = [round(x[1], 2) for x in v], [round(x[2], 2) for x in v]
    print(f"{name}: {ratio:.3f}x of vanilla; tokens/pass {per_pass}; rows/pass {rows_per_pass}")
