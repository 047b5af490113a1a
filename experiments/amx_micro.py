"""Microbenchmarks of the C++ kernels against what they replace, 1 thread, interleaved, median µs.

    python experiments/amx_micro.py

Layers: SmolLM2-135M's layer shapes (in x out) with random Q4_1-grid weights, ``q4`` (torch's int4
kernel, :class:`Int4Linear`) against ``q4-amx`` (:class:`AmxInt4Linear`) at 1-16 rows. Attention:
SmolLM2's heads (9 query over 3 key heads, 64 dims) over 300 keys of a 700-slot bfloat16 cache, the
C++ row attention (reading the cache in place) against the float32 matmuls (:func:`m2r2.model._row_math`,
given the filled slots widened to float32) for 1-16 rows. Output of the runs quoted in BENCHMARKS.md
("Sixth round", "Seventh round"): ``amx_micro.out.txt``.
"""

import statistics
import time

import torch

from m2r2 import amx
from m2r2.kernels import AmxInt4Linear, Int4Linear
from m2r2.model import _row_math

torch.set_num_threads(1)


def median_us(fns: dict, n: int = 300) -> dict[str, float]:
    """Median time of each callable, calls interleaved so machine noise hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(n + 20):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            if i >= 20:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) * 1e6 for name, ts in times.items()}


g = torch.Generator().manual_seed(0)
for k, n in [(576, 960), (576, 576), (576, 3072), (1536, 576)]:
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    d = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = (q * d - 8 * d).view(n, k)
    layers = {"q4": Int4Linear(lin), "q4-amx": AmxInt4Linear(lin)}
    cells = []
    for rows in (1, 4, 8, 16):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        t = median_us({name: (lambda layer=layer, x=x: layer(x)) for name, layer in layers.items()})
        cells.append(f"{rows} rows {t['q4']:.0f}/{t['q4-amx']:.0f}")
    print(f"layer {k}x{n} (q4/q4-amx us): " + ", ".join(cells))

ext = amx.extension()
# a decoding cache as the model keeps it: bfloat16, 700 slots, 300 of them filled
slots, s, prefix = 700, 300, 280
cache_k = torch.randn(1, 3, slots, 64, generator=g).to(torch.bfloat16)
cache_v = torch.randn(1, 3, slots, 64, generator=g).to(torch.bfloat16)
for rows in (1, 4, 8, 16):
    qh = torch.randn(1, 9, rows, 64, generator=g).to(torch.bfloat16)
    mask = torch.arange(slots)[None, :] <= torch.arange(prefix, prefix + rows)[:, None]
    t = median_us(
        {
            "C++": lambda qh=qh, mask=mask: ext.row_attention(qh.float(), cache_k, cache_v, mask[None], 0.125),
            "py": lambda qh=qh, mask=mask: _row_math(
                qh, cache_k[:, :, :s].float(), cache_v[:, :, :s].float(), mask[:, :s], True
            ),
        }
    )
    print(f"attention {rows} row(s), 300 keys: C++ {t['C++']:.0f} us, float32 matmuls {t['py']:.0f} us")
