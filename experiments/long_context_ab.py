"""End to end where contexts pass the AMX attention's threshold: `vanilla` and `m2r2` answer long prompts (an
assistant answer of 450-900 tokens from the training corpus, then "Summarize the text above in a few sentences.") with
the row attention's scores on AMX tiles for vectors that see the kernel's threshold of keys or more (448 since the
forty-first round, 512 before) and with the AVX-512 build alone, switching per prompt in alternating order, in one
process. Greedy, up to 128 new tokens, 2 threads. Prints tokens a second and m2r2's speedup for each, and checks that
`m2r2` gives `vanilla`'s tokens under each (lossless: one-row decoding and verify passes take the same path at every
position).

    python experiments/long_context_ab.py [PROMPTS]
"""

import json
import statistics
import sys
import time

from warmed import GEN

from m2r2 import amx
from m2r2.engine import Engine
from m2r2.paths import shipped_conversations

n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
engine = Engine(threads=2, quiet=True)
ext = amx.avx2_extension()
if ext is None or not ext.set_amx_attention(True):
    sys.exit("the AMX row attention does not run on this CPU (it needs AMX-BF16)")
least = ext.set_amx_attention_min_keys(1)  # the kernel's threshold (read by setting, then put back)
ext.set_amx_attention_min_keys(least)
prompts = []
with open(shipped_conversations()) as f:
    for line in f:
        text = next((m["content"] for m in json.loads(line)["messages"] if m["role"] == "assistant"), "")
        ids = engine.tokenizer.encode_chat(
            [{"role": "user", "content": text + "\n\nSummarize the text above in a few sentences."}]
        )
        if 450 <= len(ids) <= 900:
            prompts.append(ids)
        if len(prompts) == n + 1:
            break
for method in ("vanilla", "m2r2"):  # warm-up (and the tree's cost measurement)
    engine.generate_ids(prompts[0], method, GEN)
spent = {(on, m): 0.0 for on in (True, False) for m in ("vanilla", "m2r2")}
made = dict.fromkeys(spent, 0)
ratios: dict[bool, list[float]] = {True: [], False: []}
for i, ids in enumerate(prompts[1:]):
    for on in (True, False) if i % 2 == 0 else (False, True):
        ext.set_amx_attention(on)
        out, secs = {}, {}
        for m in ("vanilla", "m2r2"):
            t = time.perf_counter()
            out[m] = engine.generate_ids(ids, m, GEN).tokens
            secs[m] = time.perf_counter() - t
            spent[(on, m)] += secs[m]
            made[(on, m)] += len(out[m])
        assert out["m2r2"] == out["vanilla"], f"prompt {i}: m2r2 differs from vanilla (AMX {on})"
        ratios[on].append(secs["vanilla"] / secs["m2r2"] * len(out["m2r2"]) / len(out["vanilla"]))
ext.set_amx_attention(True)
print(f"{n} prompts of {min(map(len, prompts[1:]))}-{max(map(len, prompts[1:]))} tokens, up to 128 new, 2 threads")
print("| attention | vanilla tok/s | m2r2 tok/s | m2r2 speedup (median per prompt) | m2r2 = vanilla |")
print("|---|--:|--:|--:|---|")
for on in (False, True):
    v, m = (made[(on, k)] / spent[(on, k)] for k in ("vanilla", "m2r2"))
    name = f"AMX from {least} keys" if on else "AVX-512 only"
    print(f"| {name} | {v:.1f} | {m:.1f} | {statistics.median(ratios[on]):.3f} | every prompt |")
