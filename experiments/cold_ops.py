"""What a small op costs right after a pass of the layers, against the same op warm: an embedding of 3 rows, the
final norm of 3 rows, the argmax of 3 rows of logits and a 3-token id tensor, each timed (a) in a tight loop and
(b) as the first op after a one-row pass of the 30 layers at a 200-token context, medians of 200, THREADS threads.
Why: a pass streams ~50 MB of 4-bit weights (and the head ~28 MB) through the cores' caches, so the interpreter's
and torch's own code and data come back from further away for each op that follows. This is what
`Transformer.greedy_pass` takes out of a greedy step (`experiments/greedy_pass_ab.py` times that in generation).

    python experiments/cold_ops.py [THREADS]
"""

import statistics
import sys
import time

import torch
from warmed import filled_context

from m2r2.engine import Engine
from m2r2.kernels import argmax_rows
from m2r2.machine import cpu_name

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
engine = Engine(threads=threads, quiet=True)
model = engine.model
prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Explain why the sky is blue in three sentences."}])
ctx = 200
cache, _ = filled_context(model, prompt, ctx)
ids = torch.tensor([[5, 6, 7]])
with torch.inference_mode():
    h = model.embed_tokens(ids)
    logits = model.lm_head(model.norm(h))
ops = {
    "embedding, 3 rows": lambda: model.embed_tokens(ids),
    "final norm, 3 rows": lambda: model.norm(h),
    "argmax, 3 rows of 49k": lambda: argmax_rows(logits),
    "id tensor, 3 tokens": lambda: torch.tensor([[5, 6, 7]]),
}
one = model.embed_tokens(torch.tensor([[5]]))
print(f"{cpu_name()}, {engine.kernel}, {threads} thread(s); us, medians of 200")
print("| op | warm | right after a pass of the layers | ratio |")
print("|---|--:|--:|--:|")
with torch.inference_mode():
    for name, op in ops.items():
        warm, cold = [], []
        for i in range(220):
            op()
            t = time.perf_counter()
            op()
            w = time.perf_counter() - t
            model.run_layers(one, cache, ctx)
            t = time.perf_counter()
            op()
            c = time.perf_counter() - t
            if i >= 20:
                warm.append(w)
                cold.append(c)
        a, b = statistics.median(warm) * 1e6, statistics.median(cold) * 1e6
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.1f}x |")
