"""The AVX2 build's linears with and without their AVX512-VNNI loop (`csrc_avx2/q4_vnni.cpp`), toggled in
one process (`set_vnni`), interleaved: SmolLM2's layer stack for passes of 1-8 rows at a 300-token context
and its 8-bit head, then `vanilla` and `m2r2` on MT-Bench first turns, each prompt run both ways in turn.
Both loops give the same bits (checked on every pass and every answer).

    python experiments/vnni_ab.py [--threads N] [--prompts N] [--repeats N]
"""

import argparse
import time

import torch
from warmed import toggled

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
engine = Engine(threads=args.threads, quiet=True)
model, ext = engine.model, amx.avx2_extension()
assert engine.kernel == "q4-avx2" and ext.set_vnni(True), "needs the q4-avx2 kernel on an AVX512-VNNI CPU"
print(f"{cpu_name()}, {args.threads} thread(s), {engine.kernel}")


print(f"\nmedians of {args.repeats}, interleaved")
print("| pass | rows | VNNI ms | AVX2 ms | VNNI / AVX2 |\n|---|--:|--:|--:|--:|")
g = torch.Generator().manual_seed(0)
with torch.inference_mode():
    cache = model.new_cache(1024)
    model.run_layers(model.embed_tokens(torch.randint(0, 40000, (1, 300), generator=g)), cache, 0)
    for rows in (1, 2, 3, 4, 6, 8):
        x = model.embed_tokens(torch.randint(0, 40000, (1, rows), generator=g))

        def layers(x=x):
            cache.length = 300
            return model.run_layers(x, cache, 300)

        on, off = toggled(layers, ext.set_vnni, args.repeats)
        h = x[0].contiguous()
        hon, hoff = toggled(lambda h=h: model.lm_head(h), ext.set_vnni, args.repeats)
        print(f"| 30 layers | {rows} | {on * 1e3:.2f} | {off * 1e3:.2f} | {on / off:.3f} |")
        print(f"| head | {rows} | {hon * 1e3:.2f} | {hoff * 1e3:.2f} | {hon / hoff:.3f} |")

prompts = load_dataset("mt_bench", args.prompts + 1).prompts
ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}]) for p in prompts]
gen = GenerationConfig(max_new_tokens=128)
methods = ("vanilla", "m2r2")
for method in methods:
    engine.generate_ids(ids[0], method, gen)  # warm-up (and the tree's cost measurement)
seconds = {(m, on): 0.0 for m in methods for on in (True, False)}
tokens = dict.fromkeys(methods, 0)
for prompt in ids[1:]:
    for method in methods:
        outs = []
        for on in (True, False):
            ext.set_vnni(on)
            t = time.perf_counter()
            outs.append(engine.generate_ids(prompt, method, gen).tokens)
            seconds[(method, on)] += time.perf_counter() - t
        assert outs[0] == outs[1], "the two loops gave different tokens"
        tokens[method] += len(outs[0])
ext.set_vnni(True)
print(f"\nMT-Bench first turns 2-{args.prompts + 1}, 128 new tokens, toggled prompt by prompt")
for on in (True, False):
    v, m = (tokens[k] / seconds[(k, on)] for k in methods)
    print(f"{'VNNI' if on else 'AVX2'}: vanilla {v:.1f} tok/s, m2r2 {m:.1f} tok/s, m2r2 / vanilla {m / v:.3f}")
