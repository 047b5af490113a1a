"""Kernel fidelity and speed: greedy answers of the bf16 kernels against the fp32 reference model.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python experiments/kernel_quality.py [KERNELS [NAME]]``
(12 MT-Bench first turns, 64 new tokens, kernels interleaved per prompt after a warm-up; KERNELS
default ``mkldnn,q4,int8``). Prints and writes to ``benchmarks/kernels/NAME.json`` (default
``kernels``), per kernel: median tok/s, exact-match rate, mean common-prefix
length and mean ROUGE-L F against the fp32 answer (the benchmark's own metric, ``bench/quality.py``).
"""

import json
import statistics
import sys
from pathlib import Path

import torch

from m2r2.bench.datasets import load_dataset
from m2r2.bench.quality import rouge_l
from m2r2.bench.results import git_commit
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine
from m2r2.machine import cpu_name

torch.set_num_threads(1)
ref = Engine(dtype="fp32", threads=1, quiet=True)
kernels = sys.argv[1].split(",") if len(sys.argv) > 1 else ["mkldnn", "q4", "int8"]
name = sys.argv[2] if len(sys.argv) > 2 else "kernels"
engines = {k: Engine(kernel=k, threads=1, quiet=True) for k in kernels}
gen = GenerationConfig(max_new_tokens=64)
rows: dict[str, list[dict]] = {k: [] for k in engines}
for e in engines.values():
    e.chat([{"role": "user", "content": "Hi"}], gen=GenerationConfig(max_new_tokens=8))
for p in load_dataset("mt_bench").prompts[:12]:
    msgs = [{"role": "user", "content": p.turns[0]}]
    r = ref.chat(msgs, gen=gen)
    for k, e in engines.items():
        c = e.chat(msgs, gen=gen)
        pairs = zip(c.result.tokens, r.result.tokens, strict=False)
        prefix = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        rows[k].append(
            {
                "tps": c.result.tokens_per_s,
                "exact": c.result.tokens == r.result.tokens,
                "prefix": min(len(c.result.tokens), len(r.result.tokens)) if prefix is None else prefix,
                "rouge": rouge_l(r.text, c.text),
            }
        )
out = {
    k: {
        "tok_s": statistics.median(x["tps"] for x in rs),
        "exact": sum(x["exact"] for x in rs) / len(rs),
        "mean_prefix": statistics.mean(x["prefix"] for x in rs),
        "rougeL": statistics.mean(x["rouge"] for x in rs),
    }
    for k, rs in rows.items()
}
for k, v in out.items():
    print(k, v)
command = " ".join(["OMP_NUM_THREADS=1 .venv/bin/python experiments/kernel_quality.py", *sys.argv[1:]])
stamp = {"commit": git_commit(), "cpu": cpu_name(), "command": command}
target = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels" / f"{name}.json"
target.write_text(json.dumps({**stamp, **out}, indent=1) + "\n")
