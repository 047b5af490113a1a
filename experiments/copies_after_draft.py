"""Would copies proposed after the fast stream's first draft pay? A replay over the base model's greedy MT-Bench
first-turn answers (runs/eval/mt_bench-60-96-fp32.jsonl), round by round with unlimited verify rows: today a
round is offered one copied chain at its root (prompt lookup, else the shipped answer store) beside the fast
stream's chain of drafts; the candidate also offers, where the root's copy misses and the first draft is right,
the copied chain that follows the context extended by that draft (a copy span whose first token only the stream
could draft). Tokens a round (accepted + the bonus token) for both, and how many rounds the candidate lengthened.

    python experiments/copies_after_draft.py ADAPTERS

Unlimited rows make this an upper bound on what the candidate adds: the real tree also pays for the rows.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from m2r2.decoding.answer_store import answer_store_for
from m2r2.decoding.lookup import DEFAULT_LOOKUP, NgramIndex
from m2r2.engine import Engine
from m2r2.multirate.io import load_default
from m2r2.training.seeded_train import answers_store, pad_batch, targets

CHAIN = 4
engine = Engine(dtype="fp32", kernel="plain", threads=2, quiet=True)
records = [json.loads(x) for x in Path("runs/eval/mt_bench-60-96-fp32.jsonl").read_text().splitlines() if x.strip()]
seqs = [(r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"])) for r in records]
store = answer_store_for(engine.fingerprint, None)
stream = load_default(engine.model, engine.fingerprint, Path(sys.argv[1]))
stream.eval()
rows = answers_store(engine.model, [s for s, _ in seqs], 1)
right: list[torch.Tensor] = []  # per sequence [CHAIN, T]: draft s+1 of the chain ending at position p is right
with torch.no_grad():
    for i in range(0, len(rows), 16):
        batch = pad_batch(rows[i : i + 16], 1)
        w, _, top = targets(stream, batch["hidden"])
        out = stream.forward_chain(batch["tokens"], batch["hidden"], batch["k"], batch["v"], CHAIN)
        hits = torch.stack([F.linear(stream.base.norm(states[-1]), w).argmax(-1) == top for states in out], 1)
        right.extend(hits[j, :, : len(seqs[i + j][0])] for j in range(hits.shape[0]))


def copied(context: list[int]) -> list[int]:
    """The chain a round is offered after ``context``: prompt lookup's, else the answer store's."""
    chain = NgramIndex(context).propose(DEFAULT_LOOKUP)
    return chain or store.propose(context, DEFAULT_LOOKUP)[0]


def agreeing(chain: list[int], truth: list[int]) -> int:
    n = 0
    while n < min(len(chain), len(truth)) and chain[n] == truth[n]:
        n += 1
    return n


totals = {"root copies (today)": [0, 0], "+ copies after the first draft": [0, 0]}
lengthened = 0
for (toks, start), hit in zip(seqs, right, strict=True):
    for mode, total in totals.items():
        i = start  # the round's root: the newest token, its successors to be drafted
        while i < len(toks) - 1:
            by_copy = agreeing(copied(toks[: i + 1]), toks[i + 1 :])
            by_stream = 0
            while by_stream < CHAIN and i + by_stream < len(toks) - 1 and hit[by_stream, i + by_stream]:
                by_stream += 1
            best = max(by_copy, by_stream)
            if mode != "root copies (today)" and by_stream and not by_copy:
                after = agreeing(copied(toks[: i + 2]), toks[i + 2 :])
                lengthened += 1 + after > best
                best = max(best, 1 + max(by_stream - 1, after))
            step = min(best + 1, len(toks) - 1 - i)
            total[0] += step
            total[1] += 1
            i += step
print("| rounds offer | tokens a round | rounds |")
print("|---|--:|--:|")
for mode, (tokens, n) in totals.items():
    print(f"| {mode} | {tokens / n:.3f} | {n} |")
print(f"rounds the copies after the first draft lengthened: {lengthened}")
