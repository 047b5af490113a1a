"""Time of one fast-stream draft step in its three forms, against one full decoding step.

Usage: ``.venv/bin/python experiments/draft_cost.py`` (1 thread, bundled model, q4, 200-token
context, median of 40 after 5 warm-ups). Forms: training form (base layers + low-rank deltas, full
LM head), folded layers with the full head, folded layers with the shipped 8k draft vocabulary.
Output of the run quoted in docs/TRAINING.md: ``draft_cost.out.txt``.
"""

import statistics
import time

import torch

from m2r2.engine import Engine
from m2r2.multirate.io import load_default


def median_ms(fn, n: int = 40) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


engine = Engine(threads=1, quiet=True)
model = engine.model
cache = model.new_cache(512)
with torch.inference_mode():
    model(torch.tensor([list(range(100, 300))]), cache, 0)
    n = cache.length
    tok = torch.tensor([[5]])
    full = median_ms(lambda: model(tok, cache, n))
    fast = load_default(model, engine.fingerprint)
    vocab = fast.draft_vocab
    fast.draft_vocab = None
    fast.freeze()
    a = median_ms(lambda: fast.draft_step(tok, cache, n))
    fast.freeze(merge=True)
    b = median_ms(lambda: fast.draft_step(tok, cache, n))
    fast.draft_vocab = vocab
    fast.freeze(merge=True)
    c = median_ms(lambda: fast.draft_step(tok, cache, n))
print(
    f"full step {full:.1f} ms; draft step: training form + full head {a:.1f} ({a / full:.2f}), "
    f"folded + full head {b:.1f} ({b / full:.2f}), folded + {len(vocab)}-token head {c:.1f} ({c / full:.2f})"
)
