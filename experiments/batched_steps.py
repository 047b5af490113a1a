"""What one greedy decoding step of B sequences costs: in one C++ call (`Transformer.greedy_steps`) against the per-op
batched step (`Transformer.step_rows` and the head's argmax) on the same pooled caches, and a lone sequence's one-call
step (`greedy_pass`) beside them. Caches stored as decoding stores them (bfloat16: distillation's pool) or in float32
(the server's pool); sequence b holds a 150 + 3b token prompt. Medians of 12 steps, ms; tokens/s = B / step.

    python experiments/batched_steps.py [THREADS]
"""

# ruff: noqa: B023 (each timed closure runs inside its own loop iteration)

import statistics
import sys
import time

import torch

from m2r2.cache import KVPool
from m2r2.engine import Engine
from m2r2.kernels import head_argmax

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
engine = Engine(threads=threads, quiet=True)
model = engine.model
g = torch.Generator().manual_seed(0)


def median_ms(step) -> float:
    times = []
    for _ in range(12):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


print(f"{engine.kernel} kernel, {threads} thread(s); ms a step (tokens/s)")
print("| store | B | one call | per op + head | per op / one call | a lone one-call step |")
print("|---|--:|--:|--:|--:|--:|")
with torch.inference_mode():
    lone = model.new_cache(448)
    model(torch.randint(0, 40000, (1, 150), generator=g), lone, 0, last_only=True)
    for store in (None, torch.float32):
        for b in (1, 2, 4, 8, 16, 32):
            pool = KVPool(model.cfg, 32, model.dtype, model.device, store)
            seqs = []
            for i in range(b):
                seqs.append(pool.take(448))
                model(torch.randint(0, 40000, (1, 150 + 3 * i), generator=g), seqs[-1], 0, last_only=True)
            toks = [5] * b

            def rewind(f):  # each step from the same lengths: the same work every time
                lengths = [c.length for c in seqs]

                def run():
                    f()
                    for c, n in zip(seqs, lengths, strict=True):
                        c.length = n

                return run

            fused = median_ms(rewind(lambda: model.greedy_steps(toks, seqs)))
            per_op = median_ms(rewind(lambda: head_argmax(model, model.step_rows(toks, seqs)[:, 0])))
            n = lone.length
            alone = median_ms(lambda: (model.greedy_pass([5], lone, n), setattr(lone, "length", n)))
            name = "bfloat16" if store is None else "float32"
            print(
                f"| {name} | {b} | {fused:.2f} ({b / fused * 1e3:.0f}) | {per_op:.2f} ({b / per_op * 1e3:.0f}) | "
                f"{per_op / fused:.2f} | {alone:.2f} ({1 / alone * 1e3:.0f}) |",
                flush=True,
            )
