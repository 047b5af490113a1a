"""Is the fast stream right where the copies are not? The share of MT-Bench answer positions where a
copy source (prompt lookup or the shipped answer store) proposes the next token, and the stream's
agreement per draft step on copied and on uncopied positions: what a draft adds in `m2r2`'s tree is
its agreement where the copies miss (``train-seeded --copy-w`` trains for it).

    python experiments/copy_overlap.py ADAPTERS [ADAPTERS ...]

Teacher-forced on the base model's greedy MT-Bench first-turn answers (runs/eval/mt_bench-60-96-fp32.jsonl,
from `m2r2 eval-align --limit 0 --max-new-tokens 96 --answers FILE --dtype fp32`), answer positions only,
float32 training form, as `eval-align` measures agreement. Labels: :func:`m2r2.training.copy_weights.copied_positions`.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from m2r2.decoding.answer_store import answer_store_for
from m2r2.engine import Engine
from m2r2.multirate.io import load_default
from m2r2.training.copy_weights import copied_positions
from m2r2.training.seeded_train import answers_store, pad_batch, targets

CHAIN = 4
engine = Engine(dtype="fp32", kernel="plain", threads=int(os.environ.get("THREADS", "2")), quiet=True)
records = [json.loads(x) for x in Path("runs/eval/mt_bench-60-96-fp32.jsonl").read_text().splitlines() if x.strip()]
seqs = [(r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"])) for r in records]
store = answer_store_for(engine.fingerprint, None)
labels = [copied_positions(toks, store) for toks, _ in seqs]
print("| stream | draft | agreement | positions copied | where copied | where not copied | copied or drafted right |")
print("|---|--:|--:|--:|--:|--:|--:|")
for path in sys.argv[1:]:
    stream = load_default(engine.model, engine.fingerprint, Path(path))
    stream.eval()
    rows = answers_store(engine.model, [s for s, _ in seqs], 1)
    hit = torch.zeros(CHAIN, 2)  # [step, copied?] stream right
    n = torch.zeros(CHAIN, 2)
    union = torch.zeros(2)  # draft 1: copied or stream right, positions
    with torch.no_grad():
        for i in range(0, len(rows), 16):
            batch = pad_batch(rows[i : i + 16], 1)
            copied = torch.zeros_like(batch["valid"])
            for j, (_, start) in enumerate(seqs[i : i + 16]):
                batch["valid"][j, :start] = False
                copied[j, : len(labels[i + j])] = labels[i + j]
            w, _, top = targets(stream, batch["hidden"])
            out = stream.forward_chain(batch["tokens"], batch["hidden"], batch["k"], batch["v"], CHAIN)
            pos = torch.arange(batch["hidden"].shape[1])
            for s, states in enumerate(out):
                m = batch["valid"] & (pos >= s + 1)[None, :]
                right = F.linear(stream.base.norm(states[-1]), w).argmax(-1) == top
                for c in (0, 1):
                    mc = m & (copied == bool(c))
                    hit[s, c] += (right & mc).sum()
                    n[s, c] += mc.sum()
                if s == 0:
                    union[0] += ((right | copied) & m).sum()
                    union[1] += m.sum()
    for s in range(CHAIN):
        share = n[s, 1] / n[s].sum()
        tail = f" {union[0] / union[1]:.3f} |" if s == 0 else " |"
        print(
            f"| {Path(path).parent.name}/{Path(path).name} | {s + 1} | {hit[s].sum() / n[s].sum():.3f} | {share:.3f} |"
            f" {hit[s, 1] / n[s, 1]:.3f} |"
            f" {hit[s, 0] / n[s, 0]:.3f} |" + tail
        )
