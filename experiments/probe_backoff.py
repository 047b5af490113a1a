"""m2r2-dynamic with and without probe backoff, against vanilla, on the first 3 prompts of datasets.

Usage: ``.venv/bin/python experiments/probe_backoff.py mt_bench`` (default 2 threads, 64 new
tokens, first turns; configs interleaved per prompt after a warm-up). Prints per (threshold, backoff):
mean ROUGE-L against vanilla, paired speedup (median of per-prompt ratios), exit rate, probes per
token. Output quoted in BENCHMARKS.md: ``probe_backoff.out.txt`` (MT-Bench only: the run was
stopped before the other datasets to free the machine).
"""

import statistics
import sys

from m2r2.bench.datasets import load_dataset
from m2r2.bench.quality import paired_speedup, rouge_l
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine

engine = Engine(quiet=True)
gen = GenerationConfig(max_new_tokens=64)
cfgs = [("vanilla", {})] + [("m2r2-dynamic", {"threshold": t, "backoff": b}) for t in (0.7, 0.5, 0.4) for b in (0, 4)]
for name in (sys.argv[1] if len(sys.argv) > 1 else "mt_bench").split(","):
    data = load_dataset(name, 3)
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}]) for p in data.prompts]
    for method, opts in cfgs:  # warm-up
        engine.generate_ids(prompts[0], method, GenerationConfig(max_new_tokens=8), **opts)
    results: list[list] = [[] for _ in cfgs]
    for ids in prompts:
        for i, (method, opts) in enumerate(cfgs):
            results[i].append(engine.generate_ids(ids, method, gen, **opts))
    ref = results[0]
    decode = engine.tokenizer.decode
    for (_, opts), outs in zip(cfgs[1:], results[1:], strict=True):
        q = statistics.fmean(rouge_l(decode(a.tokens), decode(b.tokens)) for a, b in zip(ref, outs, strict=True))
        sp = paired_speedup([o.tokens_per_s for o in outs], [o.tokens_per_s for o in ref])
        ex = statistics.fmean(o.stats["exit_rate"] for o in outs)
        pr = statistics.fmean(o.stats["probes"] / max(len(o.tokens), 1) for o in outs)
        print(f"{name} {opts} rouge {q:.3f} speedup {sp:.2f} exit {ex:.2f} probes/tok {pr:.2f}", flush=True)
