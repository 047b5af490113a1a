"""Agreement of a seeded fast stream per MT-Bench category: which kinds of answer hold the held-out
figure of `m2r2 eval-align` below the training store's hold-out (0.41-0.43 against 0.55 at draft 1).

    python experiments/agreement_by_category.py [ADAPTERS] [ANSWERS]

ANSWERS: the base model's greedy answers that `m2r2 eval-align --answers FILE --limit 0` wrote for the
shared MT-Bench file (default runs/eval/mt_bench-60-96-fp32.jsonl); ADAPTERS: default the shipped stream.
Float32 training form, teacher-forced, drafts 1-4, as `eval-align` reports them.
"""

import collections
import json
import sys
from pathlib import Path

from m2r2.bench.datasets import load_dataset
from m2r2.engine import Engine
from m2r2.multirate.io import bundled_adapters, load_default
from m2r2.training.seeded_train import held_out_agreement, seeded_trainee

adapters = Path(sys.argv[1]) if len(sys.argv) > 1 else None
answers = Path(sys.argv[2] if len(sys.argv) > 2 else "runs/eval/mt_bench-60-96-fp32.jsonl")
engine = Engine(dtype="fp32", kernel="plain", threads=1, quiet=True)
records = [json.loads(x) for x in answers.read_text().splitlines() if x.strip()]
prompts = load_dataset("mt_bench").prompts
if len(records) != len(prompts):
    sys.exit(f"{answers} holds {len(records)} answers, the MT-Bench file {len(prompts)} prompts")
path = adapters or bundled_adapters(engine.fingerprint, "seeded")
trainee = seeded_trainee(load_default(engine.model, engine.fingerprint, path), chain=4)
groups: dict[str, list[tuple[list[int], int]]] = collections.defaultdict(list)
for p, r in zip(prompts, records, strict=True):
    groups[p.category or "-"].append((r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"])))
print(f"{path} on {answers}")
print("| category | prompts | answer tokens | @1 | @2 | @3 | @4 |")
print("|---|--:|--:|--:|--:|--:|--:|")
for cat, seqs in groups.items():
    [agree] = held_out_agreement(engine.model, trainee, seqs)
    tokens = sum(len(t) - s for t, s in seqs)
    print(f"| {cat} | {len(seqs)} | {tokens} | " + " | ".join(f"{a:.3f}" for a in agree) + " |")
