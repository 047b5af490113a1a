"""What a pass's Python around the fused blocks costs: a pass's blocks in one C++ call (`stack_forward`)
against the same blocks called one by one from Python (`Block.forward` -> `block_forward`), in one process,
interleaved. First a one-token pass at a 100-token context (median of 300), then `vanilla` and `m2r2` on
MT-Bench first turns, each prompt run with both paths in turn (outputs checked identical).

    python experiments/stack_overhead.py [--threads N] [--prompts N]
"""

import argparse
import statistics
import time

import torch

from m2r2.bench.datasets import load_dataset
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--prompts", type=int, default=10)
args = ap.parse_args()
engine = Engine(threads=args.threads, quiet=True)
model = engine.model
stack_for = model._stack_for


def use_stack(on: bool) -> None:
    model._stack_for = stack_for if on else (lambda *a: None)


with torch.inference_mode():
    cache = model.new_cache(512)
    model.run_layers(model.embed_tokens(torch.tensor([[100] * 100])), cache, 0)
    x = model.embed_tokens(torch.tensor([[200]]))
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(300):
        for on in (True, False):
            use_stack(on)
            cache.length = 100
            t = time.perf_counter()
            model.run_layers(x, cache, 100)
            times[on].append(time.perf_counter() - t)
one, per = (statistics.median(times[k]) * 1e3 for k in (True, False))
print(f"{engine.kernel} kernel, {args.threads} thread(s)")
print(f"one-token pass, 100-token context: one call {one:.3f} ms, block by block {per:.3f} ms ({per - one:.3f} ms)")

prompts = load_dataset("mt_bench", args.prompts + 1).prompts
ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}]) for p in prompts]
gen = GenerationConfig(max_new_tokens=128)
for method in ("vanilla", "m2r2"):
    engine.generate_ids(ids[0], method, gen)  # warm-up (and the tree's cost measurement)
seconds = {(m, on): 0.0 for m in ("vanilla", "m2r2") for on in (True, False)}
tokens = dict.fromkeys(("vanilla", "m2r2"), 0)
for prompt in ids[1:]:
    for method in ("vanilla", "m2r2"):
        outs = []
        for on in (True, False):
            use_stack(on)
            t = time.perf_counter()
            outs.append(engine.generate_ids(prompt, method, gen).tokens)
            seconds[(method, on)] += time.perf_counter() - t
        assert outs[0] == outs[1], "the two paths gave different tokens"
        tokens[method] += len(outs[0])
for on in (True, False):
    v, m = (tokens[k] / seconds[(k, on)] for k in ("vanilla", "m2r2"))
    label = "one call     " if on else "block by block"
    print(f"{label}: vanilla {v:.1f} tok/s, m2r2 {m:.1f} tok/s, m2r2 / vanilla {m / v:.3f}")
