"""Whether the full model's own confidence in a round's root token tells a right copy from a wrong one, replayed on
a benchmark run's `vanilla` answers.

A verify pass ends at the root of the next round: the token the model picked after the last accepted one. Its
probability under the model (and the margin between the model's two best logits there) is known the moment the pass
ends, for free if the head's argmax kept its runner-up. Where the model is sure of the root it is often in a
formulaic stretch (a list's scaffolding, a closing line, a repeated phrase), where copies run on; where it hesitated,
the next tokens are as open. If the first copied token's hit rate differs enough by that confidence, the tree could
spend its verify rows (~0.15-0.19 of a step each on this CPU; the rows a pass verifies and rejects cost ~15% of the
time, forty-third round) where they pay.

Rounds are replayed as in ``copy_store_agreement.py``: prompt lookup's chain (the real :class:`NgramIndex`), else the
shipped answer store's; the round accepts the chain's matching prefix, then one token. The model's probabilities are
its own over each turn's context and answer (one teacher-forced pass, float path: a predictor, not a decoder).

    python experiments/root_confidence.py RESULTS.json [DATASET ...] [--store FILE]
    (e.g. benchmarks/round48-spr-2threads/paper60/results.json mt_bench koala)

``--store`` replays another answer store (``m2r2 answer-store`` output) in place of the shipped one; with
``--no-confidence`` only the per-source rows are printed (no model pass), to compare stores by the same rounds.
"""

import argparse
import collections
import json
import sys

import torch

from m2r2.bench.datasets import load_dataset
from m2r2.decoding.answer_store import answer_store_for
from m2r2.decoding.lookup import LONG, NgramIndex
from m2r2.engine import Engine

CLASSES = ("plain", "split", "long")
EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 0.97, 1.01)
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("results")
parser.add_argument("datasets", nargs="*")
parser.add_argument("--store", default=None, help="answer store file (default: the shipped one)")
parser.add_argument("--no-confidence", action="store_true", help="per source only, no model pass")
args = parser.parse_args()
with open(args.results) as f:
    runs = json.load(f)["prompts"]
wanted = set(args.datasets) or {p["dataset"] for p in runs}
runs = [p for p in runs if p["dataset"] in wanted]
engine = Engine(threads=2, quiet=True)
model, tokenizer = engine.model, engine.tokenizer
store = answer_store_for(engine.fingerprint, args.store)
assert store is not None, "no answer store ships for this model"
known = {(d, str(p.id)): p for d in wanted for p in load_dataset(d, 0).prompts}
# (source, confidence bin) -> rounds, first copy right, copies accepted, copies proposed
cells: dict = collections.defaultdict(lambda: [0, 0, 0, 0])
judged: list[tuple[float, bool]] = []  # store rounds: the first node's share, and whether it was right
deeper: list[tuple[float, bool]] = []  # ... its later nodes whose parent was right: their shares, and whether right


def confidence(full: list[int]) -> list[float]:
    """The model's probability of each token of ``full`` given the ones before it (index 0: 1.0)."""
    with torch.inference_mode():
        h = model.run_layers(model.embed_tokens(torch.tensor([full])), model.new_cache(len(full) + 8), 0)
        logp = model.head(h)[0, :-1].float().log_softmax(-1)
        picked = logp.gather(-1, torch.tensor(full[1:])[:, None])[:, 0].exp()
    return [1.0, *picked.tolist()]


def bin_of(p: float) -> str:
    i = next(i for i in range(len(EDGES) - 1) if p < EDGES[i + 1])
    return f"{EDGES[i]:.2f}-{min(EDGES[i + 1], 1.0):.2f}"


for n_p, p in enumerate(runs):
    messages = []
    for turn, answer in enumerate(p["methods"]["vanilla"]["ids"]):
        messages.append({"role": "user", "content": known[(p["dataset"], p["id"])].turns[turn]})
        context = tokenizer.encode_chat(messages)
        # conf[k]: the model's p of answer[k]
        conf = [1.0] * len(answer) if args.no_confidence else confidence(context + answer)[len(context) :]
        index, i = NgramIndex(context), 0
        messages.append({"role": "assistant", "content": tokenizer.decode(answer)})
        while i < len(answer):
            index.extend([answer[i]])  # the round's root: the token the last pass gave
            root_p = conf[i]
            i += 1
            chain = index.propose(8)
            kind = index.match_class() if chain else None
            if kind is not None and kind != LONG:
                chain = chain[:6]
            source = CLASSES[kind] if chain else "store"
            if not chain:
                chain, shares = store.propose(index.tokens, 6)
                right = [i + d < len(answer) and t == answer[i + d] for d, t in enumerate(chain)]
                if chain:
                    judged.append((shares[0], right[0]))
                for d in range(1, len(chain)):
                    if not right[d - 1]:
                        break
                    deeper.append((shares[d], right[d]))
            if not chain:
                continue
            m = 0
            while m < len(chain) and i + m < len(answer) and chain[m] == answer[i + m]:
                m += 1
            keys = ((source, "all"), ("all", "all"))
            for key in keys if args.no_confidence else (*keys, (source, bin_of(root_p)), ("all", bin_of(root_p))):
                cell = cells[key]
                cell[0], cell[1], cell[2], cell[3] = cell[0] + 1, cell[1] + (m > 0), cell[2] + m, cell[3] + len(chain)
            index.extend(answer[i : i + m])
            i += m
    print(f"\r{n_p + 1}/{len(runs)} prompts", end="", file=sys.stderr)
print(file=sys.stderr)
positions = sum(len(a) for p in runs for a in p["methods"]["vanilla"]["ids"])
print(f"{len(runs)} prompts of {', '.join(sorted(wanted))}, `vanilla` answers (both turns where there are two),")
print(f"{positions} answer tokens; store {args.store or 'shipped'}")
print(
    "| copied chain from | the model's p of the root | rounds | first copy right | copies accepted a round | copied "
    "tokens proposed a round |"
)
print("|---|---|--:|--:|--:|--:|")
for (source, b), (n, first, acc, prop) in sorted(cells.items()):
    print(f"| {source} | {b} | {n} | {first / n:.3f} | {acc / n:.2f} | {prop / n:.2f} |")
rounds = positions - cells[("all", "all")][2]  # a round per token the copies did not supply
print(f"replayed rounds (a pass each): {rounds}; tokens a pass {positions / rounds:.3f}")
# how well the store's first share tells a right first node from a wrong one (what the tree prices its rows by)
brier = sum((p - r) ** 2 for p, r in judged) / len(judged)
base = sum(r for _, r in judged) / len(judged)
print(
    f"\nstore rounds: {len(judged)}; first node right {base:.3f}; Brier score of its share {brier:.4f} "
    f"(a constant {base:.3f}: {base * (1 - base):.4f})"
)
print("| node | its share | nodes | mean share | right |")
print("|---|---|--:|--:|--:|")
for name, nodes in (("first", judged), ("later, parent right", deeper)):
    for lo in (0.0, 0.2, 0.4, 0.6, 0.8, 0.9):
        hi = {0.8: 0.9, 0.9: 1.01}.get(lo, lo + 0.2)
        got = [(p, r) for p, r in nodes if lo <= p < hi]
        if got:
            print(
                f"| {name} | {lo:.1f}-{min(hi, 1.0):.1f} | {len(got)} | {sum(p for p, _ in got) / len(got):.3f} | "
                f"{sum(r for _, r in got) / len(got):.3f} |"
            )
