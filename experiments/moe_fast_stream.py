"""The MoE ``m2r2`` policy's fast-stream variants side by side with on-demand and next-gate loading.

Usage: ``.venv/bin/python experiments/moe_fast_stream.py experts|depth MODEL_DIR`` (the
MoEfied model of ``m2r2 moefy``, with its fast-stream adapters in ``MODEL_DIR/fast/``; 1 thread,
3 MT-Bench first turns, 24 new tokens, measured I/O). ``experts`` compares the fast layers with the
resident routed experts (``fast_experts="cache"``) against without them (``"none"``); ``depth``
compares running all 10 fast layers with 7 and 5. Cache sizes 25%, 50%, 100% of the experts (100%:
no copies, which isolates the fast stream's own cost). Speedup = median of per-prompt tok/s
ratios against on-demand. Outputs quoted in BENCHMARKS.md: ``moe_fast_stream.<variant>.out.txt``.
"""

import statistics
import sys

from m2r2.bench.datasets import load_dataset
from m2r2.bench.moe_suite import _fast_stream
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine
from m2r2.moe.runtime import OffloadedMoE, expert_store, record_trace, store_path, total_experts

VARIANTS = {
    "experts": [{"fast_experts": "cache", "depth": None}, {"fast_experts": "none", "depth": None}],
    "depth": [{"fast_experts": "none", "depth": d} for d in (None, 7, 5)],
}
variant, model_dir = sys.argv[1], sys.argv[2]
engine = Engine(model=model_dir, threads=1, quiet=True)
model = engine.model
store = expert_store(model, store_path(engine.fingerprint, model.dtype))
fast = _fast_stream(engine, None)
prompts = [
    engine.tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}]) for p in load_dataset("mt_bench", 3).prompts
]
gen = GenerationConfig(max_new_tokens=24)
cfgs = [("on-demand", {}), ("next-gate", {})] + [("m2r2", o) for o in VARIANTS[variant]]
for frac in (0.25, 0.5, 1.0):
    runner = OffloadedMoE(model, store, round(frac * total_experts(model)), engine.tokenizer.eos_ids)
    res: list[list] = [[] for _ in cfgs]
    for ids in prompts:
        _, trace = record_trace(model, ids, gen, engine.tokenizer.eos_ids)
        for i, (policy, opts) in enumerate(cfgs):
            res[i].append(runner.generate(ids, gen, policy=policy, fast=fast, trace=trace, **opts))
    for (policy, opts), outs in zip(cfgs, res, strict=True):
        sp = statistics.median(a.tokens_per_s / b.tokens_per_s for a, b in zip(outs, res[0], strict=True))
        hit = statistics.fmean(o.stats["hit_rate"] for o in outs)
        stall = statistics.fmean(o.stats["stall_s_per_token"] for o in outs) * 1e3
        mb = statistics.fmean(o.stats["bytes_per_token"] for o in outs) / 1e6
        tps = statistics.median(o.tokens_per_s for o in outs)
        print(f"cache {frac} {policy} {opts} speedup {sp:.2f} tok/s {tps:.2f} hit {hit:.3f} stall {stall:.1f}ms "
              f"MB/tok {mb:.1f}", flush=True)  # fmt: skip
