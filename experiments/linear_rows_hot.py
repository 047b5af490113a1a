"""What a row costs a 4-bit linear layer of the ``q4-avx2`` kernel with its weights hot in L2: one 576 x 1536 layer
(SmolLM2's gate or up projection; random Q4_1 weights) called back to back on one thread, 1-8 rows; medians of 15
runs of 200 calls, in microseconds a call (Python's call included). Run it on another checkout's code by putting its
``src`` first on PYTHONPATH (experiments/tree_ab.out.txt: the pair layout against the shipped one).

    python experiments/linear_rows_hot.py
"""

import statistics
import time

import torch

from m2r2 import amx
from m2r2.kernels import AmxInt4Linear

torch.set_num_threads(1)
g = torch.Generator().manual_seed(1)
n, k = 1536, 576
q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
q[..., 0], q[..., 1] = 0.0, 15.0  # each group's minimum and maximum: GGUF Q4_1's q = 0 and 15
d = 2.0 ** -torch.randint(4, 8, (n, k // 32, 1), generator=g).float()
m = -torch.randint(0, 64, (n, k // 32, 1), generator=g).float() / 64
lin = torch.nn.Linear(k, n, bias=False)
lin.weight.data = (q * d + m).view(n, k).to(torch.bfloat16)
layer = AmxInt4Linear(lin, products="avx2")
cells = []
for rows in (1, 2, 3, 4, 8):
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    for _ in range(200):
        layer(x)
    runs = []
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(200):
            layer(x)
        runs.append((time.perf_counter() - t) / 200)
    cells.append(f"{rows} rows {1e6 * statistics.median(runs):.1f} us")
print(f"{amx.__file__}: " + ", ".join(cells))
