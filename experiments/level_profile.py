"""Where one seeded draft level's time goes: the kernels against the Python and torch dispatch around them.

    python experiments/level_profile.py [--adapters SEEDED_FILE] [--nodes 2] [--threads 1]

Times a tree level (start + one fast step over ``--nodes`` open nodes + top-2) at a 200-token
context, 300 times, then profiles the same 300 levels; kernel calls (`q4_linear`, `q8_linear`,
`row_attention`, `rms_norm`, `topk`) are listed apart from everything else.
"""

import argparse
import cProfile
import pstats
import time

import torch

from m2r2.decoding.tree import Tree
from m2r2.engine import Engine

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--adapters", default=None, help="a seeded stream's file instead of the shipped one")
parser.add_argument("--nodes", type=int, default=2)
parser.add_argument("--threads", type=int, default=1)
args = parser.parse_args()

engine = Engine(None, threads=args.threads, quiet=True)
model = engine.model
drafter = engine.strategy("m2r2", **({"adapters": args.adapters} if args.adapters else {})).drafter
ctx, n, rounds = 200, args.nodes, 300
cache = model.new_cache(ctx + 8)
h = torch.zeros(1, 1, model.cfg.hidden_size, dtype=model.dtype)
tree = Tree(list(range(1, n + 1)), [-1] * n, [0] * n, [1.0] * n)


def level() -> None:
    drafter.start(h, cache, ctx)
    drafter.top(tree, list(range(n)), 2)


with torch.inference_mode():
    model(torch.arange(ctx)[None], cache, 0, last_only=True)
    one = torch.ones(1, 1, dtype=torch.long)
    for _ in range(20):
        level()
    t = time.perf_counter()
    for _ in range(rounds):
        level()
    per_level = (time.perf_counter() - t) / rounds
    t = time.perf_counter()
    for _ in range(50):
        model.run_layers(model.embed_tokens(one), cache, ctx)
    step = (time.perf_counter() - t) / 50
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(rounds):
        level()
    prof.disable()

stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
total = sum(v[2] for v in stats.values())
kernels = {}
for (_, _, name), v in stats.items():
    for k in ("q4_linear", "q8_linear", "row_attention", "rms_norm", "topk", "argmax_rows"):
        if k in name:
            kernels[k] = kernels.get(k, 0.0) + v[2]
print(f"{args.adapters or 'shipped seeded stream'}, {n} open nodes, {args.threads} thread(s)")
print(f"one level {per_level * 1e3:.2f} ms = {per_level / step:.3f} of a one-token step ({step * 1e3:.2f} ms, no head)")
print("| part | share of the profiled level |")
print("|---|--:|")
for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]):
    print(f"| {k} | {v / total:.2f} |")
print(f"| everything else (Python, torch dispatch, small tensor ops) | {1 - sum(kernels.values()) / total:.2f} |")
