"""Which of `m2r2`'s drafting rounds pay, inside real greedy generation (bundled model, MT-Bench first turns, after
a warm-up, ``draft=uncopied``: the fast stream drafts only where prompt lookup and the answer store propose nothing).

Per drafting round: the wall clock of the draft call and of the whole round, how many drafted rows the cost model
chose, the first level's best probability, and the tokens the stream's nodes gave. Rounds are grouped by that first
probability, by the full model's probability of the round's root token (computed outside the timed round) and by what
the previous drafting round of the same answer gave: the last two are known before drafting, so they could skip it
before its cost is paid. The plain rounds (no copy, no draft) of the same runs give a step's time in situ.

    python experiments/drafting_rounds.py [PROMPTS] [THREADS]
"""

import collections
import sys
import time

from warmed import GEN, warmed_first_turns

from m2r2.decoding import tree as tree_mod

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 30
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine, ids = warmed_first_turns(n_prompts, threads)

one_round, one_draft, one_choose = (
    tree_mod.TreeSpeculative.round,
    tree_mod.TreeSpeculative.draft,
    tree_mod.TreeSpeculative.choose,
)
now: dict = {}
rounds: list[dict] = []


def draft(self, *args, **kwargs):
    t = time.perf_counter()
    tree = one_draft(self, *args, **kwargs)
    now["draft_s"] = time.perf_counter() - t
    firsts = [s for s, d in zip(tree.scores, tree.depths, strict=True) if d == 1]
    now["p1"] = max(firsts, default=0.0)
    now["depth"] = max(tree.depths)
    return tree


def choose(self, tree, *args, **kwargs):
    rows = one_choose(self, tree, *args, **kwargs)
    now["drafted_rows"] = sum(1 for r in rows[1:] if tree.scores[r] > 0)
    now["copied"] = bool(tree.copy_probs)
    now["rows"] = len(rows)
    return rows


one_seed = tree_mod.TreeSpeculative.seed_state
last_row: list = [None]


def seed_state(self, h, layers, i):
    last_row[0] = h[:, i].clone()  # the root's row: its confidence is computed outside the timed round
    return one_seed(self, h, layers, i)


def root_confidence() -> float:
    """The full model's probability of the next round's root token (its argmax at the last accepted row)."""
    model = engine.model
    logits = model.lm_head(model.norm(last_row[0])).float()
    return float(logits.softmax(-1).max())


def timed_round(self, state, *args):
    now.clear()
    now["root_p"] = root_confidence()
    before = state.copied_accepted
    t = time.perf_counter()
    out = one_round(self, state, *args)
    now["s"] = time.perf_counter() - t
    now["tokens"] = len(out[0])
    now["copied_tokens"] = state.copied_accepted - before
    now["answer"] = id(state)
    rounds.append(dict(now))
    return out


tree_mod.TreeSpeculative.draft, tree_mod.TreeSpeculative.choose = draft, choose
tree_mod.TreeSpeculative.round = timed_round
tree_mod.TreeSpeculative.seed_state = seed_state
for prompt in ids[1:]:
    engine.generate_ids(prompt, "m2r2", GEN, draft="uncopied")

plain = [r for r in rounds if "draft_s" not in r and not r.get("copied") and r.get("rows", 1) == 1]
drafting = [r for r in rounds if "draft_s" in r]
step = sorted(r["s"] for r in plain)[len(plain) // 2] if plain else float("nan")
print(f"{engine.kernel} kernel, {threads} thread(s), MT-Bench first turns 2..{n_prompts}, 128 tokens, draft=uncopied")
print(
    f"rounds {len(rounds)}: drafting {len(drafting)}, plain (no copy, no draft) {len(plain)}, "
    f"a plain round's median {step * 1e3:.2f} ms"
)


def row(label: str, group: list[dict]) -> str:
    if not group:
        return f"| {label} | 0 | | | | | | |"
    n = len(group)
    gained = sum(r["tokens"] - 1 - r["copied_tokens"] for r in group) / n
    steps = sum(r["s"] for r in group) / n / step
    d = sum(r["draft_s"] for r in group) / n / step
    none = sum(1 for r in group if r["drafted_rows"] == 0) / n
    rows_ = sum(r["drafted_rows"] for r in group) / n
    return (
        f"| {label} | {n} | {gained:.3f} | {steps:.3f} | {d:.3f} | {rows_:.2f} | {none:.2f} | "
        f"{(1 + gained) / steps:.3f} |"
    )


print(
    "| drafting rounds | rounds | stream tokens a round | round (plain rounds) | draft call | drafted rows | "
    "share with none | tokens per plain round |"
)
print("|---|--:|--:|--:|--:|--:|--:|--:|")
print(row("all", drafting))
for lo, hi in ((0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 1.01)):
    print(row(f"first level's best {lo:.1f}-{min(hi, 1):.1f}", [r for r in drafting if lo <= r["p1"] < hi]))
for lo, hi in ((0, 0.5), (0.5, 0.8), (0.8, 0.95), (0.95, 1.01)):
    print(
        row(
            f"the root's full-model probability {lo:.2f}-{min(hi, 1):.2f}",
            [r for r in drafting if lo <= r["root_p"] < hi],
        )
    )
prev: dict[int, dict] = {}
after = collections.defaultdict(list)
for r in rounds:
    if "draft_s" not in r:
        continue
    p = prev.get(r["answer"])
    if p is not None:
        key = (
            "gave"
            if p["tokens"] - 1 - p["copied_tokens"] > 0
            else ("rows, none taken" if p["drafted_rows"] else "no rows")
        )
        after[key].append(r)
        after["p1 >= 0.4" if p["p1"] >= 0.4 else "p1 < 0.4"].append(r)
    prev[r["answer"]] = r
for key in ("gave", "rows, none taken", "no rows", "p1 >= 0.4", "p1 < 0.4"):
    print(row(f"after a drafting round that: {key}", after[key]))
