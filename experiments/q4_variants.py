"""Two builds of the q4-avx2 kernel side by side in one process, on the same weights: the default one and
one compiled with a variant's macro (``--define``; e.g. ``M2R2_PREFETCH=8192``). The eighteenth round's
``M2R2_Q4_FIRST_LINE=1`` (each group's 16-bit sums started by its first line's products, 7 adds a row
instead of 8; not kept) exists in the kernel at commit 68ff939, where its ``.out.txt`` runs were made.
Separate processes are no fair judge here: timings of one build moved by 10-20% between processes (where
the weights land in memory), more than such a change.

Times ``q4_linear_avx2`` on a 576 x 262,144 4-bit weight (92 MB with its scales, about what a SmolLM2
step reads) for 1-8 rows, the two builds alternating call by call, and checks that both give the same bits.

    python experiments/q4_variants.py --define MACRO=VALUE [--threads N] [--repeats 21]
"""

import argparse
import statistics
import time

import torch

from m2r2 import amx
from m2r2.machine import cpu_name

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=1)
p.add_argument("--define", required=True, help="the variant's macro, MACRO=VALUE")
p.add_argument("--repeats", type=int, default=21)
args = p.parse_args()
torch.set_num_threads(args.threads)
current = amx.avx2_extension()
variant = amx._build("q4_avx2_variant", amx.AVX2_SOURCES, amx.AVX2_HEADERS, [*amx.AVX2_FLAGS, f"-D{args.define}"])
assert current is not None and variant is not None, "the AVX2 build does not run here"

K, N = 576, 256 * 1024
torch.manual_seed(0)
qbytes = torch.randint(0, 256, (N // 8, K // 8, 32), dtype=torch.uint8)
scales = (torch.rand(N // 8, K // 32, 2, 8) * 0.01).half()
print(f"{cpu_name()}, {args.threads} thread(s); variant: -D{args.define}; medians of {args.repeats} calls")
print("| rows | default ms | variant ms | variant / default |")
print("|--:|--:|--:|--:|")
for rows in (1, 2, 3, 4, 6, 8):
    x = torch.randn(rows, K).bfloat16()
    assert torch.equal(current.q4_linear_avx2(x, qbytes, scales), variant.q4_linear_avx2(x, qbytes, scales)), (
        "bits differ"
    )
    times: dict[str, list[float]] = {"variant": [], "current": []}
    for _ in range(args.repeats):
        for name, ext in (("variant", variant), ("current", current)):
            t = time.perf_counter()
            ext.q4_linear_avx2(x, qbytes, scales)
            times[name].append(time.perf_counter() - t)
    v, c = (statistics.median(times[k]) * 1e3 for k in ("variant", "current"))
    print(f"| {rows} | {c:.2f} | {v:.2f} | {v / c:.3f} |")
