"""What a fast stream that agrees more would buy, with today's costs, inside real greedy generation: `m2r2` where the
stream's tokens are replaced by an oracle's (bundled model, MT-Bench first turns, after a warm-up).

Each oracle arm drafts as the shipped stream does and pays for it (the real stream runs the same levels in the same
call), but its tree is then a chain whose token at each depth is the full model's own (known from a `vanilla` answer
to the same prompt) with probability ``a`` given its parent was, else another token; its path probabilities are
``a ** depth``, so the tree's cost model and the draft ledger decide rows and drafting as they would for such a stream
(how many levels: the drafter's rule, one more while the last level's path probability beats a level's cost). Where
the real stream is sure and where it is not looks the same to this oracle: it is a stream of that agreement without a
confidence signal (a real stream of the same agreement that knows when it is right does better; see ``c`` below).

Arms: `vanilla`; copies alone (``draft=never``); the shipped stream; the oracle at each ``a`` of ``AGREEMENTS``. Every
arm has its own fresh draft ledger (none kept between processes) and answers the warm-up prompts untimed first; the
timed prompts then run arm after arm, REPS times in rotated order. Outputs stay `vanilla`'s (checked).

    python experiments/oracle_stream.py [PROMPTS] [THREADS] [REPS] [AGREEMENTS]   (e.g. 40 2 2 0.43,0.6,0.8,0.6c)

An agreement with a ``c`` (``0.6c``) is a calibrated oracle: each node's chance of being right is drawn from
Beta(2a, 2(1 - a)) (mean ``a``) and its path probability is the product of its chain's chances, so the tree knows
which drafts are sure, as a stream with a perfect confidence signal would. ``FREE=1``: the oracle does not run the real
stream, so its drafts cost nothing (what a draft's cost holds back). ``DRAFT=always``: the oracle arms draft in every
round while drafting gains more than it costs by the cost model, not where the draft ledger says it has paid.
``WASTE_FREE=1`` adds copies alone and the shipped stream verifying only those of their chosen rows that will be
accepted (the oracle knows): how much any better pricing of rows could ever save.
"""

import os
import random
import sys
import time

from warmed import GEN, tally, warmed_first_turns

from m2r2.decoding import build_strategy
from m2r2.decoding.tree import DraftLedger, Tree

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 40
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 2
agreements = (sys.argv[4] if len(sys.argv) > 4 else "0.43,0.6,0.8,0.6c").split(",")
FREE = os.environ.get("FREE") == "1"  # the oracle's drafts cost nothing (the stream is not run)
WASTE_FREE = os.environ.get("WASTE_FREE") == "1"  # also the arms that skip the rows that will be rejected
DRAFT = os.environ.get("DRAFT", "pays")  # when the oracle arms draft (the ``draft`` option)
WARM = 5  # prompts each arm answers untimed before the timed ones (its ledger's trials start there)
engine, ids = warmed_first_turns(n_prompts, threads)
answers = {i: engine.generate_ids(p, "vanilla", GEN).tokens for i, p in enumerate(ids)}
now = {"prompt": 0}


def fresh(**options):
    spec = build_strategy("m2r2", engine, **options)
    spec.ledger, spec.ledger_file = DraftLedger(), None
    return spec


