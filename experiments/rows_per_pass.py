"""Verify passes, rows a pass and tokens a pass of each tree method in a `m2r2 bench` run, pooled over its prompts
(every turn, and first turns apart), from the per-turn stats in its results.json.

Why: a bench's table gives `mean accepted` as a mean of per-turn means; pooled counts say what a change to the rows a
tree verifies did (e.g. a store whose chains are priced otherwise: fewer rows for the same tokens), free of noise.

    python experiments/rows_per_pass.py RESULTS.json [DATASET]
"""

import json
import sys

with open(sys.argv[1]) as f:
    run = json.load(f)
prompts = [p for p in run["prompts"] if len(sys.argv) < 3 or p["dataset"] == sys.argv[2]]
print(f"{run['command']}\n{len(prompts)} prompts")
print("| method | passes | rows a pass | tokens a pass | first turns: rows a pass | tokens a pass |")
print("|---|--:|--:|--:|--:|--:|")
for method in prompts[0]["methods"]:
    every, first = [0, 0.0, 0], [0, 0.0, 0]  # passes, rows, tokens
    for p in prompts:
        r = p["methods"][method]
        for turn, (stats, ids) in enumerate(zip(r["stats"], r["ids"], strict=True)):
            if "verify_rows_per_pass" not in stats:
                break
            for into in (every, first) if turn == 0 else (every,):
                into[0] += stats["verify_passes"]
                into[1] += stats["verify_rows_per_pass"] * stats["verify_passes"]
                into[2] += len(ids)
    if every[0]:
        print(
            f"| {method} | {every[0]} | {every[1] / every[0]:.3f} | {every[2] / every[0]:.3f} | "
            f"{first[1] / first[0]:.3f} | {first[2] / first[0]:.3f} |"
        )
