"""How long MT-Bench second-turn prompts are and how much of them a carried cache covered, from a stamped
bench run (its first method's answers: the history each second turn repeats).

    python experiments/second_turns.py benchmarks/mt-bench-60-peers-zen3/results.json
"""

import json
import statistics
import sys

from m2r2.bench.datasets import load_dataset
from m2r2.loading import resolve_model
from m2r2.tokenizer import ChatTokenizer

with open(sys.argv[1]) as f:
    results = json.load(f)
tokenizer = ChatTokenizer(resolve_model(None, quiet=True))
turns = {p.id: p.turns for p in load_dataset(results["dataset"], 0).prompts}
lengths, reused = [], []
for row in results["prompts"]:
    run = next(iter(row["methods"].values()))
    first, second = turns[row["id"]][:2]
    history = [{"role": "user", "content": first}, {"role": "assistant", "content": run["text"][0]}]
    lengths.append(len(tokenizer.encode_chat([*history, {"role": "user", "content": second}])))
    reused.append(run["stats"][1].get("prompt_reused", 0))
print(
    f"{len(lengths)} second turns: {statistics.fmean(lengths):.1f} prompt tokens, {statistics.fmean(reused):.1f} reused"
)
