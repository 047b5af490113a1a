"""The pieces behind the forty-fifth round's prefill figures, timed in one process (median of 50 or more calls):
the 8-bit LM head at 1-8 rows, one layer's linears at 71 and 300 rows on the int8 loops and on the prefill's AMX-BF16
tiles, and `vanilla`'s decoding step after a prefill on either (MT-Bench first turns, the settings alternating).

    python experiments/prefill_ops.py [THREADS]
"""

import statistics
import sys
import time

import torch

from m2r2 import amx
from m2r2.bench.datasets import load_dataset
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine
from m2r2.kernels import head_argmax


def median_ms(fn, calls: int = 50) -> float:
    seconds = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t)
    return 1000 * statistics.median(seconds)


threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
engine = Engine(threads=threads, quiet=True)
model, ext = engine.model, amx.avx2_extension()
if ext is None or not ext.set_bf16_prefill(True):
    sys.exit("the prefill's AMX-BF16 tiles do not run here")
print(f"# {threads} thread(s)")
row = []
for n in (1, 2, 4, 6, 8):
    x = torch.randn(1, n, model.cfg.hidden_size, dtype=torch.bfloat16)
    row.append(f"{n} rows {median_ms(lambda x=x: head_argmax(model, x), 200):.3f} ms")
print("LM head with its argmax:", ", ".join(row))
block = model.layers[3]
for name, lin in (("q/k/v", block.attn.wqkv), ("gate|up", block.mlp.w13), ("down", block.mlp.w2)):
    for m in (71, 300):
        x = torch.randn(m, lin.in_features).bfloat16()
        int8 = median_ms(lambda x=x, lin=lin: ext.q4_linear_avx2(x, lin.qbytes, lin.scales))
        tiles = median_ms(lambda x=x, lin=lin: ext.bf16_linear(x, lin.qbytes, lin.scales, 4))
        print(f"{name} at {m} rows: int8 loops {int8:.3f} ms, tiles {tiles:.3f} ms ({int8 / tiles:.2f}x)")
full, first = GenerationConfig(max_new_tokens=128), GenerationConfig(max_new_tokens=1)
step: dict[bool, list[float]] = {True: [], False: []}
for rep in range(2):
    for i, prompt in enumerate(load_dataset("mt_bench", 20).prompts):
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt.turns[0]}])
        for on in (True, False) if (i + rep) % 2 == 0 else (False, True):
            ext.set_bf16_prefill(on)
            t = time.perf_counter()
            engine.generate_ids(ids, "vanilla", first)
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            result = engine.generate_ids(ids, "vanilla", full)
            step[on].append((time.perf_counter() - t - prefill) / max(1, len(result.tokens) - 1))
ext.set_bf16_prefill(True)
paired = statistics.median(a / b for a, b in zip(step[True], step[False], strict=True))
print(
    f"vanilla's step after the prefill: {1000 * statistics.median(step[True]):.3f} ms after the tiles, "
    f"{1000 * statistics.median(step[False]):.3f} after the int8 loops (paired tiles / int8 {paired:.3f}, 40 answers)"
)
