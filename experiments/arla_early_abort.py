"""Could ARLA at an intermediate fast layer stop an m2r2-dynamic probe early? An offline analysis.

Usage: ``.venv/bin/python experiments/arla_early_abort.py ANSWERS.jsonl`` with the base
model's greedy answers to eval prompts as ``m2r2 eval-align --answers`` saves them (the quoted run
used the first 40 MT-Bench prompts, 96 tokens: 3,561 positions). Teacher-forced, block 1, shipped
adapters in the inference form. For exit thresholds at fast layer 10 and abort rules "ARLA at
layer j < q": the share of tokens aborted, the share of exits lost, and the share of the probe's
layers saved. Output quoted in BENCHMARKS.md / the session note: ``arla_early_abort.out.txt``.
"""

import json
import sys
from pathlib import Path

import torch

from m2r2.engine import Engine
from m2r2.multirate.fast import block_starts
from m2r2.multirate.io import load_default
from m2r2.training.loop import collate, make_sequences

engine = Engine(threads=2, quiet=True)
model = engine.model
fast = load_default(model, engine.fingerprint).freeze(merge=True)
depth = fast.cfg.depth
records = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
seqs = make_sequences(records, 512)
probs: list[list[torch.Tensor]] = [[] for _ in range(depth + 1)]
with torch.inference_mode():
    for i in range(0, len(seqs), 4):
        tokens, mask = collate(seqs[i : i + 4])
        cache = model.new_cache(tokens.shape[1], batch=tokens.shape[0])
        h = [model.embed_tokens(tokens)]
        model.run_layers(h[0], cache, 0, h)
        states = fast.forward_train(h[0], cache.k, cache.v, block_starts(tokens.shape[1], [1] * tokens.shape[1]))
        sel = [f[mask] for f in states]
        for j in range(1, depth + 1):
            probs[j].append(torch.sigmoid(fast.arla(sel, j)).float())
p = [torch.cat(x) if x else torch.empty(0) for x in probs]
print("positions", p[depth].numel())
for thr in (0.7, 0.5, 0.4, 0.3):
    ex = p[depth] >= thr
    print(f"--- exit threshold {thr}: exits {ex.float().mean():.3f}")
    for j in range(3, depth):
        for q in (0.05, 0.1, 0.15, 0.2):
            ab = p[j] < q
            print(f"  abort at layer {j} if ARLA_j<{q}: aborts {ab.float().mean():.2f} of tokens, "
                  f"loses {(ab & ex).float().sum() / max(int(ex.sum()), 1):.2f} of exits, "
                  f"saves {ab.float().mean() * (depth - j) / depth:.2f} of probe")  # fmt: skip
