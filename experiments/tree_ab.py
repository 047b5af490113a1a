"""A pass's layers and head on this checkout's code against another checkout's (OLD: a directory holding a ``src/``),
each in its own process (their weights may lie in different layouts, so they cannot share an engine), the processes
taking turns ROUNDS times: the bundled model over T = 1-4 rows after a CTX-token context (MT-Bench's first prompt
repeated), as ``experiments/warmed.py``'s ``timed_pass`` runs a verify pass; medians in milliseconds per process,
then the medians over the rounds. Both checkouts must give the same argmax tokens (compared as a checksum).

    python experiments/tree_ab.py OLD [THREADS] [CTX] [ROUNDS] [REPEATS]

e.g. ``git worktree add /tmp/old HEAD && git apply experiments/pair-layout.patch && python experiments/tree_ab.py
/tmp/old 2 250 4 150`` (the forty-first round's pair layout against the shipped one).
"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = (1, 2, 3, 4)

if len(sys.argv) > 1 and sys.argv[1] == "--child":  # one checkout's timings, as JSON on the last line
    threads, ctx, repeats = (int(a) for a in sys.argv[2:5])
    import torch
    from warmed import filled_context, pass_inputs, timed_pass, warmed_first_turns

    from m2r2 import amx

    engine, ids = warmed_first_turns(1, threads)
    model, ext = engine.model, amx.avx2_extension()
    stack = model.fused_stack()
    cache, toks = filled_context(model, ids[0], ctx)
    out, check = {}, 0
    with torch.no_grad():
        for t in ROWS:
            inputs = pass_inputs(model, cache, toks, ctx, t)
            layers, head = [], []
            for _ in range(repeats):
                _, argmax, ls, hs = timed_pass(model, ext, stack, cache, ctx, inputs)
                layers.append(ls)
                head.append(hs)
            check = check * 31 + int(argmax.sum())
            out[t] = (1e3 * statistics.median(layers), 1e3 * statistics.median(head))
    print(json.dumps({"times": out, "check": check, "src": str(Path(amx.__file__).parent)}))
    sys.exit()

old = Path(sys.argv[1]).resolve()
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 250
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 4
repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 200
trees = {"new": HERE.parent / "src", "old": old / "src"}
runs: dict[str, list[dict]] = {name: [] for name in trees}
for i in range(rounds):
    for name in trees if i % 2 == 0 else reversed(trees):
        env = {**os.environ, "PYTHONPATH": f"{trees[name]}{os.pathsep}{HERE}"}
        args = [sys.executable, __file__, "--child", str(threads), str(ctx), str(repeats)]
        line = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        runs[name].append(json.loads(line))
checks = {r["check"] for rs in runs.values() for r in rs}
print(f"{threads} thread(s), context {ctx}, {rounds} rounds of {repeats} passes a row count; the trees' sources:")
for name in trees:
    print(f"  {name}: {runs[name][0]['src']}")
print("same argmax tokens in every run:", len(checks) == 1)
print("| rows | layers old | layers new | new / old | head old | head new |")
print("|--:|--:|--:|--:|--:|--:|")
for t in map(str, ROWS):
    med = {n: [statistics.median(r["times"][t][k] for r in runs[n]) for k in (0, 1)] for n in trees}
    print(
        f"| {t} | {med['old'][0]:.3f} | {med['new'][0]:.3f} | {med['new'][0] / med['old'][0]:.3f} | "
        f"{med['old'][1]:.3f} | {med['new'][1]:.3f} |"
    )
