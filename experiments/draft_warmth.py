"""What a draft call costs in situ against the same call run again at once (its weights then warm): inside real
greedy generation (MT-Bench first turns 2-16, ``draft=always``, after a warm-up), every whole-tree draft call
(``SeededFastStream.draft_tree_fused``) is timed, then run twice more on the same inputs (it writes the same fast
K/V into the same free cache slots, so the answer is unchanged). The gap is what a prefetch of the draft weights
during the round's Python work could save at most. The bundled model unless M2R2_MODEL names another.

    python experiments/draft_warmth.py [THREADS]
"""

import statistics
import sys
import time

from warmed import GEN, warmed_first_turns

from m2r2.multirate import seeded

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
engine, ids = warmed_first_turns(16, threads)
one_call = seeded.SeededFastStream.draft_tree_fused
calls: list[tuple[float, float, float, int]] = []  # in situ, again, a third time (seconds); nodes


def timed_call(self, *args, **kwargs):
    times, out = [], None
    for _ in range(3):
        t = time.perf_counter()
        got = one_call(self, *args, **kwargs)
        times.append(time.perf_counter() - t)
        out = got if out is None else out
    calls.append((*times, len(out[0]) if out else 0))
    return out


t0, n = time.perf_counter(), 0
for prompt in ids[1:6]:
    n += len(engine.generate_ids(prompt, "vanilla", GEN).tokens)
step = (time.perf_counter() - t0) / n
seeded.SeededFastStream.draft_tree_fused = timed_call
for prompt in ids[1:]:
    engine.generate_ids(prompt, "m2r2", GEN, draft="always")


def ms(xs) -> str:
    return f"{statistics.median(xs) * 1e3:.3f}"


print(f"{engine.kernel} kernel, {threads} thread(s): vanilla {step * 1e3:.3f} ms a token; {len(calls)} draft calls")
print("| nodes | calls | in situ ms | again ms | a third time ms |")
print("|--:|--:|--:|--:|--:|")
groups = [("all", calls)] + [(str(k), [c for c in calls if c[3] == k]) for k in sorted({c[3] for c in calls})]
for label, group in groups:
    print(f"| {label} | {len(group)} | " + " | ".join(ms([c[i] for c in group]) for i in range(3)) + " |")
