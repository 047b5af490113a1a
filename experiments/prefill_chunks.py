"""A prompt's prefill through the fused stack in passes of 32 rows (`Transformer._run_in_chunks`) against the
per-op path it replaced (torch's bfloat16 ops and SDPA over the whole prompt), in one process, interleaved:
the time of prefills of MT-Bench-sized prompts (median of 15), how far the two prompts' last states lie
apart, and whether `vanilla`'s answers to MT-Bench first turns stay the same.

    python experiments/prefill_chunks.py [--threads N] [--prompts N]
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


def chunked(on: bool) -> None:
    """The stack for prefills on or off (decoding passes keep it either way)."""
    model._stack_for = stack_for if on else (lambda x, c, p: stack_for(x, c, p) if x.shape[1] <= 32 else None)


print(f"{engine.kernel} kernel, {args.threads} thread(s)")
g = torch.Generator().manual_seed(0)
for n in (67, 128, 256):
    tokens = torch.randint(0, model.cfg.vocab_size, (1, n), generator=g)
    times: dict[bool, list[float]] = {True: [], False: []}
    last = {}
    with torch.inference_mode():
        for _ in range(15):
            for on in (True, False):
                chunked(on)
                cache = model.new_cache(n + 160)
                t = time.perf_counter()
                h = model.run_layers(model.embed_tokens(tokens), cache, 0)
                times[on].append(time.perf_counter() - t)
                last[on] = h[0, -1].float()
    a, b = (statistics.median(times[k]) * 1e3 for k in (True, False))
    diff = (last[True] - last[False]).abs().max().item() / last[False].abs().max().item()
    print(
        f"prefill {n:3d} tokens: chunks of 32 {a:6.1f} ms ({a / n:.2f} ms/token), per-op {b:6.1f} ms "
        f"({b / n:.2f} ms/token); last state max |diff| / max |state| {diff:.4f}"
    )

prompts = load_dataset("mt_bench", args.prompts).prompts
gen = GenerationConfig(max_new_tokens=64)
same = 0
for p in prompts:
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}])
    outs = []
    for on in (True, False):
        chunked(on)
        outs.append(engine.generate_ids(ids, "vanilla", gen).tokens)
    same += outs[0] == outs[1]
print(f"vanilla's 64-token answers to {len(prompts)} MT-Bench first turns the same with either prefill: {same}")
