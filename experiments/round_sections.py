"""Where a `m2r2` round's own Python goes, section by section, inside real greedy generation on MT-Bench first turns
(after a warm-up): an edited copy of `TreeSpeculative.round` (made here from its source, not kept in the package) reads
the clock where each section ends. Why: `round_parts.py` puts the round's Python at ~0.18 ms a pass as one part; this
says which of its sections run it, every one of them after a verify pass has streamed the weights through the caches
(`cold_ops.py`).

    python experiments/round_sections.py [PROMPTS] [THREADS]

``DRAFT=uncopied`` (or any ``draft=`` policy) runs `m2r2` with that policy. A second table splits the sections between
the rounds that drafted and those that did not: what a drafting round costs beyond its draft call.
"""

import collections
import inspect
import os
import sys
import textwrap
import time

from warmed import GEN, warmed_first_turns

from m2r2.decoding import tree

#: the line each section ends before (in `TreeSpeculative.round`'s source), and the section's name
ENDS = {
    "copied = bool(": "prompt lookup's and the answer store's proposals",
    "if drafting:\n": "the kind of round, whether to draft",
    "looked, stored = self._copy_in": "drafting (the drafter's call)",
    "n_rows = len(rows)": "copies into the tree, choosing rows",
    "if gen.greedy and layers is None:": "row tokens, a tree's positions and mask",
    "if self.online_costs": "the verify pass (one C++ call)",
    "path, nxt = self._accept": "the online cost fit",
    "offered = [r for r": "accepting",
    "copied_on_path = ": "the copies' and the store's calibration",
    "if state.context is not None:\n    state.context.extend": "what a copy would have given instead",
    "cache.keep(": "lookup's context, the drafter's calibration, counts",
    "observe = getattr": "compacting the cache",
    "seconds = time.perf_counter() - started": "the next round's seed",
    "return [*[tree.tokens": "the draft ledger",
}
NOT_PYTHON = ("drafting (the drafter's call)", "the verify pass (one C++ call)")

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 20
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
spent: dict[str, float] = collections.defaultdict(float)
last = [0.0]


def _mark(name: str | None) -> None:
    now = time.perf_counter()
    if name is not None:
        spent[name] += now - last[0]
    last[0] = now


body = textwrap.dedent(inspect.getsource(tree.TreeSpeculative.round))  # `def round(` at column 0, the body at 4
start = "    started = time.perf_counter()"
assert start in body
body = body.replace(start, start + "; _mark(None)", 1)
for line, name in ENDS.items():
    at = textwrap.indent(line, "    ")
    assert body.count(at) >= 1, line
    body = body.replace(at, f"    _mark({name!r})\n{at}", 1)
namespace = dict(vars(tree), _mark=_mark)
exec("from __future__ import annotations\n" + body, namespace)  # our own source, edited
timed_round = namespace["round"]
#: per kind of round (drafted or not): rounds, and the seconds of each section
split: dict[bool, list] = {True: [0, collections.defaultdict(float)], False: [0, collections.defaultdict(float)]}


def split_round(self, state, *args, **kwargs):
    """The timed round, its sections' time also added to the kind it turned out to be."""
    before, drafted = dict(spent), state.draft_rounds
    out = timed_round(self, state, *args, **kwargs)
    kind = split[state.draft_rounds > drafted]
    kind[0] += 1
    for name, seconds in spent.items():
        kind[1][name] += seconds - before.get(name, 0.0)
    return out


tree.TreeSpeculative.round = split_round
options = {"draft": os.environ["DRAFT"]} if os.environ.get("DRAFT") else {}

engine, ids = warmed_first_turns(n_prompts, threads)
spent.clear()
for kind in split.values():
    kind[0] = 0
    kind[1].clear()
rounds = 0
for prompt in ids[1:]:
    rounds += engine.generate_ids(prompt, "m2r2", GEN, **options).stats["verify_passes"]
policy = f", draft={options['draft']}" if options else ""
print(f"{engine.kernel} kernel, {threads} thread(s), MT-Bench first turns 2..{n_prompts}{policy}: {rounds} rounds")
print("| section (ends where the next begins) | us a round |")
print("|---|--:|")
for name, seconds in spent.items():
    print(f"| {name} | {seconds / rounds * 1e6:.1f} |")
python = sum(v for k, v in spent.items() if k not in NOT_PYTHON)
print(f"| **the round's own Python** (all but the drafter and the verify pass) | **{python / rounds * 1e6:.1f}** |")

(n_drafted, drafted), (n_plain, plain) = split[True], split[False]
print(f"\n| section | us a drafting round ({n_drafted}) | us a round without drafting ({n_plain}) |")
print("|---|--:|--:|")
for name in spent:
    print(f"| {name} | {drafted[name] / max(n_drafted, 1) * 1e6:.1f} | {plain[name] / max(n_plain, 1) * 1e6:.1f} |")
own = [sum(v for k, v in d.items() if k not in NOT_PYTHON) / max(n, 1) * 1e6 for n, d in split.values()]
print(f"| **the round's own Python** | **{own[0]:.1f}** | **{own[1]:.1f}** |")
