"""The prompt's prefill on AMX-BF16 tiles (`csrc_avx2/prefill_amx.cpp`) against the int8 loops, end to end: what it
does to time to first token and to `m2r2`'s speedup over `vanilla`, on the paper's four datasets (first turns).

    python experiments/prefill_ab.py [PROMPTS_PER_DATASET] [THREADS]    (M2R2_MODEL=qwen2.5-coder-0.5b: another model)

Why a script and not `m2r2 bench`: the prefill's kernel is a process-wide switch (every method must prefill alike
for their outputs to be identical), while the bench compares methods side by side under one setting. Here each
prompt runs `vanilla` and `m2r2` under both settings, the settings' order alternating from prompt to prompt, after a
warm-up; per prompt and setting, the speedup is `vanilla`'s seconds over `m2r2`'s (the whole answer: prefill,
128 new tokens at most, stopping), and the paired ratio of the two settings' speedups gets the sign test's 95%
interval (m2r2.bench.intervals). Also timed alone: the prefill (a 1-token answer) of each prompt under each setting.
Outputs must be identical between methods under each setting (checked); between the settings they differ (a prompt's
cache gets other last bits, and greedy answers part at a near tie), so `m2r2`'s tokens per verify pass, a count, are
given for each setting too.
"""

import os
import statistics
import sys
import time

from m2r2 import amx
from m2r2.bench.datasets import load_dataset
from m2r2.bench.intervals import median_interval
from m2r2.decoding.base import GenerationConfig, GenerationResult
from m2r2.engine import Engine

per_set = int(sys.argv[1]) if len(sys.argv) > 1 else 20
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine = Engine(os.environ.get("M2R2_MODEL") or None, threads=threads, quiet=True)
ext = amx.avx2_extension()
if ext is None or not ext.set_bf16_prefill(True):
    sys.exit("the prefill's AMX-BF16 tiles do not run here")
GEN, FIRST = GenerationConfig(max_new_tokens=128), GenerationConfig(max_new_tokens=1)


def answer(ids: list[int], method: str, gen: GenerationConfig) -> tuple[float, GenerationResult]:
    t = time.perf_counter()
    result = engine.generate_ids(ids, method, gen)
    return time.perf_counter() - t, result


def show(name: str, values: list[float]) -> str:
    ci = median_interval(values)
    return f"{name} {statistics.median(values):.3f}" + (f" ({ci[0]:.3f}-{ci[1]:.3f})" if ci else "")


warm = load_dataset("mt_bench", 1).prompts[0]
for on in (True, False):
    ext.set_bf16_prefill(on)
    for method in ("vanilla", "m2r2"):
        answer(engine.tokenizer.encode_chat([{"role": "user", "content": warm.turns[0]}]), method, GEN)
print(f"# {threads} thread(s), {per_set} first turns a dataset, 128 new tokens at most")
for dataset in ("mt_bench", "koala", "self_instruct", "wizardlm"):
    speed: dict[bool, list[float]] = {True: [], False: []}
    first: dict[bool, list[float]] = {True: [], False: []}
    tally = {True: [0, 0], False: [0, 0]}  # m2r2's tokens, verify passes
    lengths, same = [], True
    for i, prompt in enumerate(load_dataset(dataset, per_set).prompts):
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt.turns[0]}])
        lengths.append(len(ids))
        for on in (True, False) if i % 2 == 0 else (False, True):
            ext.set_bf16_prefill(on)
            first[on].append(answer(ids, "vanilla", FIRST)[0])
            (tv, out_v), (tm, out_m) = answer(ids, "vanilla", GEN), answer(ids, "m2r2", GEN)
            speed[on].append(tv / tm)
            same &= out_v.tokens == out_m.tokens
            tally[on][0] += len(out_m.tokens)
            tally[on][1] += out_m.stats["verify_passes"]
    ext.set_bf16_prefill(True)
    paired = [a / b for a, b in zip(speed[True], speed[False], strict=True)]
    ttft = [b / a for a, b in zip(first[True], first[False], strict=True)]
    ms = {on: 1000 * statistics.median(first[on]) for on in (True, False)}
    per_pass = {on: tally[on][0] / tally[on][1] for on in (True, False)}
    print(
        f"{dataset}: prompts of {statistics.median(lengths):.0f} tokens (median); time to first token "
        f"{ms[True]:.1f} ms on the tiles, {ms[False]:.1f} ms on the int8 loops ({show('int8 / tiles', ttft)}); "
        f"m2r2 speedup {show('tiles', speed[True])}, {show('int8', speed[False])}; "
        f"{show('paired tiles / int8', paired)}; m2r2 tokens a pass {per_pass[True]:.3f} / {per_pass[False]:.3f}; "
        f"methods' outputs identical: {same}"
    )
