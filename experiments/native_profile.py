"""A workload to run under Linux ``perf``: greedy answers (128 tokens) to MT-Bench first turns 2..N+1
after one warm-up answer, with one method. ``perf report`` then splits the native time by function
(kernels, row attention, the Python interpreter, its garbage collector). With ``--gc-ab`` it instead
times the same answers with Python's garbage collector on and off, alternating (off first in the second
pair: the later of two runs tends to be faster), in one process, and counts the collections that ran.

    perf record -F 1999 -o perf.data python experiments/native_profile.py m2r2 [--threads 1] [--prompts 7]
    perf report -i perf.data --comm python --sort dso,symbol --stdio
    python experiments/native_profile.py vanilla,m2r2 --gc-ab [--threads 2]
"""

import argparse
import gc
import time

from m2r2.bench.datasets import load_dataset
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine

p = argparse.ArgumentParser()
p.add_argument("methods", help="comma-separated methods")
p.add_argument("--threads", type=int, default=1)
p.add_argument("--prompts", type=int, default=7)
p.add_argument("--gc-ab", action="store_true")
args = p.parse_args()
engine = Engine(threads=args.threads, quiet=True)
prompts = load_dataset("mt_bench", args.prompts + 1).prompts
ids = [engine.tokenizer.encode_chat([{"role": "user", "content": q.turns[0]}]) for q in prompts]
gen = GenerationConfig(max_new_tokens=128)
methods = args.methods.split(",")
for method in methods:
    engine.generate_ids(ids[0], method, gen)  # warm-up (and the tree's cost measurement)


def answer_all(method: str) -> float:
    t = time.perf_counter()
    for x in ids[1:]:
        engine.generate_ids(x, method, gen)
    return time.perf_counter() - t


if not args.gc_ab:
    for method in methods:
        print(f"{method}: {answer_all(method):.2f} s")
else:
    collections = [0]
    gc.callbacks.append(lambda phase, info: collections.__setitem__(0, collections[0] + (phase == "start")))
    for method in methods:
        times: dict[bool, list[float]] = {True: [], False: []}
        for order in ((True, False), (False, True)):
            for enabled in order:
                (gc.enable if enabled else gc.disable)()
                times[enabled].append(answer_all(method))
            gc.enable()
        on, off = (" ".join(f"{s:.2f}" for s in times[k]) for k in (True, False))
        print(f"{method}: gc on {on} s, off {off} s; collections so far {collections[0]}")
