"""What carrying a conversation's KV cache between turns saves: MT-Bench conversations (both turns)
answered by each method with every turn prefilled in full (``fresh``) and with the earlier turn's cache
carried (``reuse``, the bench's default), interleaved prompt by prompt in one process (1 thread, after a
warm-up). Prints per method and mode the total seconds, the second turns' prompt and reused tokens,
and each method's median per-prompt ratio to vanilla in the same mode.

    python experiments/turn_reuse.py [PROMPTS] [METHODS]
"""

import statistics
import sys

from m2r2.bench.datasets import load_dataset
from m2r2.bench.harness import answer
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 20
methods = sys.argv[2].split(",") if len(sys.argv) > 2 else ["vanilla", "m2r2"]
engine = Engine(threads=1, quiet=True)
prompts = load_dataset("mt_bench", n_prompts + 1).prompts
gen = GenerationConfig(max_new_tokens=128)
modes = {"fresh": True, "reuse": False}
for m in methods:
    for fresh in modes.values():
        answer(engine, prompts[0], m, gen, fresh_turns=fresh)  # warm-up (and the trees' cost measurement)

runs: dict[tuple[str, str], list[dict]] = {(m, mode): [] for m in methods for mode in modes}
for i, p in enumerate(prompts[1:]):
    order = [(m, mode) for m in methods for mode in modes]
    for m, mode in order[i % len(order) :] + order[: i % len(order)]:  # rotated, as the bench does
        runs[(m, mode)].append(answer(engine, p, m, gen, fresh_turns=modes[mode]))

print(f"{engine.kernel} kernel, 1 thread, MT-Bench prompts 2..{n_prompts + 1}, both turns, 128 tokens a turn")
for mode in modes:
    base = runs[("vanilla", mode)]
    for m in methods:
        rs = runs[(m, mode)]
        same = sum(r["ids"] == b["ids"] for r, b in zip(rs, base, strict=True))
        ratio = statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, base, strict=True))
        reused = statistics.fmean(r["stats"][1].get("prompt_reused", 0) for r in rs)
        print(
            f"{mode:5s} {m:8s} {sum(r['seconds'] for r in rs):7.1f} s  median {ratio:.3f}x of vanilla "
            f"({same}/{len(rs)} identical)  second turns: {reused:.0f} prompt tokens reused on average"
        )
for m in methods:  # the two modes' second turns may differ in their last bits, hence in length: per token
    rate = {
        mode: sum(r["tokens"] for r in runs[(m, mode)]) / sum(r["seconds"] for r in runs[(m, mode)]) for mode in modes
    }
    print(
        f"{m}: {rate['fresh']:.1f} tok/s fresh, {rate['reuse']:.1f} tok/s reuse ({rate['reuse'] / rate['fresh']:.3f}x)"
    )
