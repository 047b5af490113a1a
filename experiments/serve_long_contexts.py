"""Served answers at long contexts against `Engine.generate` alone: four prompts built from MT-Bench's first turns
(438-622 tokens), 64 new tokens, served one at a time and all together, with the server's cache pool as
`Transformer.new_pool` makes it and with a float32 pool (what it made until commit c9badc2).

Why: a bfloat16 cache's attention in the fused blocks takes AMX tiles from 448 keys, with sums of their own, while a
float32 cache does not; a served request must get the answer `m2r2 generate` gives it alone.

    python experiments/serve_long_contexts.py [THREADS]
"""

# ruff: noqa: B023 (each level's closures run inside its own loop iteration)

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from m2r2.bench.datasets import load_dataset
from m2r2.cache import KVPool
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine
from m2r2.serve.app import background, build

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
engine = Engine(threads=threads, quiet=True)
model = engine.model
text = " ".join(p.turns[0] for p in load_dataset("mt_bench", 12).prompts)
prompts = [f"Summarise these requests in one paragraph: {text[:n]}" for n in (2000, 2600, 3000, 3400)]
ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
want = [
    engine.tokenizer.decode(engine.generate_ids(i, "vanilla", GenerationConfig(max_new_tokens=64)).tokens) for i in ids
]
print(f"{engine.kernel} kernel, {threads} thread(s); prompts of {[len(i) for i in ids]} tokens, 64 new tokens each")


def served(url: str, prompt: str) -> str:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 64}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]["message"]["content"]


default_pool = model.new_pool
for name, pool in (
    ("new_pool's", default_pool),
    ("float32", lambda n: KVPool(model.cfg, n, model.dtype, "cpu", torch.float32)),
):
    model.new_pool = pool
    with background(build(engine, "smollm2-135m", "auto", max_batch=len(prompts))) as url:
        alone = [served(url, p) for p in prompts]
        barrier = threading.Barrier(len(prompts))
        with ThreadPoolExecutor(len(prompts)) as ex:
            together = list(ex.map(lambda p: (barrier.wait(), served(url, p))[1], prompts))
    dtype = pool(1).take(64).k.dtype
    same_alone = [a == w for a, w in zip(alone, want, strict=True)]
    same_together = [a == w for a, w in zip(together, want, strict=True)]
    print(f"{name} pool ({dtype}): equal to generate alone {same_alone}, served together {same_together}")
model.new_pool = default_pool
