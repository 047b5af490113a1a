"""Does a prefill on AMX-BF16 tiles change how many tokens `m2r2`'s verify passes accept? A count, no clock.

    python experiments/prefill_copies.py [PROMPTS_PER_DATASET] [THREADS]

Why: the tiles give a prompt's cache other last bits than the int8 loops, and a small model's greedy answers part at
the first near tie, so under each setting `m2r2` answers (identically to `vanilla`, tested) with other text, which
its copies may find more or less often. Per dataset and setting: `m2r2`'s tokens per verify pass over all answers
(MT-Bench with both turns, the second over the carried cache as the bench runs it), how many answers are the same
under both settings, and the mean answer length. Two settings of one kernel change nothing but the prefill.
"""

import sys

from m2r2 import amx
from m2r2.bench.datasets import load_dataset
from m2r2.cache import Conversation
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine

per_set = int(sys.argv[1]) if len(sys.argv) > 1 else 0
engine = Engine(threads=int(sys.argv[2]) if len(sys.argv) > 2 else 2, quiet=True)
ext = amx.avx2_extension()
if ext is None or not ext.set_bf16_prefill(True):
    sys.exit("the prefill's AMX-BF16 tiles do not run here")
GEN = GenerationConfig(max_new_tokens=128)
print(f"# m2r2, 128 new tokens a turn, {per_set or 'all'} prompts a dataset")
totals = {True: [0, 0], False: [0, 0]}
for dataset in ("mt_bench", "koala", "self_instruct", "wizardlm"):
    answers: dict[bool, list[list[int]]] = {True: [], False: []}
    counts = {True: [0, 0], False: [0, 0]}  # tokens, verify passes
    for prompt in load_dataset(dataset, per_set).prompts:
        for on in (True, False):
            ext.set_bf16_prefill(on)
            session, messages = Conversation(), []
            for turn in prompt.turns:
                messages.append({"role": "user", "content": turn})
                out = engine.chat(messages, method="m2r2", gen=GEN, session=session)
                messages.append({"role": "assistant", "content": out.text})
                answers[on].append(out.result.tokens)
                for c in (counts[on], totals[on]):
                    c[0] += len(out.result.tokens)
                    c[1] += out.result.stats["verify_passes"]
    ext.set_bf16_prefill(True)
    same = sum(a == b for a, b in zip(answers[True], answers[False], strict=True))
    n = len(answers[True])
    print(
        f"{dataset}: {n} answers, {same} the same under both; tokens a pass {counts[True][0] / counts[True][1]:.3f} on "
        f"the tiles, {counts[False][0] / counts[False][1]:.3f} on the int8 loops; mean answer "
        f"{counts[True][0] / n:.1f} / {counts[False][0] / n:.1f} tokens"
    )
print(f"all: tokens a pass {totals[True][0] / totals[True][1]:.3f} / {totals[False][0] / totals[False][1]:.3f}")
