"""Verify-pass cost v(k) per kernel: a greedy slow pass over k rows relative to a one-token step.

For each kernel: the pass as the tree verifier runs it (layers, then the certified one-pass head
argmax) and, for comparison, with the head run row by row (what exact per-row logits cost, e.g.
for sampling). Medians of interleaved repeats after a 200-token context (``--context``: several, each its own rows;
the rows' attention is what grows with it), 1 warm-up.

    python experiments/verify_cost.py --kernels q4,mkldnn --rows 1,2,3,4,6,8,12,16 --threads 2 [--context 64,400]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from m2r2.engine import Engine
from m2r2.kernels import head_argmax
from m2r2.machine import cpu_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="q4,mkldnn")
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--context", default="200", help="cached tokens before the rows, comma-separated")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{cpu_name()}, {torch.get_num_threads() if args.threads is None else args.threads} threads")
    print("| kernel | context | one-token step (ms) | " + " | ".join(f"v({k})" for k in rows) + " |")
    print("|---|--:|---|" + "---|" * len(rows))
    for kernel in args.kernels.split(","):
        e = Engine(kernel=kernel, threads=args.threads, quiet=True)
        for ctx in (int(c) for c in args.context.split(",")):
            _one_context(e.model, kernel, ctx, rows, args.repeats)


def _one_context(m, kernel: str, ctx: int, rows: list[int], repeats: int) -> None:
    """One kernel's table row pair after ``ctx`` cached tokens."""
    cache = m.new_cache(ctx + max(rows) + 1)
    times: dict[tuple[int, str], list[float]] = {}
    with torch.inference_mode():
        m(torch.arange(ctx)[None] % m.cfg.vocab_size, cache, 0)
        for rep in range(repeats + 1):
            for k in rows:
                for how in ("certified", "row-by-row"):
                    block = torch.full((1, k), 7)
                    t = time.perf_counter()
                    h = m.run_layers(m.embed_tokens(block), cache, ctx)
                    head_argmax(m, h) if how == "certified" else m.head(h).argmax(-1)
                    if rep:
                        times.setdefault((k, how), []).append(time.perf_counter() - t)
    one = statistics.median(times[(1, "certified")])
    for how in ("certified", "row-by-row"):
        cells = " | ".join(f"{statistics.median(times[(k, how)]) / one:.2f}" for k in rows)
        print(f"| {kernel} ({how} head) | {ctx} | {one * 1000:.1f} | {cells} |")


if __name__ == "__main__":
    main()
