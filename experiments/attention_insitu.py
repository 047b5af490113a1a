"""What the row attention costs inside a real pass of the layers, with its AVX-512 build (csrc_avx2/attend_avx512.cpp)
off and on: the bundled model's 30 blocks over T rows after a real context of CTX tokens, once with the mask showing
the whole context (as decoding and verification run them) and once showing only slot 0 and the rows themselves (the
same pass with almost no attention); their difference is the attention's share. Off and on alternate, each timing the
median of 50 passes; the context is a MT-Bench prompt repeated to CTX tokens.

    python experiments/attention_insitu.py [THREADS] [CTX ...]
"""

import statistics
import sys
import time

import torch
from warmed import filled_context, warmed_first_turns

from m2r2 import amx

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
contexts = [int(a) for a in sys.argv[2:]] or [250, 500]
engine, ids = warmed_first_turns(2, threads)
ext = amx.avx2_extension()
if not ext.set_avx512_attention(True):
    sys.exit("the AVX-512 row attention does not run on this CPU (it needs AVX512-BF16)")
model = engine.model


def median_ms(x, cache, pos, positions, mask, n: int = 50) -> float:
    """The median of n passes of the layers over rows x at cache slots pos.. under mask."""
    times = []
    for _ in range(n + 5):
        t = time.perf_counter()
        model.run_layers(x, cache, pos, positions=positions, mask=mask)
        times.append(time.perf_counter() - t)
    return statistics.median(times[5:]) * 1e3


print(f"{engine.kernel} kernel, {threads} thread(s); ms per pass of the 30 blocks (medians of 50)")
print("| context | rows | whole pass, off / on | attention (whole - rows only), off / on |")
print("|--:|--:|---|---|")
with torch.no_grad():
    for ctx in contexts:
        cache, toks = filled_context(model, ids[0], ctx)
        for T in (1, 2, 4, 8):
            x = model.embed_tokens(toks[:, :T])
            positions = torch.arange(ctx, ctx + T)
            whole = torch.ones(T, ctx + T, dtype=torch.bool).tril(ctx)
            rows_only = whole.clone()
            rows_only[:, 1:ctx] = False
            got: dict[bool, list[tuple[float, float]]] = {}
            for wide in (False, True, False, True):
                ext.set_avx512_attention(wide)
                a = median_ms(x, cache, ctx, positions, whole)
                b = median_ms(x, cache, ctx, positions, rows_only)
                got.setdefault(wide, []).append((a, a - b))
            off, on = min(got[False]), min(got[True])  # the faster of each arm's two turns
            print(f"| {ctx} | {T} | {off[0]:.2f} / {on[0]:.2f} | {off[1]:.2f} / {on[1]:.2f} |")
ext.set_avx512_attention(True)
