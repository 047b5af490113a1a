"""One-token step with the KV cache stored in bf16 (converted to float32 by every layer's attention)
against a float32 store (read as is), interleaved in one process; also checks the two give the same
bits (the float32 store holds the bf16 values exactly).

    python experiments/cache_store.py --threads 1 --kernel q4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from m2r2.cache import KVCache
from m2r2.engine import Engine
from m2r2.kernels import head_argmax
from m2r2.machine import cpu_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernel", default="q4")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    e = Engine(kernel=args.kernel, threads=args.threads, quiet=True)
    m = e.model
    cap = args.context + 56
    caches = {
        "bf16 store": KVCache(m.cfg, cap, dtype=m.dtype, device=m.device),
        "float32 store": KVCache(m.cfg, cap, dtype=m.dtype, device=m.device, store=torch.float32),
    }
    ids = torch.arange(args.context)[None] % m.cfg.vocab_size
    times: dict[str, list[float]] = {k: [] for k in caches}
    outs = {}
    with torch.inference_mode():
        for c in caches.values():
            m(ids, c, 0)
        for rep in range(args.repeats + 1):
            for name, c in caches.items():
                t = time.perf_counter()
                h = m.run_layers(m.embed_tokens(torch.full((1, 1), 7)), c, args.context)
                head_argmax(m, h)
                outs[name] = h
                if rep:
                    times[name].append(time.perf_counter() - t)
    same = torch.equal(outs["bf16 store"], outs["float32 store"])
    print(f"{cpu_name()}, {args.threads} thread(s), kernel {args.kernel}, context {args.context}")
    base = statistics.median(times["bf16 store"])
    for name, ts in times.items():
        print(f"{name}: {1e3 * statistics.median(ts):.1f} ms per step ({statistics.median(ts) / base:.2f}x)")
    print("same final states, bit for bit:", same)


if __name__ == "__main__":
    main()
