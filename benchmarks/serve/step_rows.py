"""CPU time of one batched decoding step at B = 1, 2, 4, 8 requests, per kernel and thread count.

Usage: ``PYTHONPATH=src .venv/bin/python benchmarks/serve/step_rows.py [--kernels q4,mkldnn]
[--threads 1,2] [--rows 1,2,4,8] [--repeats 12] [--context 190] [--budget 64]``. Output of the runs
quoted in BENCHMARKS.md ("Serving"): ``step_rows.out.txt``.

Request b has a ``context + 3b``-token prompt and a 64-token budget. Three layouts of the same
requests are timed in turns within one process. The machine is shared, so the clock is
``time.thread_time`` (the calling thread's CPU time: time-slicing by other jobs does not count; with
2 threads the main thread works or spins through every parallel region, so it tracks the step's
duration), the layouts are interleaved to see the same load, and the fastest of ``--repeats``
rounds is kept (noise only adds):

* ``before``: what ``step_rows`` did before size classes: caches of exact capacity (prompt + budget
  + slack) and attention per request;
* ``pooled``: capacities rounded to a size class, caches lent by one pool (``Transformer.new_pool``,
  float32-stored on a CPU): one attention call per class over a view of its caches;
* ``stacked``: the same capacities in standalone caches: one attention call over a stacked copy.

Each cell is ``step_rows`` + the greedy head (``kernels.head_argmax``), in ms; ``x`` is aggregate
tokens/s relative to one request in the same layout.
"""

# ruff: noqa: B023 (each timed closure runs inside its own loop iteration)

import argparse
import time

import torch

import m2r2.model
from m2r2.decoding.base import CACHE_SLACK, cache_capacity
from m2r2.engine import Engine
from m2r2.kernels import head_argmax

p = argparse.ArgumentParser()
p.add_argument("--kernels", default="q4,mkldnn")
p.add_argument("--threads", default="1,2")
p.add_argument("--rows", default="1,2,4,8")
p.add_argument("--repeats", type=int, default=12)
p.add_argument("--context", type=int, default=190, help="prompt tokens of the first request (+3 per request)")
p.add_argument("--budget", type=int, default=64)
a = p.parse_args()
rows = [int(r) for r in a.rows.split(",")]
batched_exactly = m2r2.model.batches_requests_exactly
LAYOUTS = ("before", "pooled", "stacked")

print("| kernel | threads | B | " + " | ".join(f"{lay} ms | x" for lay in LAYOUTS) + " |")
print("|---|--:|--:|" + "--:|--:|" * len(LAYOUTS))
for kernel in a.kernels.split(","):
    eng = Engine(kernel=kernel, quiet=True)
    m = eng.model
    ctx = m.cfg.max_position_embeddings
    pool = m.new_pool(max(rows))
    g = torch.Generator().manual_seed(0)
    caches: dict[str, list] = {lay: [] for lay in LAYOUTS}
    with torch.inference_mode():
        for i in range(max(rows)):
            n = a.context + 3 * i
            prompt = torch.randint(0, 40000, (1, n), generator=g)
            cap = cache_capacity(n, a.budget, ctx)
            for lay, c in (
                ("before", m.new_cache(n + a.budget + CACHE_SLACK)),
                ("pooled", pool.take(cap)),
                ("stacked", m.new_cache(cap)),
            ):
                m(prompt, c, 0)
                caches[lay].append(c)
        for threads in (int(t) for t in a.threads.split(",")):
            torch.set_num_threads(threads)
            base: dict[str, float] = {}
            for b in rows:

                def step(lay: str) -> None:
                    cs = caches[lay][:b]
                    alone = lay == "before"
                    m2r2.model.batches_requests_exactly = (lambda *_: False) if alone else batched_exactly
                    head_argmax(m, m.step_rows([5] * b, cs)[:, 0])
                    for c in cs:
                        c.truncate(c.length - 1)

                best = {lay: float("inf") for lay in LAYOUTS}
                for lay in LAYOUTS:
                    step(lay)  # warm-up
                for _ in range(a.repeats):
                    for lay in LAYOUTS:
                        t = time.thread_time()
                        step(lay)
                        best[lay] = min(best[lay], 1e3 * (time.thread_time() - t))
                cells = []
                for lay in LAYOUTS:
                    base.setdefault(lay, best[lay])
                    cells.append(f"{best[lay]:.1f} | {b * base[lay] / best[lay]:.2f}x")
                print(f"| {kernel} | {threads} | {b} | " + " | ".join(cells) + " |", flush=True)
