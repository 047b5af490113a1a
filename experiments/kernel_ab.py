"""One-token step and verify passes of q4 and the C++ 4-bit kernels this CPU runs (q4-amx on AMX,
q4-avx512 on AVX512-BF16), interleaved in one process (the same context, certified head), so machine
noise hits all alike.

    python experiments/kernel_ab.py THREADS
"""

import statistics
import sys
import time

import torch

from m2r2 import amx
from m2r2.engine import Engine
from m2r2.kernels import head_argmax

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
kinds = ["q4", *(["q4-amx"] if amx.amx_available() else []), *(["q4-avx512"] if amx.available() else [])]
engines = {k: Engine(kernel=k, threads=threads, quiet=True) for k in kinds}
ctx = 200
rows = (1, 2, 4, 8, 16)
caches = {}
with torch.inference_mode():
    for k, e in engines.items():
        caches[k] = e.model.new_cache(ctx + 20)
        e.model(torch.arange(ctx)[None] % e.model.cfg.vocab_size, caches[k], 0)
    T = {}
    for rep in range(16):
        for r in rows:
            for k, e in engines.items():
                m = e.model
                b = torch.full((1, r), 7)
                t = time.perf_counter()
                h = m.run_layers(m.embed_tokens(b), caches[k], ctx)
                t2 = time.perf_counter()
                head_argmax(m, h)
                t3 = time.perf_counter()
                if rep:
                    T.setdefault((k, r, "layers"), []).append(t2 - t)
                    T.setdefault((k, r, "total"), []).append(t3 - t)
for k in engines:
    one = statistics.median(T[(k, 1, "total")])
    print(
        k,
        f"step {one * 1e3:.1f} ms (layers {statistics.median(T[(k, 1, 'layers')]) * 1e3:.1f})",
        " ".join(f"v({r})={statistics.median(T[(k, r, 'total')]) / one:.2f}" for r in rows),
    )
base = statistics.median(T[("q4", 1, "total")])
print(
    "relative to q4 one-token step:",
    " ".join(f"{k}:" + ",".join(f"{statistics.median(T[(k, r, 'total')]) / base:.2f}" for r in rows) for k in engines),
)
