"""What a prompt's prefill costs by its length (1 thread, best of 3), and the MT-Bench first turns'
prompt lengths: the prefill is paid by every method alike, once per turn, and is part of each
prompt's time in `m2r2 bench`.

    python experiments/prefill_cost.py
"""

import statistics
import time

import torch

from m2r2.bench.datasets import load_dataset
from m2r2.engine import Engine

engine = Engine(threads=1, quiet=True)
model = engine.model
prompts = load_dataset("mt_bench", 60).prompts
lengths = [len(engine.tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}])) for p in prompts]
print("first-turn prompt tokens: median", statistics.median(lengths), "mean", sum(lengths) / len(lengths))
with torch.inference_mode():
    for n in (1, 16, 32, 64, 128, 256, 384):
        ids = torch.arange(n)[None] % 1000 + 100
        best = float("inf")
        for _ in range(3):
            cache = model.new_cache(n + 200)
            t = time.perf_counter()
            model(ids, cache, 0, last_only=True)
            best = min(best, time.perf_counter() - t)
        print(f"prefill {n:4d} tokens: {best * 1e3:7.1f} ms  ({best * 1e3 / n:.2f} ms/token)")
