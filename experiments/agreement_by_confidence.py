"""Where the first draft misses, by how sure the full model itself is of its next token.

    python experiments/agreement_by_confidence.py [ADAPTERS] [--prompts N] [--threads N]

The shipped seeded stream (or ADAPTERS) drafts as ``m2r2`` runs it (the decoding kernel, the 4-bit draft head),
teacher-forced on the model's own greedy answers to MT-Bench first turns (:func:`first_drafts`); each answer
position is binned by the full model's probability of its own pick there. Why: a drafter approximates the model's
distribution, and where that distribution is flat a small error flips the argmax; the bins say how much of the
agreement goal (0.6 at the first draft) lies where the model is unsure, and how far the stream is from the model
where it is sure.
"""

import argparse
import itertools
import json

import torch

from m2r2.bench.datasets import shared_eval_dir
from m2r2.engine import Engine
from m2r2.training.evaluate import first_drafts, greedy_records

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("adapters", nargs="?", default=None, help="seeded stream file (default: the shipped one)")
parser.add_argument("--prompts", type=int, default=60)
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()

engine = Engine(threads=args.threads, quiet=True)
model = engine.model
rows = [json.loads(x) for x in (shared_eval_dir() / "mt_bench.jsonl").open()][: args.prompts]
records = greedy_records(engine, [row["turns"][0] for row in rows], 96)
drafter = engine.strategy("m2r2", **({"adapters": args.adapters} if args.adapters else {})).drafter
drafts = first_drafts(model, drafter, records)
vocab = set(drafter.fast.draft_vocab.tolist())
edges = [0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.01]
# per bin: positions, drafts right, model's token inside the draft vocabulary, a copy right, the draft right where
# the copy is not
bins = [[0, 0, 0, 0, 0] for _ in edges[:-1]]


def copied(full: list[int], p: int) -> int | None:
    """What prompt lookup's simplest form proposes after position p: the token that followed the latest earlier
    occurrence of the bigram ending at p (None where there is none)."""
    for j in range(p - 1, 0, -1):
        if full[j - 1] == full[p - 1] and full[j] == full[p]:
            return full[j + 1]
    return None


with torch.inference_mode():
    for (prompt, answer), row in zip(records, drafts, strict=True):
        # the draft at answer position p (seeded by the state at p - 1 and the token at p) guesses the model's pick
        # after p, the argmax of its distribution at p (as first_draft_agreement scores it)
        full = prompt + answer
        h = model.run_layers(model.embed_tokens(torch.tensor([full])), model.new_cache(len(full) + 8), 0)
        top = model.head(h)[0, len(prompt) :].float().softmax(-1).max(-1)
        for i, (draft, pick, conf) in enumerate(zip(row, top.indices.tolist(), top.values.tolist(), strict=True)):
            b = next(i for i in range(len(edges) - 1) if conf < edges[i + 1])
            copy_right = copied(full, len(prompt) + i) == pick
            bins[b][0] += 1
            bins[b][1] += int(draft == pick)
            bins[b][2] += int(pick in vocab)
            bins[b][3] += int(copy_right)
            bins[b][4] += int(draft == pick and not copy_right)
n = sum(b[0] for b in bins)
name = args.adapters or "shipped"
print(f"{len(records)} MT-Bench first turns, {n} answer positions, kernel {engine.kernel}, stream {name}")
print(
    "| model's p(its own token) | share of positions | first draft right | token in draft vocabulary | share of all "
    "hits | a bigram copy right | first draft right where the copy is not |"
)
print("|---|--:|--:|--:|--:|--:|--:|")
hits = sum(b[1] for b in bins)
for (lo, hi), (cnt, right, inside, copy, alone) in zip(itertools.pairwise(edges), bins, strict=True):
    if cnt:
        cells = [cnt / n, right / cnt, inside / cnt, right / max(hits, 1), copy / cnt, alone / max(cnt - copy, 1)]
        print(f"| {lo:.1f}-{min(hi, 1.0):.1f} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
tot = [sum(b[k] for b in bins) for k in range(5)]
print(f"| all | 1.000 | {hits / n:.3f} | {tot[2] / n:.3f} | 1.000 | {tot[3] / n:.3f} | {tot[4] / (n - tot[3]):.3f} |")
