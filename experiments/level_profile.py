"""Where one seeded draft level's time goes: its C++ kernel calls timed alone against the whole level.

    python experiments/level_profile.py [--adapters SEEDED_FILE] [--nodes 2] [--threads 1]

Times a tree level (start + one fast step over ``--nodes`` open nodes + top-2) at a 200-token context
(minimum over 500 levels), records every C++ kernel call one level makes (`q4_linear`, `q8_linear`,
`row_attention`, `rms_norm`) and replays each with its own arguments alone (minimum over 500 calls).
What the kernels do not account for is torch ops and Python around them, and the kernels' own
extra time in a level, where they run colder than replayed alone (the 2.4 MB draft head does not fit
in L2): an upper bound on dispatch.

On the AVX2 build a level of the shipped stream is one ``draft_level`` call (fuse, fast block, draft head,
softmax and top-k; ``csrc_avx2/block_avx2.cpp``): what remains outside it is the tree's tensors and Python.

Why not cProfile (this script's first version): its per-call overhead lands on the many small calls.
One C++ call per fast layer (the same bits; tried in the tenth round, not kept) saved only 3-6% of a
level, so the layer's own dispatch is small; what remains is the seed, the head's softmax and top-k,
the tree's small tensors, and colder caches (not separated).
"""

import argparse
import time

import torch

from m2r2 import amx
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
ctx, n, rounds = 200, args.nodes, 500
cache = model.new_cache(ctx + 16)
h = torch.zeros(1, 1, model.cfg.hidden_size, dtype=model.dtype)
tree = Tree(list(range(1, n + 1)), [-1] * n, [0] * n, [1.0] * n)
ext = amx.extension() or amx.avx2_extension()  # the AVX-512 build, else the AVX2 one (its linears' own names)
KERNELS = tuple(
    k
    for k in (
        "q4_linear",
        "q8_linear",
        "q4_linear_avx2",
        "q8_linear_avx2",
        "row_attention",
        "rms_norm",
        "block_forward",
        "draft_level",
    )
    if hasattr(ext, k)
)


def level() -> None:
    drafter.start(h, cache, ctx)
    drafter.top(tree, list(range(n)), 2)


def best(fn, k: int = rounds) -> float:
    times = []
    for _ in range(k):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


with torch.inference_mode():
    model(torch.arange(ctx)[None], cache, 0, last_only=True)
    one = torch.ones(1, 1, dtype=torch.long)
    for _ in range(20):
        level()
    per_level = best(level)
    step = best(lambda: model.run_layers(model.embed_tokens(one), cache, ctx), 50)
    calls: list[tuple[str, tuple]] = []
    originals = {k: getattr(ext, k) for k in KERNELS}
    for k, fn in originals.items():
        setattr(ext, k, lambda *a, k=k, fn=fn: (calls.append((k, a)), fn(*a))[1])
    try:
        level()
    finally:
        for k, fn in originals.items():
            setattr(ext, k, fn)
    alone: dict[str, float] = {}
    for k, a in calls:
        alone[k] = alone.get(k, 0.0) + best(lambda k=k, a=a: originals[k](*a))

print(f"{args.adapters or 'shipped seeded stream'}, {n} open nodes, {args.threads} thread(s)")
print(f"one level {per_level * 1e3:.3f} ms = {per_level / step:.3f} of a one-token step ({step * 1e3:.2f} ms, no head)")
print("| part | ms | share of the level |")
print("|---|--:|--:|")
for k, v in sorted(alone.items(), key=lambda kv: -kv[1]):
    calls_k = sum(1 for c, _ in calls if c == k)
    print(f"| {k} ({calls_k} call{'s' if calls_k > 1 else ''}) | {v * 1e3:.3f} | {v / per_level:.2f} |")
rest = per_level - sum(alone.values())
print(f"| everything else (torch ops, Python) | {rest * 1e3:.3f} | {rest / per_level:.2f} |")
