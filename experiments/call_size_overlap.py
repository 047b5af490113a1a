"""Whether a verify pass's extra rows hide under the weights' stream: one 43 MB 4-bit linear layer (576 inputs,
120,000 outputs, random weights; three of them in turn, so that each comes from memory) at 1, 2, 4 and 8 rows, run
as one call or as consecutive calls over slices the sizes of SmolLM2's layers (gate|up 3,072 outputs, q/k/v 960,
output projection 576), on the q4-avx2 build, 2 threads, medians of 20 sweeps. In one call 4 rows cost what 1 row
costs (the products overlap the stream); in calls of a layer's size each extra row adds time again.

    python experiments/call_size_overlap.py
"""

import statistics
import time

import torch

from m2r2 import amx

ext = amx.avx2_extension()
assert ext is not None, "the q4-avx2 build is needed"
torch.set_num_threads(2)
K, N = 576, 120_000


def weight(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 256, (n // 8, K // 8, 32), dtype=torch.uint8)
    s = (torch.rand(n // 8, K // 32, 2, 8) * 0.01).half()
    return q, s


weights = [weight(N) for _ in range(3)]


def sweep_ms(rows: int, cols: int, sweeps: int = 20) -> float:
    x = torch.randn(rows, K).bfloat16()
    nb = cols // 8
    times = []
    for i in range(sweeps):
        q, s = weights[i % 3]
        t = time.perf_counter()
        for b0 in range(0, N // 8, nb):
            ext.q4_linear_avx2(x, q[b0 : b0 + nb], s[b0 : b0 + nb])
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


print("| calls of | 1 row | 2 rows | 4 rows | 8 rows |")
print("|---|--:|--:|--:|--:|")
for cols in (N, 3072, 960, 576):
    ms = [sweep_ms(m, cols) for m in (1, 2, 4, 8)]
    print(f"| {cols} outputs ({cols * K * 0.625 / 1e3:.0f} KB) | " + " | ".join(f"{v:.2f} ms" for v in ms) + " |")
