"""Tokens/s of the training store's base pass in fp32 (plain), bf16 (oneDNN) and bf16 (q4-avx512) on 32 own
answers, one thread, and how far each one's final states are from fp32 (docs/TRAINING.md, "Thirteenth round").

    python experiments/store_precision.py
"""

import json
import time
from pathlib import Path

import torch

from m2r2.engine import Engine
from m2r2.training.store import slow_pass

recs = [json.loads(x) for x in Path("runs/distill/answers-alpaca.jsonl").read_text().splitlines()][:32]
seqs = [(r["prompt_ids"] + r["answer_ids"])[:256] for r in recs]
seqs.sort(key=len)
n = sum(len(s) for s in seqs)
ref = None
for dtype, kernel in (("fp32", "plain"), ("bf16", "mkldnn"), ("bf16", "q4-avx512")):
    e = Engine(dtype=dtype, kernel=kernel, threads=1, quiet=True)
    m = e.model
    kv = [m.cfg.num_layers - 1]
    slow_pass(m, seqs[:2], kv)
    t = time.perf_counter()
    outs = []
    for j in range(0, 32, 8):
        outs += slow_pass(m, seqs[j : j + 8], kv)
    el = time.perf_counter() - t
    h = torch.cat([o["hidden"].float() for o in outs])
    msg = ""
    if ref is None:
        ref = h
    else:
        msg = f"rel diff h_N vs fp32 {((h - ref).norm() / ref.norm()).item():.4f}"
    print(dtype, kernel, f"{n / el:.0f} tok/s (1 thread)", msg, flush=True)