def with_oracle(spec, a: float, sure: bool, seed: int = 0):
    """``spec`` drafting the oracle's chains (see the module docstring) at the real stream's cost; ``sure``: each
    node's chance is drawn from Beta(2a, 2(1 - a)) and the tree is told it (a calibrated stream of mean agreement a)."""
    real_draft, rng = spec.draft, random.Random(seed)
    vocab = engine.model.cfg.vocab_size

    def draft(h_last, tok, cache, room, gen, calib=1.0, costs=None):
        answer, plen = answers[now["prompt"]], len(ids[now["prompt"]])
        truth = answer[cache.length - plen + 1 :]  # the tokens after the root (the root is answer[length - plen])
        level = spec._level_cost(costs) if costs is not None else 0.0
        chances = [rng.betavariate(2 * a, 2 * (1 - a)) if sure else a for _ in range(min(room, spec.max_depth))]
        depth, path = 1, chances[0]
        while depth < len(chances) and calib * path >= level:  # the drafter's rule: on while the last level pays
            path *= chances[depth]
            depth += 1
        if not FREE:
            real_draft(h_last, tok, cache, depth, gen, 1e9, costs)  # the same levels, paid for
        tree, right, path = Tree([tok], [-1], [0], [1.0], [None]), True, 1.0
        for d in range(1, min(depth, len(truth)) + 1):
            right = right and rng.random() < chances[d - 1]
            path *= chances[d - 1]
            want = truth[d - 1]
            tree.add(want if right else (want + 1) % vocab, d - 1, path)
        return tree

    spec.draft = draft
    return spec


def waste_free(spec):
    """``spec`` verifying only the rows its tree chose that will be accepted (the oracle knows the full model's tokens):
    the same tokens, every pass without the rows it would have wasted."""
    real_round, real_choose = spec.round, spec.choose

    def round_(state, cache, tok, *rest):
        answer, plen = answers[now["prompt"]], len(ids[now["prompt"]])
        now["truth"] = answer[cache.length - plen + 1 :]
        return real_round(state, cache, tok, *rest)

    def choose(tree, room, calib, steps, costs=None):
        truth = now["truth"]

        def right(r):
            while r > 0:
                if tree.depths[r] > len(truth) or tree.tokens[r] != truth[tree.depths[r] - 1]:
                    return False
                r = tree.parents[r]
            return True

        return [r for r in real_choose(tree, room, calib, steps, costs) if r == 0 or right(r)]

    spec.round, spec.choose = round_, choose
    return spec


arms = {"vanilla": None, "copies alone": fresh(draft="never"), "shipped stream": fresh()}
if WASTE_FREE:
    arms["copies alone, no wasted rows"] = waste_free(fresh(draft="never"))
    arms["shipped stream, no wasted rows"] = waste_free(fresh())
for arm in agreements:
    a, sure = float(arm.rstrip("c")), arm.endswith("c")
    arms[f"oracle a={a:.2f}{', calibrated' if sure else ''}"] = with_oracle(fresh(draft=DRAFT), a, sure)
totals = {name: [0, 0, 0.0, 0.0, 0] for name in arms}  # tokens, passes, rows, seconds, drafting rounds


def answer(name, i, timed):
    now["prompt"] = i
    spec = arms[name]
    t = time.perf_counter()
    r = engine.generate_ids(ids[i], "vanilla", GEN) if spec is None else spec.generate(ids[i], GEN)
    seconds = time.perf_counter() - t
    assert r.tokens == answers[i], f"{name}: prompt {i} differs from vanilla"
    if timed:
        tally(totals[name], r, seconds)
        totals[name][4] += r.stats.get("drafting_share", 0.0) * r.stats.get("verify_passes", len(r.tokens))


for name in arms:
    for i in range(1, WARM + 1):
        answer(name, i, False)
names = list(arms)
for rep in range(reps):
    for name in names[rep % len(names) :] + names[: rep % len(names)]:
        for i in range(WARM + 1, n_prompts):
            answer(name, i, True)
base = totals["vanilla"][3]
print(
    f"{engine.kernel} kernel, {threads} thread(s), MT-Bench first turns {WARM + 2}..{n_prompts} timed, {reps} passes"
    + (", the oracle's drafts free" if FREE else "")
    + f", the oracles' draft={DRAFT}"
)
print("| arm | tokens a second | speedup (total time) | tokens a pass | rows a pass | drafting share |")
print("|---|--:|--:|--:|--:|--:|")
for name, (tokens, passes, rows, seconds, drafting) in totals.items():
    print(
        f"| {name} | {tokens / seconds:.1f} | {base / seconds:.3f}x | {tokens / passes:.3f} | {rows / passes:.3f} "
        f"| {drafting / passes:.3f} |"
    )
