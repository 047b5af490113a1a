"""A greedy step or verify pass as one C++ call (`Transformer.greedy_pass`: embeddings, blocks, norm, head, argmax)
against the op-by-op path it replaces, inside real generation: MT-Bench first turns answered by `vanilla` and `m2r2`
with the fused pass on and off (`m2r2.model.GREEDY_PASS`), the four runs of a prompt back to back in rotated order,
after a warm-up. Prints, per method, the answers' total seconds both ways, the median of per-answer time ratios
(on / off) with its 95% interval, and whether every answer's tokens were the same both ways; then `m2r2`'s speedup
over `vanilla` both ways (median of per-prompt ratios).

    python experiments/greedy_pass_ab.py [PROMPTS] [THREADS]
"""

import statistics
import sys
import time

from warmed import GEN, warmed_first_turns

import m2r2.model as model_mod
from m2r2.bench.intervals import median_interval

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 20
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine, ids = warmed_first_turns(n_prompts + 1, threads)
arms = [(m, on) for m in ("vanilla", "m2r2") for on in (True, False)]
seconds = {arm: [] for arm in arms}
same = {m: True for m in ("vanilla", "m2r2")}
for i, prompt in enumerate(ids[1:]):
    tokens = {}
    for arm in arms[i % 4 :] + arms[: i % 4]:
        model_mod.GREEDY_PASS = arm[1]
        t = time.perf_counter()
        r = engine.generate_ids(prompt, arm[0], GEN)
        seconds[arm].append(time.perf_counter() - t)
        tokens[arm] = r.tokens
    for m in same:
        same[m] &= tokens[(m, True)] == tokens[(m, False)]
model_mod.GREEDY_PASS = True
print(f"{engine.kernel} kernel, {threads} thread(s), MT-Bench first turns 2..{n_prompts + 1}")
for m in same:
    on, off = seconds[(m, True)], seconds[(m, False)]
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    lo, hi = median_interval(ratios)
    print(
        f"{m}: {sum(on):.2f} s fused, {sum(off):.2f} s op by op; time ratio median {statistics.median(ratios):.3f} "
        f"({lo:.3f}-{hi:.3f}); same tokens: {same[m]}"
    )
for on in (True, False):
    speed = [v / s for v, s in zip(seconds[("vanilla", on)], seconds[("m2r2", on)], strict=True)]
    print(f"m2r2 over vanilla, {'fused' if on else 'op by op'}: median {statistics.median(speed):.3f}x")
