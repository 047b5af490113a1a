"""On a CPU with AVX-512 (where `auto` picks `q4-avx512`, run op by op from Python): is the AVX2 build's
path, whose blocks run as one C++ call per pass (`stack_forward`), faster? Two engines in one process on
the same weights, `q4-avx512` (its own row helpers) and `q4-avx2` (the AVX2 build's row helpers, so the
fused stack applies), interleaved: one-token and 2-4-row passes at a 300-token context, then `vanilla` and
`m2r2` on MT-Bench first turns, each prompt on both engines in turn. The two kernels round differently
(the AVX2 one rounds inputs to int8 per group of 32), so their answers may differ; each is lossless
against its own `vanilla` (checked).

    python experiments/kernel_paths.py [--threads N] [--prompts N] [--repeats N]
"""

import argparse
import statistics
import time

import torch

from m2r2 import amx
from m2r2.bench.datasets import load_dataset
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine
from m2r2.machine import cpu_name

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--prompts", type=int, default=10)
ap.add_argument("--repeats", type=int, default=101)
args = ap.parse_args()
helpers = {"q4-avx512": amx.extension(), "q4-avx2": amx.avx2_extension()}
assert all(helpers.values()), "this CPU does not run both builds"


def use(kernel: str) -> None:
    """Route the per-row helpers (norms, attention, argmax) to ``kernel``'s build."""
    amx.row_helpers = lambda: helpers[kernel]


engines = {}
for kernel in helpers:
    use(kernel)
    engines[kernel] = Engine(threads=args.threads, kernel=kernel, quiet=True)
    assert engines[kernel].kernel == kernel
use("q4-avx2")
assert engines["q4-avx2"].model.fused_stack() is not None, "the fused stack does not apply"
print(f"{cpu_name()}, {args.threads} thread(s)")

print(f"\nlayer passes at a 300-token context, medians of {args.repeats}, interleaved")
print("| rows | q4-avx512 ms | q4-avx2 (stack) ms | avx2 / avx512 |\n|--:|--:|--:|--:|")
g = torch.Generator().manual_seed(0)
with torch.inference_mode():
    caches = {}
    start = torch.randint(0, 40000, (1, 300), generator=g)
    for kernel, engine in engines.items():
        use(kernel)
        caches[kernel] = engine.model.new_cache(1024)
        engine.model.run_layers(engine.model.embed_tokens(start), caches[kernel], 0)
    for rows in (1, 2, 3, 4):
        tok = torch.randint(0, 40000, (1, rows), generator=g)
        times: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(args.repeats):
            for kernel, engine in engines.items():
                use(kernel)
                x = engine.model.embed_tokens(tok)
                caches[kernel].length = 300
                t = time.perf_counter()
                engine.model.run_layers(x, caches[kernel], 300)
                times[kernel].append(time.perf_counter() - t)
        a, b = (statistics.median(times[k]) * 1e3 for k in engines)
        print(f"| {rows} | {a:.2f} | {b:.2f} | {b / a:.3f} |")

prompts = load_dataset("mt_bench", args.prompts + 1).prompts
gen = GenerationConfig(max_new_tokens=128)
methods = ("vanilla", "m2r2")
ids = [engines["q4-avx2"].tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}]) for p in prompts]
for kernel, engine in engines.items():
    use(kernel)
    for method in methods:
        engine.generate_ids(ids[0], method, gen)  # warm-up (and the tree's cost measurement)
seconds = {(k, m): 0.0 for k in engines for m in methods}
tokens = {(k, m): 0 for k in engines for m in methods}
ratios: dict[str, list[float]] = {k: [] for k in engines}
same = 0
for prompt in ids[1:]:
    per: dict[tuple[str, str], float] = {}
    outs = {}
    for kernel, engine in engines.items():
        use(kernel)
        for method in methods:
            t = time.perf_counter()
            outs[(kernel, method)] = engine.generate_ids(prompt, method, gen).tokens
            per[(kernel, method)] = time.perf_counter() - t
            seconds[(kernel, method)] += per[(kernel, method)]
            tokens[(kernel, method)] += len(outs[(kernel, method)])
        assert outs[(kernel, "vanilla")] == outs[(kernel, "m2r2")], f"{kernel}: m2r2 is not lossless"
        ratios[kernel].append(per[(kernel, "vanilla")] / per[(kernel, "m2r2")])
    same += outs[("q4-avx512", "vanilla")] == outs[("q4-avx2", "vanilla")]
print(f"\nMT-Bench first turns 2-{args.prompts + 1}, 128 new tokens, engines interleaved prompt by prompt")
print("| kernel | vanilla tok/s | m2r2 tok/s | m2r2 / vanilla (total) | median per prompt |\n|---|--:|--:|--:|--:|")
for kernel in engines:
    v, m = (tokens[(kernel, x)] / seconds[(kernel, x)] for x in methods)
    print(f"| {kernel} | {v:.1f} | {m:.1f} | {m / v:.3f} | {statistics.median(ratios[kernel]):.3f} |")
print(f"vanilla answers equal across the two kernels: {same} of {len(ids) - 1}")
