"""A prompt's prefill by length, on AMX-BF16 tiles against the int8 loops: wall clock (median of 5, a fresh cache each)
and how far the last position's logits land from the float32 reference model's.

    python experiments/prefill_sizes.py [THREADS]

Random prompts of 33-300 tokens (prompts of 32 tokens or fewer keep the int8 loops: a verify pass's length).
"""

import statistics
import sys
import time

import torch

from m2r2 import amx
from m2r2.engine import Engine

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
model = Engine(None, threads=threads, quiet=True).model
reference = Engine(None, dtype="fp32", threads=threads, quiet=True).model
ext = amx.avx2_extension()
if ext is None or not ext.set_bf16_prefill(True):
    sys.exit("the prefill's AMX-BF16 tiles do not run here")
torch.manual_seed(0)
print(f"# {threads} thread(s); ms: median of 5 prefills; |logit - fp32|: largest over the vocabulary, last position")
for n in (33, 40, 71, 150, 300):
    tokens = torch.randint(100, 20000, (1, n))
    with torch.no_grad():
        want = reference(tokens, reference.new_cache(512), 0, last_only=True).float()
    row = [f"{n} tokens:"]
    for on, name in ((False, "int8 loops"), (True, "tiles")):
        ext.set_bf16_prefill(on)
        seconds = []
        for _ in range(5):
            cache = model.new_cache(512)
            t = time.perf_counter()
            with torch.no_grad():
                logits = model(tokens, cache, 0, last_only=True).float()
            seconds.append(time.perf_counter() - t)
        gap = (logits - want).abs().max().item()
        row.append(f"{name} {1000 * statistics.median(seconds):.1f} ms, |logit - fp32| {gap:.3f};")
    ext.set_bf16_prefill(True)
    print(" ".join(row))
