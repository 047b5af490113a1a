"""What a verify row costs inside real `m2r2` generation, by context length, against the measured curve the trees
start from (timed once at a 128-token context). Every greedy verify pass of MT-Bench first and second turns (the
second with the model's own first answer in its context) is recorded with its context, rows and seconds (the pass
``VerifyFit`` times: building the rows, the layers, the certified head); per context band, least squares of seconds
on rows - 1 give the in-situ one-row pass and per-row cost, printed beside the measured curve's over the same passes.

    python experiments/insitu_rows.py [PROMPTS] [THREADS]
"""

import collections
import sys

import torch

from m2r2.bench.datasets import load_dataset
from m2r2.decoding import tree as tree_mod
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 20
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine = Engine(threads=threads, quiet=True)
tok = engine.tokenizer
gen = GenerationConfig(max_new_tokens=128)
prompts = load_dataset("mt_bench", n_prompts).prompts
passes: list[tuple[int, int, float, float]] = []  # (context, rows, seconds, measured seconds)
context = [0]
round_fn, add_fn = tree_mod.TreeSpeculative.round, tree_mod.VerifyFit.add


def round_(self, state, cache, *args, **kwargs):
    context[0] = cache.length
    return round_fn(self, state, cache, *args, **kwargs)


def add(self, rows, seconds, measured):
    passes.append((context[0], rows, seconds, measured))
    return add_fn(self, rows, seconds, measured)


tree_mod.TreeSpeculative.round, tree_mod.VerifyFit.add = round_, add
engine.generate_ids(tok.encode_chat([{"role": "user", "content": prompts[0].turns[0]}]), "m2r2", gen)  # warm-up
passes.clear()
for p in prompts:
    first = [{"role": "user", "content": p.turns[0]}]
    answer = engine.generate_ids(tok.encode_chat(first), "m2r2", gen)
    if len(p.turns) > 1:
        reply = {"role": "assistant", "content": tok.decode(answer.tokens)}
        second = [*first, reply, {"role": "user", "content": p.turns[1]}]
        engine.generate_ids(tok.encode_chat(second), "m2r2", gen)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    x, y = torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    return float(y.mean()) - slope * float(x.mean()), slope


print(f"{engine.kernel}, {threads} thread(s), {len(passes)} verify passes of {n_prompts} MT-Bench prompts (both turns)")
print(
    "context band | passes | mean rows | in situ: one row, per row (ms) | measured: one row, per row (ms)"
    " | per-row ratio"
)
bands = collections.defaultdict(list)
for c, r, s, m in passes:
    bands[min(c // 200, 3)].append((r - 1, s, m))
for b in sorted(bands):
    rows = bands[b]
    xs = [x for x, _, _ in rows]
    if len(set(xs)) < 2:
        continue
    base, per_row = fit(xs, [s for _, s, _ in rows])
    base_m, per_row_m = fit(xs, [m for _, _, m in rows])
    label = f"{200 * b}-{200 * b + 199}" if b < 3 else "600+"
    print(
        f"{label:>12} | {len(rows):6d} | {1 + sum(xs) / len(xs):9.2f} | {base * 1e3:6.2f}, {per_row * 1e3:5.2f}"
        f" | {base_m * 1e3:6.2f}, {per_row_m * 1e3:5.2f} | {per_row / per_row_m:5.2f}"
    )
