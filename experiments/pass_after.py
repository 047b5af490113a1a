"""What a one-row pass costs right after what came before it: `vanilla`'s real greedy steps on MT-Bench first turns,
each step preceded by one of these (the same for a whole answer; the kinds take turns answer by answer), and only the
step's own C++ call (`greedy_pass`) timed:

- ``back to back``: nothing, as `vanilla` runs (the previous step ended ~0.1 ms before);
- ``after a K-row pass``: a greedy pass of K rows over another 200-token cache (the same weights, other keys), as a
  `m2r2` round's one-row pass follows its last round's verify pass;
- ``after X ms of Python``: the interpreter spinning on the clock, no memory traffic to speak of;
- ``after X ms asleep``: ``time.sleep``.

Why: `m2r2`'s one-row passes took ~0.2 ms longer than `vanilla`'s in the same run, at the same cache capacity (the
second table). A verify pass of K rows costs more than its own time: the pass after it is slower too, as after any
gap of the same length.

Then, in real generation, what each method's passes cost by their rows (the same answers, methods taking turns
prompt by prompt): `vanilla`, `m2r2`, and `m2r2` without the answer store (``answers=none``: fewer of its rounds
verify several rows).

    python experiments/pass_after.py [PROMPTS] [THREADS]
"""

import collections
import sys
import time

import torch
from warmed import GEN, warmed_first_turns

from m2r2 import amx
from m2r2.cache import KVCache
from m2r2.model import Transformer

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 10
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
KINDS = ["back to back", *(f"after a {k}-row pass" for k in (1, 2, 4, 8, 16))]
KINDS += [f"after {x} ms of Python" for x in (0.3, 1, 4)] + ["after 1 ms asleep"]

engine, ids = warmed_first_turns(n_prompts, threads, 1)
model, ext = engine.model, amx.avx2_extension()
other = KVCache(model.cfg, 400, dtype=torch.bfloat16)
with torch.no_grad():
    model.run_layers(model.embed_tokens(torch.tensor([(ids[0] * 4)[:200]])), other, 0)

call = ext.greedy_pass
last_call = [0.0]


def timed_call(*args):
    t = time.perf_counter()
    out = call(*args)
    last_call[0] = time.perf_counter() - t
    return out


ext.greedy_pass = timed_call
step = Transformer.greedy_pass
spent: dict[str, list[float]] = collections.defaultdict(list)
kind = [KINDS[0]]


def before_then_step(self, tokens, cache, *args, **kwargs):
    what = kind[0]
    if what.startswith("after a "):
        step(self, [1] * int(what.split()[2].split("-")[0]), other, 200)
    elif what.endswith("of Python"):
        t = time.perf_counter()
        while time.perf_counter() - t < float(what.split()[1]) * 1e-3:
            pass
    elif what.endswith("asleep"):
        time.sleep(float(what.split()[1]) * 1e-3)
    out = step(self, tokens, cache, *args, **kwargs)
    spent[what].append(last_call[0])
    return out


Transformer.greedy_pass = before_then_step
for prompt in ids:
    for what in KINDS:
        kind[0] = what
        engine.generate_ids(prompt, "vanilla", GEN)

base = sum(spent[KINDS[0]]) / len(spent[KINDS[0]])
print(f"{engine.kernel} kernel, {threads} thread(s), MT-Bench first turns 2..{n_prompts + 1}, `vanilla`'s steps")
print("| a one-row step's C++ call, right ... | steps | mean ms | against back to back |")
print("|---|--:|--:|--:|")
for what in KINDS:
    mean = sum(spent[what]) / len(spent[what])
    print(
        f"| {what} | {len(spent[what])} | {1000 * mean:.3f} | {1000 * (mean - base):+.3f} ms |".replace(
            "| +0.000 ms", "| -"
        )
    )

Transformer.greedy_pass = step
by_rows: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
arm = [""]


def timed_step(self, tokens, cache, *args, **kwargs):
    out = step(self, tokens, cache, *args, **kwargs)
    by_rows[(arm[0], len(tokens))].append(last_call[0])
    return out


Transformer.greedy_pass = timed_step
ARMS = {"vanilla": ("vanilla", {}), "m2r2": ("m2r2", {}), "m2r2, answers=none": ("m2r2", {"answers": "none"})}
for prompt in ids:
    for name, (method, options) in ARMS.items():
        arm[0] = name
        engine.generate_ids(prompt, method, GEN, **options)
print()
print("| method | pass rows | passes | mean ms of the C++ call |")
print("|---|--:|--:|--:|")
for (name, rows), times in sorted(by_rows.items(), key=lambda kv: (list(ARMS).index(kv[0][0]), kv[0][1])):
    if rows <= 4:
        print(f"| {name} | {rows} | {len(times)} | {1000 * sum(times) / len(times):.3f} |")
