"""Whether the model's sureness at a round's root tells a right copy from a wrong one, replayed on a benchmark run's
own `vanilla` answers (each turn's context: the conversation in the chat template, as `m2r2` indexes it).

A round starts from the token the last verify pass gave (the root). That pass already scored the root's row: the
head's top two logits are in hand (``head_argmax`` takes them for its certificate), so the model's sureness about
the root (its top probability, or the top-two logit margin) is a free signal. This replay asks whether it splits
the hit rate of a round's first copied token beyond what the copy's source already says: per source (lookup's match
class, or the answer store's chain alone with its first share's bucket) and per bucket of the root's top
probability, how often the first copied token was right.

Rounds are replayed as `copy_store_agreement.py` does (lookup's up to 6 tokens, a long match's 8, else the store's
chain; accept the matching prefix, then one token). The logits come from one teacher-forced pass over each
conversation (float32 head on the decoding kernel's states; a row's top probability, not its bits, is what counts).

    python experiments/copy_sureness.py RESULTS.json
    (e.g. benchmarks/round43-spr-2threads/final-mt60/results.json)
"""

import collections
import json
import sys

import torch

from m2r2.bench.datasets import load_dataset
from m2r2.decoding.answer_store import answer_store_for
from m2r2.decoding.lookup import LONG, NgramIndex
from m2r2.engine import Engine

CLASSES = ("plain", "split", "long")
SURE = (0.0, 0.5, 0.8, 0.95, 0.99, 1.01)  # bucket edges of the root's top probability
SHARE = (0.0, 0.3, 0.6, 0.9, 1.01)  # bucket edges of the store's first share


def bucket(x: float, edges: tuple[float, ...]) -> str:
    i = next(j for j in range(len(edges) - 1) if x < edges[j + 1])
    return f"{edges[i]:.2f}-{min(edges[i + 1], 1.0):.2f}"


with open(sys.argv[1]) as f:
    runs = json.load(f)["prompts"]
engine = Engine(threads=2, quiet=True)
model, tokenizer = engine.model, engine.tokenizer
store = answer_store_for(engine.fingerprint, None)
assert store is not None, "no answer store ships for this model"
known = {(d, str(p.id)): p for d in {p["dataset"] for p in runs} for p in load_dataset(d, 0).prompts}
cells: dict = collections.defaultdict(lambda: [0, 0])  # (source, sure bucket) -> rounds, first copy right
for p in runs:
    messages = []
    for turn, answer in enumerate(p["methods"]["vanilla"]["ids"]):
        messages.append({"role": "user", "content": known[(p["dataset"], p["id"])].turns[turn]})
        prompt = tokenizer.encode_chat(messages)
        messages.append({"role": "assistant", "content": tokenizer.decode(answer)})
        with torch.no_grad():
            toks = torch.tensor([prompt + answer])
            logits = model.forward(toks, model.new_cache(toks.shape[1] + 1))[0]
        # sure[i]: the model's top probability on the row that gave answer[i]
        sure = logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)].softmax(-1).amax(-1).tolist()
        index, i = NgramIndex(prompt), 0
        while i < len(answer):
            index.extend([answer[i]])
            s = bucket(sure[i], SURE)
            i += 1
            chain = index.propose(8)
            kind = index.match_class() if chain else None
            if kind is not None and kind != LONG:
                chain = chain[:6]
            source = CLASSES[kind] if chain else None
            if not chain:
                chain, shares = store.propose(index.tokens, 6)
                source = f"store {bucket(shares[0], SHARE)}" if chain else None
            m = 0
            while m < len(chain) and i + m < len(answer) and chain[m] == answer[i + m]:
                m += 1
            if source is not None:
                for key in ((source, s), (source, "all"), ("every source", s)):
                    cells[key][0] += 1
                    cells[key][1] += m > 0
            index.extend(answer[i : i + m])
            i += m
print(f"{len(runs)} prompts of {runs[0]['dataset']}, `vanilla` answers; rounds with a proposal by source")
print("and the root's top probability: rounds, how often the first copied token was right")
sources = sorted({k[0] for k in cells})
buckets = [bucket(e, SURE) for e in SURE[:-1]] + ["all"]
print("| source | " + " | ".join(buckets) + " |")
print("|---|" + "--:|" * len(buckets))
for src in sources:
    row = [cells.get((src, b)) for b in buckets]
    print(f"| {src} | " + " | ".join(f"{r[1] / r[0]:.2f} ({r[0]})" if r else "-" for r in row) + " |")
