"""Trees whose levels widen only where it pays (the default since the eighteenth round) against trees that
always draft under ``width`` nodes (the rule before), and chains, side by side in one process: greedy
`vanilla` and the three `m2r2` variants on MT-Bench first turns, prompt by prompt in turn (outputs compared
token for token with vanilla), all with the same measured costs. Prints tokens per second, the median
per-prompt ratio to vanilla, tokens and rows per verify pass, and draft levels per token.

    python experiments/frontier_ab.py [PROMPTS] [--threads N]
"""

import argparse
import statistics
import time

from m2r2.bench.datasets import load_dataset
from m2r2.decoding import build_strategy
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine
from m2r2.machine import cpu_name

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("prompts", nargs="?", type=int, default=20)
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()

engine = Engine(threads=args.threads, quiet=True)
always = build_strategy("m2r2", engine)
always._frontier = lambda tree, new, calib: new[: always.width]  # the rule before: every level `width` wide
variants = {
    "vanilla": engine.strategy("vanilla"),
    "m2r2 (widen where it pays)": engine.strategy("m2r2"),
    "m2r2 (always width 2)": always,
    "m2r2 chain": engine.strategy("m2r2", width=1, branch=1),
}
prompts = load_dataset("mt_bench", args.prompts + 1).prompts
tok = engine.tokenizer
ids = [tok.encode_chat([{"role": "user", "content": p.turns[0]}]) for p in prompts]
gen = GenerationConfig(max_new_tokens=128)
for s in variants.values():  # warm-up (and the measured tree costs, shared through the cost cache)
    s.generate(ids[0], gen)

seconds = {k: [] for k in variants}
counts = {k: {"tokens": 0, "passes": 0, "rows": 0.0, "levels": 0.0} for k in variants}
same = {k: 0 for k in variants}
for x in ids[1:]:
    ref = None
    for name, s in variants.items():
        t = time.perf_counter()
        out = s.generate(x, gen)
        seconds[name].append(time.perf_counter() - t)
        ref = out.tokens if ref is None else ref
        same[name] += out.tokens == ref
        n = len(out.tokens)
        c = counts[name]
        c["tokens"] += n
        passes = out.stats.get("verify_passes", n)
        c["passes"] += passes
        c["rows"] += out.stats.get("verify_rows_per_pass", 1.0) * passes
        c["levels"] += out.stats.get("draft_layers_per_token", 0.0) * n

print(f"{cpu_name()}, {args.threads} thread(s), MT-Bench first turns 2..{len(ids)}, 128 new tokens")
print("| variant | tok/s | median ratio | identical | tokens / pass | rows / pass | draft layers / token |")
print("|---|--:|--:|--:|--:|--:|--:|")
for name in variants:
    c = counts[name]
    ratio = statistics.median(v / m for v, m in zip(seconds["vanilla"], seconds[name], strict=True))
    print(
        f"| {name} | {c['tokens'] / sum(seconds[name]):.1f} | {ratio:.2f}x | {same[name]}/{len(ids) - 1} | "
        f"{c['tokens'] / c['passes']:.2f} | {c['rows'] / c['passes']:.2f} | {c['levels'] / c['tokens']:.3f} |"
    )
