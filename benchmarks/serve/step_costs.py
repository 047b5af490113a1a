"""CPU time of the pieces of a batched decoding step (``Transformer.step_rows`` + head) at 1, 2, 4, 8 rows.

Usage: ``.venv/bin/python benchmarks/serve/step_costs.py`` (1 thread, bundled model, bf16 + q4).
``time.thread_time`` rather than wall time: on a shared, loaded machine it still measures the work.
Output of the run quoted in BENCHMARKS.md ("Serving"): ``step_costs.out.txt``.
"""

# ruff: noqa: B023 (each timed closure runs inside its own loop iteration)

import json
import time

import torch

from m2r2.engine import Engine
from m2r2.model import attend

torch.set_num_threads(1)
eng = Engine(quiet=True)
m = eng.model
L = m.layers[0]


def tm(f, n=30):
    f()
    best = 1e9
    for _ in range(3):
        t = time.thread_time()
        for _ in range(n):
            f()
        best = min(best, (time.thread_time() - t) / n)
    return round(best * 1e3, 3)


out = {}
with torch.inference_mode():
    c = m.new_cache(300)
    m(torch.randint(0, 1000, (1, 200)), c, 0)
    k, v = c.view(0, 300)
    mask = m.causal_mask(200, 1, 300)
    out["attention_one_request_per_layer_ms"] = tm(
        lambda: attend(torch.randn(1, 9, 1, 64, dtype=torch.bfloat16), k, v, mask)
    )
    for M in (1, 2, 4, 8):
        x = torch.randn(M, 1, 576, dtype=torch.bfloat16)
        h = torch.randn(M, 1, 1536, dtype=torch.bfloat16)
        out[f"q4_linears_per_layer_{M}_rows_ms"] = tm(lambda: (L.attn.wqkv(x), L.attn.wo(x), L.mlp.w13(x), L.mlp.w2(h)))
        out[f"head_{M}_rows_ms"] = tm(lambda: m.head(x), 10)
    caches = []
    for i in range(8):
        cc = m.new_cache(300)
        m(torch.randint(0, 1000, (1, 150 + 10 * i)), cc, 0)
        caches.append(cc)
    for B in (1, 2, 4, 8):
        cs = caches[:B]

        def step():
            m.head(m.step_rows([5] * B, cs))
            for cc in cs:
                cc.truncate(cc.length - 1)

        ms = tm(step, 5)
        out[f"batched_step_{B}_ms"] = ms
        out[f"batched_step_{B}_tokens_per_cpu_s"] = round(1000 * B / ms, 1)
print(json.dumps(out, indent=1))
