"""Threshold sweep of method ``mod`` (shipped routers) against ``vanilla`` on a few MT-Bench prompts.

Usage: ``.venv/bin/python experiments/mod_sweep.py OUT_DIR 0.0,0.5,0.8`` (1 thread, bf16,
5 prompts, 128 new tokens); uses the dynamic suite's runner, so the metrics are the suite's.
"""

import sys
from pathlib import Path

import torch

from m2r2.bench.dynamic_suite import run_dynamic
from m2r2.bench.harness import BenchSettings
from m2r2.engine import Engine

torch.set_num_threads(1)
values = [float(v) for v in sys.argv[2].split(",")]
e = Engine(dtype="bf16", threads=1, quiet=True)
s = BenchSettings(dataset="mt_bench", methods=[], limit=5, max_new_tokens=128, out_dir=Path(sys.argv[1]), warmup=1)
print(run_dynamic(e, s, sweeps={"mod": ("threshold", values)}, datasets=["mt_bench"])["markdown"])
