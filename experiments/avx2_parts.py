"""On a CPU with AVX2 only: what the ``csrc_avx2`` build replaces, part by part (1 thread, best of 200
calls, or medians of 20 one-token steps). Prints microseconds per call of the per-row helpers against
the torch ops they replace, SmolLM2's linear layers by rows (``q4-avx2`` against torch's ``q4``), and
a one-token step of the whole model on each kernel. The state before this build (torch's helpers too)
is ``M2R2_NO_AMX=1 python experiments/verify_cost.py --kernels q4 --rows 1 --threads 1``.

    python experiments/avx2_parts.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

from m2r2 import amx
from m2r2.engine import Engine
from m2r2.machine import cpu_name
from m2r2.model import _row_math

torch.set_num_threads(1)
ext = amx.avx2_extension()
assert ext is not None, "the AVX2 build does not run here"


def best_us(f, calls: int = 200) -> float:
    f()
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


print(cpu_name(), "1 thread")
x, w = torch.randn(1, 1, 576).bfloat16(), torch.randn(576).bfloat16()
ours, theirs = best_us(lambda: ext.rms_norm(x, w, 1e-5)), best_us(lambda: F.rms_norm(x, (576,), w, 1e-5))
print(f"RMSNorm, 576: C++ {ours:.1f} us, torch {theirs:.1f} us")
logits = torch.randn(1, 49152).bfloat16()
ours, theirs = best_us(lambda: ext.argmax_rows(logits)), best_us(lambda: logits.argmax(-1))
print(f"argmax, 49152 logits: C++ {ours:.1f} us, torch {theirs:.1f} us")
q, k, v = torch.randn(1, 9, 1, 64), torch.randn(1, 3, 264, 64).bfloat16(), torch.randn(1, 3, 264, 64).bfloat16()
mask, qb = torch.ones(1, 1, 264, dtype=torch.bool), q.bfloat16()
ours = best_us(lambda: ext.row_attention(q, k, v, mask, 0.125))
theirs = best_us(lambda: _row_math(qb, k, v, mask[0], True))
print(f"row attention, 1 row, 9/3 heads, 264 keys: C++ {ours:.1f} us, float32 torch {theirs:.1f} us")

engines = {kernel: Engine(kernel=kernel, threads=1, quiet=True) for kernel in ("q4-avx2", "q4")}
for kernel, e in engines.items():
    block = e.model.layers[0]
    layers = (block.attn.wqkv, block.attn.wo, block.mlp.w13, block.mlp.w2)
    cells = []
    for rows in (1, 2, 4, 8, 64):
        inputs = [torch.randn(rows, lin.in_features).bfloat16() for lin in layers]
        per_row = sum(best_us(lambda lin=lin, x=x: lin(x), 50) for lin, x in zip(layers, inputs, strict=True))
        cells.append(f"{rows} rows {per_row / rows:.0f}")
    print(f"{kernel}: one layer's linears, us per row: " + ", ".join(cells))
    head, h1, h4 = e.model.lm_head, torch.randn(1, 576).bfloat16(), torch.randn(4, 576).bfloat16()
    one_row = best_us(lambda head=head, x=h1: head(x), 20)
    four_rows = best_us(lambda head=head, x=h4: head(x), 20)
    print(f"{kernel}: LM head, 1 / 4 rows: {one_row:.0f} / {four_rows:.0f} us")
with torch.inference_mode():
    for kernel, e in engines.items():
        m = e.model
        cache = m.new_cache(260)
        m(torch.arange(200)[None] % 1000 + 100, cache, 0)
        one = torch.full((1, 1), 7)
        times = []
        for _ in range(25):
            t = time.perf_counter()
            m(one, cache, 200)
            times.append(time.perf_counter() - t)
        step_ms = statistics.median(times[5:]) * 1e3
        print(f"{kernel}: one-token step at a 200-token context, median of 25: {step_ms:.1f} ms")
