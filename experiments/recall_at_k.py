"""Why +0.03 of first-draft agreement buys ~1% more tokens a pass: a tree verifies a node's top few
children, so what counts is whether the full model's token is among the stream's top k, not only its top 1.
Per draft step, teacher-forced on the base model's greedy MT-Bench answers (answer positions only), the share
of positions where the full model's top token (over the draft vocabulary) is within the stream's top k.

    python experiments/recall_at_k.py ADAPTERS [ADAPTERS ...]

Answers: runs/eval/mt_bench-60-96-fp32.jsonl (`m2r2 eval-align --limit 0 --max-new-tokens 96 --answers FILE
--dtype fp32` writes it). Float32 training form, as `eval-align` measures agreement.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from m2r2.engine import Engine
from m2r2.multirate.io import load_default
from m2r2.training.seeded_train import answers_store, pad_batch, targets

KS = (1, 2, 3, 4, 8)
CHAIN = 4
engine = Engine(dtype="fp32", kernel="plain", threads=int(os.environ.get("THREADS", "2")), quiet=True)
records = [json.loads(x) for x in Path("runs/eval/mt_bench-60-96-fp32.jsonl").read_text().splitlines() if x.strip()]
seqs = [(r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"])) for r in records]
print("| stream | draft | " + " | ".join(f"top-{k}" for k in KS) + " | mean p(top-1) where right | where wrong |")
print("|---|--:|" + "--:|" * (len(KS) + 2))
for path in sys.argv[1:]:
    stream = load_default(engine.model, engine.fingerprint, Path(path))
    stream.eval()
    rows = answers_store(engine.model, [s for s, _ in seqs], 1)
    hits = torch.zeros(CHAIN, len(KS))
    conf = torch.zeros(CHAIN, 2)
    n_right = torch.zeros(CHAIN, 2)
    total = torch.zeros(CHAIN)
    with torch.no_grad():
        for i in range(0, len(rows), 16):
            batch = pad_batch(rows[i : i + 16], 1)
            for j, (_, start) in enumerate(seqs[i : i + 16]):
                batch["valid"][j, :start] = False
            w, _, top = targets(stream, batch["hidden"])
            out = stream.forward_chain(batch["tokens"], batch["hidden"], batch["k"], batch["v"], CHAIN)
            pos = torch.arange(batch["hidden"].shape[1])
            for s, states in enumerate(out):
                m = batch["valid"] & (pos >= s + 1)[None, :]
                probs = F.linear(stream.base.norm(states[-1]), w).softmax(-1)[m]
                order = probs.topk(max(KS), -1).indices
                want = top[m][:, None]
                for c, k in enumerate(KS):
                    hits[s, c] += (order[:, :k] == want).any(-1).sum()
                right = order[:, 0] == want[:, 0]
                p1 = probs.max(-1).values
                conf[s, 0] += p1[right].sum()
                conf[s, 1] += p1[~right].sum()
                n_right[s, 0] += right.sum()
                n_right[s, 1] += (~right).sum()
                total[s] += m.sum()
    for s in range(CHAIN):
        cells = " | ".join(f"{float(hits[s, c] / total[s]):.3f}" for c in range(len(KS)))
        c_ok, c_bad = (conf[s] / n_right[s].clamp_min(1)).tolist()
        name = f"{Path(path).parent.name}/{Path(path).name}"
        print(f"| {name} | {s + 1} | {cells} | {c_ok:.3f} | {c_bad:.3f} |", flush=True)
