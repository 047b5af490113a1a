"""The fused decoder block against the per-op path, side by side in one process: greedy `vanilla` and
`m2r2` on MT-Bench first turns, each prompt run on both paths in turn (outputs compared token for token),
plus a one-token step's layers and v(4) on each path. Two engines, one per path, so that each measures
its own tree costs.

    python experiments/fused_block.py [PROMPTS] [--threads N]
"""

import argparse
import statistics
import time

import torch

import m2r2.model as slow
from m2r2.bench.datasets import load_dataset
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine
from m2r2.machine import cpu_name

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("prompts", nargs="?", type=int, default=10)
parser.add_argument("--threads", type=int, default=1)
args = parser.parse_args()

engines = {}
for fused in (False, True):
    slow.FUSED_BLOCKS = fused
    engines[fused] = Engine(threads=args.threads, quiet=True)
prompts = load_dataset("mt_bench", args.prompts + 1).prompts
tok = engines[True].tokenizer
ids = [tok.encode_chat([{"role": "user", "content": p.turns[0]}]) for p in prompts]
gen = GenerationConfig(max_new_tokens=128)
for fused, e in engines.items():  # warm-up, and each path's tree costs
    slow.FUSED_BLOCKS = fused
    for method in ("vanilla", "m2r2"):
        e.generate_ids(ids[0], method, gen)


def layer_times(model, rows: int) -> float:
    """Median seconds of the layers of a pass of ``rows`` rows at a 200-token context."""
    cache = model.new_cache(232)
    with torch.inference_mode():
        model(torch.arange(200)[None], cache, 0, last_only=True)
        block = torch.ones(1, rows, dtype=torch.long)
        times = []
        for _ in range(30):
            cache.length = 200
            t = time.perf_counter()
            model.run_layers(model.embed_tokens(block), cache, 200)
            times.append(time.perf_counter() - t)
    return statistics.median(times[5:])


print(f"# {cpu_name()}, {args.threads} thread(s), MT-Bench first turns 2..{args.prompts + 1}, 128 new tokens")
for fused, e in engines.items():
    slow.FUSED_BLOCKS = fused
    one, four = layer_times(e.model, 1), layer_times(e.model, 4)
    print(f"{'fused' if fused else 'per-op'}: one-token step's layers {one * 1e3:.2f} ms, 4 rows {four / one:.2f}x")
tokens: dict[tuple[bool, str], int] = {}
seconds: dict[tuple[bool, str], float] = {}
same = 0
for p in ids[1:]:
    outs = {}
    for method in ("vanilla", "m2r2"):
        for fused in (False, True):
            slow.FUSED_BLOCKS = fused
            c = engines[fused].generate_ids(p, method, gen)
            tokens[fused, method] = tokens.get((fused, method), 0) + len(c.tokens)
            seconds[fused, method] = seconds.get((fused, method), 0.0) + c.seconds
            outs[fused, method] = c.tokens
    same += len({tuple(t) for t in outs.values()}) == 1
print("| path | vanilla tok/s | m2r2 tok/s | m2r2 / vanilla |")
print("|---|--:|--:|--:|")
for fused in (False, True):
    v, m = (tokens[fused, k] / seconds[fused, k] for k in ("vanilla", "m2r2"))
    print(f"| {'fused block' if fused else 'per-op'} | {v:.1f} | {m:.1f} | {m / v:.2f}x |")
print(f"outputs identical on both paths and methods: {same} of {len(ids) - 1} prompts")
