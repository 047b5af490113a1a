"""Do the tokens a drafting round credits to the fast stream save passes in the whole answer?

The ledger (``draft=pays``) credits a drafting round with the tokens only the stream's nodes gave, as if each saved a
round of its kind. But had a round with no copy not drafted, it would have emitted its first token alone, and the
next round might have been offered a copy (prompt lookup's, else the answer store's) that carries on from there: the
stream's later tokens then cost that round nothing. Each MT-Bench first turn is answered greedily three times, in
alternating order (identical tokens): copies alone (``draft=never``), drafting where nothing is copied
(``uncopied``) and drafting in every round the strategy's wall-clock rule allows (``always``).

Counts: passes per policy, the stream's credited tokens (in rounds with and without a copy proposed) and, of those
without, how many the next round's copy would have given (``displaced``; what the ledger no longer credits). Time:
the rounds' seconds against copies alone, what no-copy drafting rounds took beyond a plain round of the same run
(median), what their credited and their undisplaced tokens are worth in plain rounds, and how much longer the same
run's undrafted rounds took than copies alone's of the same kind and rows (drafting's cost outside its own round).

    python experiments/draft_displacement.py [PROMPTS] [THREADS]
"""

import statistics
import sys
import time

from warmed import GEN, warmed_first_turns

from m2r2.decoding import tree as tree_mod
from m2r2.decoding.lookup import DEFAULT_LOOKUP, NgramIndex

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 30
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine, ids = warmed_first_turns(n_prompts, threads)
policies = ("never", "uncopied", "always")
policy = ["never"]
credit = {p: [0, 0] for p in policies}  # stream tokens credited: [in copy rounds, in rounds without]
displaced = dict.fromkeys(policies, 0)  # ... of those without, what the next round's copy would have given
rounds: dict[str, list[tuple[bool, bool, int, float, int]]] = {p: [] for p in policies}  # copied, drafting, rows, s, g


def covered(spec, context: list[int], emitted: list[int]) -> int:
    """How many of ``emitted[1:]`` the copy offered after ``context + emitted[0]`` matches: the ledger's own helper
    (``TreeSpeculative._copied_after``) on an index built from scratch over the context before the round."""
    return spec._copied_after(tree_mod.TreeState(context=NgramIndex(context)), emitted, DEFAULT_LOOKUP)


one_round, one_copy_in = tree_mod.TreeSpeculative.round, tree_mod.TreeSpeculative._copy_in
last_copied = [False]


def copy_in(tree, state, looked_chain, stored_chain):
    last_copied[0] = bool(looked_chain or stored_chain[0])
    return one_copy_in(tree, state, looked_chain, stored_chain)


def counted_round(self, state, cache, tok, *args):
    before, drafting_before, rows_before = state.copied_accepted, state.draft_rounds, state.rows
    context = [*state.context.tokens, tok]
    t = time.perf_counter()
    out = one_round(self, state, cache, tok, *args)
    seconds = time.perf_counter() - t
    drafting, copied, gained = state.draft_rounds > drafting_before, last_copied[0], 0
    if drafting:  # the tokens only the stream's nodes gave
        gained = len(out[0]) - 1 - (state.copied_accepted - before)
        credit[policy[0]][0 if copied else 1] += gained
        if not copied and gained > 0:
            displaced[policy[0]] += covered(self, context, out[0])
    rounds[policy[0]].append((copied, drafting, state.rows - rows_before, seconds, gained))
    return out


tree_mod.TreeSpeculative.round = counted_round
tree_mod.TreeSpeculative._copy_in = staticmethod(copy_in)
totals = {p: [0, 0] for p in policies}  # tokens, passes
answers: dict[str, list[list[int]]] = {p: [] for p in policies}
for i, prompt in enumerate(ids[1:]):
    for p in policies if i % 2 == 0 else reversed(policies):
        policy[0] = p
        r = engine.generate_ids(prompt, "m2r2", GEN, draft=p)
        totals[p][0] += len(r.tokens)
        totals[p][1] += r.stats["verify_passes"]
        answers[p].append(list(r.tokens))
assert answers["never"] == answers["uncopied"] == answers["always"], "greedy answers differ between policies"

tokens, passes_never = totals["never"]
print(f"{engine.kernel} kernel, {threads} thread(s), MT-Bench first turns 2..{n_prompts}, 128 tokens, {tokens} tokens")
print("| policy | passes | tokens a pass | stream tokens credited: copy rounds | no-copy rounds | of these displaced |")
print("|---|--:|--:|--:|--:|--:|")
for p in policies:
    passes = totals[p][1]
    print(f"| {p} | {passes} | {tokens / passes:.3f} | {credit[p][0]} | {credit[p][1]} | {displaced[p]} |")


def like_rounds(rs) -> dict[tuple[bool, int], float]:
    """Median seconds of a policy's undrafted rounds per (copied, rows)."""
    by: dict[tuple[bool, int], list[float]] = {}
    for copied, drafting, rows, s, _ in rs:
        if not drafting:
            by.setdefault((copied, rows), []).append(s)
    return {k: statistics.median(v) for k, v in by.items()}


ref = like_rounds(rounds["never"])
never_s = sum(r[3] for r in rounds["never"])
print(
    "\n| policy | rounds' seconds | against copies alone | no-copy drafting rounds beyond a plain round "
    "| credited worth | undisplaced worth | undrafted rounds beyond copies alone's like rounds |"
)
print("|---|--:|--:|--:|--:|--:|--:|")
for p in policies:
    rs, own = rounds[p], like_rounds(rounds[p])
    plain = own.get((False, 1), ref[(False, 1)])
    total = sum(r[3] for r in rs)
    extra = sum(s - plain for copied, drafting, _, s, _ in rs if drafting and not copied)
    gained = sum(g for copied, drafting, _, _, g in rs if drafting and not copied)
    outside = [s - ref[(c, n)] for c, d, n, s, _ in rs if not d and (c, n) in ref]
    print(
        f"| {p} | {total:.2f} | {100 * (total / never_s - 1):+.1f}% | {extra:+.3f} s | {gained * plain:.3f} s "
        f"| {(gained - displaced[p]) * plain:.3f} s | {sum(outside):+.3f} s over {len(outside)} rounds |"
    )
