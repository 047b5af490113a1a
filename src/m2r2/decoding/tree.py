"""Token trees verified in one slow pass: M2R2 self-speculation with the seeded fast stream, and any
other :class:`TreeDrafter` (Medusa heads, :mod:`m2r2.decoding.medusa`; an EAGLE head,
:mod:`m2r2.decoding.eagle`) on the same footing.

Round: the slow stream has verified ``L`` positions and produced the next token ``x`` and the final
state ``h_N(L-1)``. A drafter grows a tree under ``x``: depth by depth, the ``width`` most probable
open nodes (by path probability, the product of draft probabilities from the root) are expanded in
one draft step, each adding its ``branch`` most likely children. The seeded fast stream
(:mod:`m2r2.multirate.seeded`) seeds each node's step with its parent's fast state; Medusa heads
predict depth ``d`` from ``h_N(L-1)`` alone, so every node of a level gets the same children; an
EAGLE head fuses each node's token with its parent's predicted final state, attending its own cache
of the verified positions' true states (which it is handed after every verify pass). The
tree kept for verification is the most probable nodes, as many as maximise expected tokens per
second under measured costs (the drafter's start, draft levels and verify passes of k rows; a path's
probability, calibrated online by how often drafts are accepted, is its chance of being accepted;
the verify costs, measured once at a short context, are corrected online by each sequence's own
passes, :class:`VerifyFit`).
Copied chains join the same tree: prompt lookup's (:mod:`m2r2.decoding.lookup`) and, in rounds where
it has nothing, the answer store's (:mod:`m2r2.decoding.answer_store`: the model's own phrasing from
its answers to training prompts, each token weighed by how sure the store is of it; offered beside
lookup's chain as well, it cost more rows than it won, BENCHMARKS.md "Fourteenth round"). One slow
pass over ``[x, nodes...]`` with a tree mask (each row sees the verified prefix and its ancestors;
the C++ row attention, or else a :class:`m2r2.model.GappedMask`, gives each row the bits a decoding
step would, :func:`m2r2.model.attend`) yields the slow argmax of every node; the longest path whose tokens
match is accepted, its K/V is compacted behind the prefix (:meth:`KVCache.keep`), and the slow
state of its last node seeds the next round.

Greedy output is token-for-token the plain greedy output: a node is accepted only where it equals
the slow argmax, and the slow model supplies the token after the path. With sampling the draft is a
chain (width 1, branch 1) verified by standard speculative sampling, which is exact. With an
``exit_threshold`` (``m2r2-dynamic``, greedy, lossy on purpose) a draft confident enough is kept even
where the full model disagrees: docs/DYNAMIC.md.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from m2r2.decoding.answer_store import ORDERS, AnswerStore, answer_store_for
from m2r2.decoding.base import (
    CACHE_SLACK,
    GenerationConfig,
    GenerationResult,
    Sampler,
    Stopper,
    StreamCallback,
    begin,
    warp_probs,
)
from m2r2.decoding.costs import cached_costs, check_verify_curve, cost_cache_path, drop_loaded_costs
from m2r2.decoding.lookup import LONG, MATCH_PRIORS, PLAIN, LookupStats, NgramIndex
from m2r2.errors import SettingsError
from m2r2.files import atomic_text
from m2r2.kernels import head_argmax
from m2r2.model import ROW_INVARIANT_MAX_ROWS, Transformer
from m2r2.multirate.seeded import SeededFastStream, TreeLimits

if TYPE_CHECKING:
    from pathlib import Path

    from torch import nn

    from m2r2.cache import Conversation, KVCache
    from m2r2.decoding.base import Loaded


@dataclass
class TreeCosts:
    """Seconds of one draft level over ``r`` open nodes (``draft[r-1]``), of slow passes over k rows
    (``verify[k-1]``), and of a drafter's fixed work per drafting round (``start``: Medusa scores all its
    heads in one batched pass there, so its levels cost next to nothing; the seeded stream has none)."""

    draft: list[float]
    verify: list[float]
    start: float = 0.0


@dataclass
class Tree:
    """Draft nodes in creation order; node 0 is the root (the verified next token, not a draft)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]  # path probability of each node (root 1.0)
    probs: list[Tensor | None] = field(default_factory=list)  # sampling: the draft distribution of each node
    # prompt lookup's chain under the root, by depth: node -> its calibrated path probability as a copy
    copy_probs: dict[int, float] = field(default_factory=dict)

    def value(self, r: int, calib: float) -> float:
        """Chance that node ``r`` is accepted: its calibrated draft path probability, or as a copy."""
        return max(min(1.0, calib * self.scores[r]), self.copy_probs.get(r, 0.0))

    def own(self, r: int) -> float:
        """Node ``r``'s own draft probability given its parent (0 for a prompt-lookup copy)."""
        parent = self.scores[self.parents[r]]
        return self.scores[r] / parent if parent > 0 else 0.0

    def add(self, token: int, parent: int, score: float, probs: Tensor | None = None) -> int:
        """A new node under ``parent`` (its path probability ``score``; ``probs``: its draft distribution when
        sampling); returns its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(score)
        self.probs.append(probs)
        return len(self.tokens) - 1

    def add_copies(self, tokens: list[int], probs: list[float]) -> list[int]:
        """Merge a copied chain (prompt lookup's or the answer store's) under the root: shared prefixes
        reuse drafted or copied nodes (a node copied twice keeps the higher probability). Returns the
        chain's nodes."""
        r, nodes = 0, []
        for t, p in zip(tokens, probs, strict=True):
            kid = next((i for i, q in enumerate(self.parents) if q == r and self.tokens[i] == t), None)
            if kid is None:
                kid = self.add(t, r, 0.0)
            self.copy_probs[kid] = max(p, self.copy_probs.get(kid, 0.0))
            nodes.append(kid)
            r = kid
        return nodes

    def ancestors(self, rows: list[int]) -> Tensor:
        """``[n, n]`` boolean: row i sees row j when j is i or an ancestor of i (among ``rows``)."""
        index = {r: i for i, r in enumerate(rows)}
        m = [[False] * len(rows) for _ in rows]  # filled as lists: a tensor's item assignment costs ~1 us each
        for i, r in enumerate(rows):
            a = r
            while a >= 0:
                m[i][index[a]] = True
                a = self.parents[a]
        return torch.tensor(m, dtype=torch.bool).view(len(rows), len(rows))


class VerifyFit:
    """A sequence's in-situ verify cost, fitted online from its own verify passes as ``seconds ~ base +
    per_row * (rows - 1)``, and the correction it makes to the measured curve (:class:`TreeCosts`).

    Why: the curve is timed once, at a 128-token context, and kept for a day; real contexts run to
    200-800 tokens, where attention makes each extra row dearer, and the VM's speed drifts, so it
    can be off for a whole run. Exponentially weighted least squares (decay 0.95: about the last 20
    passes) follows the growing context. The fit corrects the curve rather than replacing it: the same
    weighted regression is run on the measured costs of the same row counts, and the curve's first
    pass and its increments over it are scaled by the ratios of the two intercepts and of the two
    slopes (:meth:`scales`). That is exact when the passes cost the measured ones times a constant,
    and keeps the curve's measured shape (convex, with BLAS blocking steps) beyond the rows observed.
    Until 8 passes of some spread in rows have been seen (passes of one size say nothing of the
    slope) the measured curve stands; it stands again after a long run of one size, which lets rows
    the fit had priced out be tried again.
    """

    decay = 0.95
    min_passes = 8
    min_spread = 0.25  # weighted variance of rows - 1 below which the slope is not identifiable
    stall = 3.0  # a pass is counted at most this times its measured cost (a preemption must not drag the fit)

    def __init__(self) -> None:
        self.passes = 0
        self.sums = [0.0] * 7  # weighted sums of 1, x, x^2, y, x y, m, x m (x: rows - 1, y: seconds, m: measured)
        self.used = [0, 0.0, 0.0]  # passes decided with corrected costs, sums of their two scales (statistics)

    def add(self, rows: int, seconds: float, measured: float) -> None:
        """One verify pass over ``rows`` rows took ``seconds``; the measured curve says ``measured``."""
        x, y = rows - 1, min(seconds, self.stall * measured)
        terms = (1.0, x, x * x, y, x * y, measured, x * measured)
        self.sums = [self.decay * s + t for s, t in zip(self.sums, terms, strict=True)]
        self.passes += 1

    def fit(self) -> tuple[float, float, float, float] | None:
        """``(base, per_row, base_measured, per_row_measured)``: the weighted lines through the in-situ
        seconds and through the measured costs of the same rows, or None while the slope is unknown."""
        if self.passes < self.min_passes:
            return None
        _, sx, sxx, sy, sxy, sm, sxm = (s / self.sums[0] for s in self.sums)  # weighted means
        var = sxx - sx * sx
        if var < self.min_spread:
            return None
        per_row, per_row_m = (sxy - sx * sy) / var, (sxm - sx * sm) / var
        base, base_m = sy - per_row * sx, sm - per_row_m * sx
        if per_row < 0:  # rows cannot save time: the best flat line
            base, per_row = sy, 0.0
        base = max(base, 0.1 * sy)  # a one-row pass runs every weight once: never near free
        if base_m <= 0:
            return None
        return base, per_row, base_m, max(per_row_m, 0.02 * base_m)  # a flat curve: no slope to scale

    def scales(self) -> tuple[float, float] | None:
        """``(s0, s1)``: in-situ over measured, of a one-row pass and of a row's increment."""
        f = self.fit()
        return None if f is None else (f[0] / f[2], f[1] / f[3])

    def corrected(self, costs: TreeCosts) -> TreeCosts:
        """``costs`` with ``verify[k-1]`` as ``s0 verify[0] + s1 (verify[k-1] - verify[0])`` (the measured
        curve while unfitted), all in seconds. Draft levels and the start scale with ``s0`` as a one-row
        pass does: a level attends the same context and runs on the same (drifting) machine, and left
        as measured it would look cheaper than it is wherever passes grew dearer."""
        s = self.scales()
        if s is None:
            return costs
        self.used = [self.used[0] + 1, self.used[1] + s[0], self.used[2] + s[1]]
        v0 = costs.verify[0]
        verify = [s[0] * v0 + s[1] * (v - v0) for v in costs.verify]
        return TreeCosts([s[0] * d for d in costs.draft], verify, s[0] * costs.start)


#: the kinds of round a :class:`DraftLedger` keeps apart (indices): greedy without a copied chain, greedy with one, and
#: sampled (the server's requests at a temperature: chains accepted by speculative sampling, never copied)
ROUND_KINDS = ("greedy", "greedy, copied", "sampled")


class DraftLedger:
    """What drafting has bought, over a strategy's whole life (every answer it gives, and the processes before it:
    :meth:`save`), for each kind of round (:data:`ROUND_KINDS`): greedy with a copied chain proposed (prompt lookup or
    the answer store) or without, and sampled (never copied; its chains are accepted by another rule). A drafting
    round adds the tokens only the drafter's nodes gave (accepted nodes no copy proposed) for its marginal seconds: its
    wall clock less what a round of its kind that drafted nothing took with the rows the copies alone would have been
    given (a running mean per row count); every round adds what it gave, or would have given, without drafting.
    Drafting pays in a kind of round while its marginal tokens a second beat those rounds' own rate.

    Why: beside the copies the fast stream can cost more than it adds (SmolLM2-135M on a 2-vCPU Xeon: copies alone
    took 2.6-6.6% less time on MT-Bench 60 in seven runs; a drafting round with no copy gave 0.96 tokens per plain
    round's time, ``experiments/drafting_rounds.py``) or much less (Qwen2.5-Coder-0.5B: 1.51x against 1.28x), and
    that varies with the model, the machine and the threads. A per-answer choice by whole rounds' wall clock could
    not see a few-percent difference within one answer's 60-100 rounds (BENCHMARKS.md "Thirty-seventh round"); here
    the drafter's tokens are counts, its cost is taken against like rounds, and both accumulate across answers. The
    margin is the wall clock's, not the cost model's: priced by the fitted verify costs, the drafted rows and the
    call came to about half of what drafting rounds really took (the draft leaves the next pass's weights colder,
    and a tree's round does more work around its pass).

    The drafter's sums decay by ``drafted_decay`` per drafting round of their kind and the rounds' own by ``decay``
    per round, so the choice follows a drifting machine. One timing is never allowed to decide for long: a round
    moves the undrafted reference by at most what twice the reference would, and a drafting round's marginal seconds
    count between 0 and twice the reference. Unclipped, a few slow undrafted rounds (a profiler's pauses, another
    process) made every later drafting round look cheaper than nothing; the marginal seconds summed negative, and as
    the ledger then drafted nearly every round, too few undrafted rounds came to correct the reference (SmolLM2-135M
    drafted 18-24% of the paper suite's passes, BENCHMARKS.md "Forty-first round"). A kept ledger whose sums are
    negative is taken for damaged. Until ``trials`` drafting rounds of a kind are counted,
    every third round of it does not draft (the undrafted rounds' times are the reference); after, the choice that
    does not pay is taken every ``retry``-th round (which keeps both sides current), less often the further the two
    rates are apart (up to ``max_spread`` times: SmolLM2-135M's drafter beside a copy gave ~28 tokens a second against
    the rounds' own ~590, and each retry there only cost)."""

    decay = 0.998  # per round of the kind: the rounds' own rate
    drafted_decay = 0.99  # per drafting round of the kind: the drafter's tokens and seconds
    trials = 24
    retry = 32
    max_spread = 16  # the retries of a choice whose rate is k times the other's come k times rarer, up to this
    ref_decay = 0.9  # the running mean of undrafted rounds' seconds per kind and row count (about the last 10)

    def __init__(self) -> None:
        #: per kind (:data:`ROUND_KINDS`): [drafter tokens, marginal seconds, tokens without drafting, seconds without
        #: drafting]
        n = len(ROUND_KINDS)
        self.sums = [[0.0] * 4 for _ in range(n)]
        self.drafted = [0] * n  # drafting rounds recorded, per kind
        self.rounds = [0] * n  # rounds decided, per kind
        #: (kind, rows) -> running seconds of a round of that kind and rows that drafted nothing (per kind: a round
        #: with copies proposed but none verified is dearer than a plain one, and would flatter the drafter)
        self.undrafted: dict[tuple[int, int], float] = {}

    @classmethod
    def load(cls, path: Path | None) -> DraftLedger:
        """The ledger kept at ``path`` (:meth:`save`), or a fresh one where there is none or it is damaged."""
        ledger = cls()
        if path is None:
            return ledger
        try:
            raw = json.loads(path.read_text())
            sums = [[float(x) for x in kind] for kind in raw["sums"]]
            drafted, rounds = [int(x) for x in raw["drafted"]], [int(x) for x in raw["rounds"]]
            undrafted = {(int(k), int(r)): float(v) for k, r, v in raw["undrafted"]}
            n = len(ROUND_KINDS)
            if [len(k) for k in sums] != [4] * n or len(drafted) != n or len(rounds) != n:
                raise ValueError("wrong shape")
            if not all(math.isfinite(x) for x in [*itertools.chain(*sums), *undrafted.values()]):
                raise ValueError("not finite")
            if any(x < 0 for x in [*itertools.chain(*sums), *undrafted.values()]):
                raise ValueError("negative")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return ledger
        ledger.sums, ledger.drafted, ledger.rounds, ledger.undrafted = sums, drafted, rounds, undrafted
        return ledger

    def save(self, path: Path | None) -> None:
        """Keep the ledger at ``path`` (atomically; a read-only cache only costs the next process its trials): a
        one-shot ``m2r2 generate`` gives too few rounds to learn from, the answers before it did not."""
        if path is None:
            return
        undrafted = [[k, r, v] for (k, r), v in self.undrafted.items()]
        raw = {"sums": self.sums, "drafted": self.drafted, "rounds": self.rounds, "undrafted": undrafted}
        with contextlib.suppress(OSError):
            atomic_text(path, json.dumps(raw))

    def pays(self, kind: int) -> bool:
        """Whether a round of this kind drafts: every third round does not until ``trials`` drafting rounds have been
        counted, then the choice that pays, with the other taken every ``retry``-th round of the kind times how many
        times the better rate is the worse (at most ``max_spread``)."""
        self.rounds[kind] += 1
        if self.drafted[kind] < self.trials:
            return self.rounds[kind] % 3 != 0
        gain, extra, tokens, seconds = self.sums[kind]
        drafter, own = gain * seconds, tokens * extra  # the two rates, cross-multiplied
        low, high = sorted((drafter, own))
        spread = min(self.max_spread, high / low) if low > 0 else self.max_spread
        return (drafter >= own) != (self.rounds[kind] % round(self.retry * spread) == 0)

    def record(
        self, kind: int, tokens: int, seconds: float, rows: int, gain: int | None = None, alone: int = 1
    ) -> None:
        """A round of this kind emitted ``tokens`` in ``seconds`` over ``rows`` verify rows; if it drafted (``gain``
        not None), ``gain`` of the tokens came from the drafter's own nodes and the copies alone would have been
        given ``alone`` rows. A drafting round is only counted once an undrafted round of its kind and ``alone`` rows
        has been."""
        k, sums = kind, self.sums[kind]
        if gain is None:
            ref = self.undrafted.get((k, rows))
            if ref is not None:
                seconds = min(seconds, 2 * ref)
            self.undrafted[k, rows] = seconds if ref is None else self.ref_decay * ref + (1 - self.ref_decay) * seconds
        else:
            ref = self.undrafted.get((k, alone))
            if ref is None:
                return
            sums[0] = self.drafted_decay * sums[0] + gain
            sums[1] = self.drafted_decay * sums[1] + min(max(seconds - ref, 0.0), 2 * ref)
            tokens, seconds = tokens - gain, ref
            self.drafted[k] += 1
        sums[2] = self.decay * sums[2] + tokens
        sums[3] = self.decay * sums[3] + seconds


#: when a tree's drafter drafts: every round (while its wall-clock gain pays, :meth:`TreeSpeculative._worth_drafting`),
#: in the kinds of round where it has paid for its marginal time (``pays``, the default: :class:`DraftLedger`), only in
#: rounds where neither prompt lookup nor the answer store proposes a chain, or never (copies alone: what the drafter
#: adds beside them)
DRAFT_WHEN = ("always", "pays", "uncopied", "never")

#: how a tree prices prompt lookup's copied nodes: by their depth's hit rate among the sequence's copies of the same
#: match class and the same opinion of the answer store (``opinion``, the default: :data:`OPINION_PRIORS`), of the
#: same match class alone (``match``, as in the forty-second round: a long match, a split n-gram or another;
#: :data:`m2r2.decoding.lookup.LONG`) or among all its copies (``depth``, as until then)
COPY_PRICES = ("opinion", "match", "depth")
#: the hit-rate table ``copy_price="depth"`` prices every copy by (:attr:`TreeState.copies`' fourth, prior 1/2)
EVERY_MATCH = len(MATCH_PRIORS)
#: what the answer store says of a copied chain's first token, asked after the same context
AGREES, NO_OPINION, DIFFERS = 0, 1, 2
#: per match class (plain, split, long) and the store's opinion (agrees, none, differs): the hit rate a table starts
#: from at a chain's first depth and at the later ones. Replayed on MT-Bench 60's `vanilla` answers
#: (``experiments/copy_store_agreement.py``) the first copy was right in 0.87 / 0.68 / 0.49 of plain matches' rounds,
#: 0.64 / 0.47 / 0.35 of split ones', 0.99 / 0.93 / 0.92 of long ones'; the later copies (by the store's opinion of
#: each) 0.88 / 0.74 / 0.68, 0.89 / 0.88 / 0.81, 0.98 / 0.96 / 0.91
OPINION_PRIORS = (
    ((0.87, 0.88), (0.68, 0.74), (0.49, 0.68)),
    ((0.64, 0.89), (0.47, 0.88), (0.35, 0.81)),
    ((0.99, 0.98), (0.93, 0.96), (0.92, 0.91)),
)


def opinion_table(match: int, opinion: int) -> int:
    """Which of :attr:`TreeState.copies` prices a chain of this match class and store opinion (``opinion``)."""
    return EVERY_MATCH + 1 + 3 * match + opinion


#: where a sequence's answer-store calibration starts: replayed on MT-Bench answers, a store token was
#: right 0.6-0.8 times as often as its share says (experiments/answer_store_replay.out.txt)
ANSWER_CALIB = 0.75
#: ... and that of a store chain's later nodes, given their parent was accepted: in real generation a first node was
#: accepted about as often as its calibrated share said, the later ones 0.77 times as often as their shares said
#: (``experiments/waste_by_source.py``), so a chain's depths are calibrated apart
ANSWER_DEEPER = 0.78
#: how a sequence calibrates the answer store's chains: the first node and the later ones apart (``depth``, the
#: default) or one factor on the shares' products (``chain``, until the forty-third round)
STORE_CALIBS = ("depth", "chain")


def _calibrated(calib: float, offered: list[tuple[int, float]], path: list[int]) -> float:
    """A running calibration moved toward how many of ``offered`` (nodes with their predicted chances before it)
    were accepted (on ``path``) over how many it predicted."""
    hits = sum(1 for r, _ in offered if r in path)
    ratio = (hits + 0.1) / (sum(p for _, p in offered) + 0.1)
    return 0.9 * calib + 0.1 * min(1.5, ratio)


@dataclass
class TreeState:
    """One sequence's drafting state between rounds: the final slow state of its last verified
    position (the seed) and the running calibration of path probabilities, plus counts."""

    h_last: Tensor | None = None
    calib: float = 1.0
    gain: float = 1.0  # running tokens gained per drafting round (optimistic start: draft at first)
    cost: float = 0.0  # running extra cost of a drafting round, in one-token steps (measured: wall clock)
    step_s: float | None = None  # running wall-clock seconds of a plain round (the root alone, no drafting)
    idle: int = 0  # rounds since the last draft
    passes: int = 0
    rows: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_steps: int = 0
    draft_rounds: int = 0  # rounds whose drafter drafted
    context: NgramIndex | None = None  # prompt lookup: every token before the round's root
    #: prompt lookup's hit rates by depth: one table per match class (``copy_price="match"``), then one for every copy
    #: (``"depth"``)
    copies: list[LookupStats] = field(
        default_factory=lambda: [
            *(LookupStats(prior=p) for p in MATCH_PRIORS),
            LookupStats(),
            *(LookupStats(prior=first, deeper=later) for row in OPINION_PRIORS for first, later in row),
        ]
    )
    #: the answer store's chains: the first node's chance is this times its share, a later node's (given its parent)
    #: ``answer_deeper`` times its share
    answer_calib: float = ANSWER_CALIB
    answer_deeper: float = ANSWER_DEEPER
    copied_accepted: int = 0
    exits: int = 0  # lossy exits (``exit_threshold``): drafts accepted on the fast stream's confidence
    exits_agreed: int = 0  # ... whose token the full model would have chosen too
    overrides: int = 0  # ... accepted although the full model chose another token
    verify_fit: VerifyFit = field(default_factory=VerifyFit)  # in-situ verify costs (``online_costs``)


class TreeDrafter(Protocol):
    """What :class:`TreeSpeculative` drafts with: per tree level, the next-token draft distribution of
    each open node. A level's open nodes share one depth; a node whose parent is -1 (the root, or
    every node of a cost measurement) is drafted from the seed ``h_last``."""

    #: base layers one level runs (statistics); deepest level it can draft (Medusa: its head count)
    layers_per_level: int
    max_levels: int
    #: the module whose shape the measured costs depend on (:func:`m2r2.decoding.costs.cost_cache_path`)
    module: nn.Module

    def start(self, h_last: Tensor, cache: KVCache, verified: int) -> None:
        """Begin a tree after ``verified`` positions whose last final slow state is ``h_last`` ``[1, 1, d]``."""

    def top(self, tree: Tree, frontier: list[int], k: int) -> tuple[Tensor, Tensor]:
        """Greedy: the ``k`` most probable next tokens of each frontier node and their draft
        probabilities, ``[n, k]`` each, or ``[1, k]`` when every node gets the same."""

    def logits(self, tree: Tree, frontier: list[int]) -> Tensor:
        """Sampling: draft logits ``[n or 1, V]`` (float32, -inf outside the draft vocabulary)."""

    # Optional: a drafter with a memory of the sequence (EAGLE's own KV cache over verified features)
    # also defines ``observe(cache, feats, tokens, first)``. It then receives the verified pairs
    # ``(h_N(i), x_{i+1})`` for ``i = first..``: the prompt's after the prefill (``first`` 0) and,
    # after each verify pass, the accepted rows' final slow states with the tokens that follow them.


class SeededDrafter:
    """Tree levels from the seeded fast stream: one fast step over a level's open nodes, each seeded by
    its parent's fast state (the root by the last verified position's slow state) and attending the
    slow cache plus the fast K/V of its ancestors in the tree."""

    max_levels = 1 << 30

    def __init__(self, fast: SeededFastStream) -> None:
        self.fast = self.module = fast
        self.layers_per_level = fast.cfg.depth
        #: base layers whose outputs at the last verified position a tapped stream fuses into its seeds
        self.taps = fast.cfg.taps

    def start(self, h_last: Tensor, cache: KVCache, verified: int) -> None:
        """``h_last``: ``[1, 1, d]``, for a tapped stream ``[1, 1, (1 + len(taps)) d]`` (the final state,
        then the taps: :meth:`TreeSpeculative.seed_state`); a plain-width one (after the server's batched
        step, which keeps no layer outputs) seeds with zero taps until the next verify pass."""
        self.cache, self.verified = cache, verified
        d = self.fast.base.cfg.hidden_size
        state = h_last[0, 0]
        self.tap_feats = None
        if self.taps:
            n = len(self.taps)
            self.tap_feats = state[d:].view(n, d) if state.shape[0] > d else state.new_zeros(n, d)
        self.seeds: dict[int, Tensor] = {-1: state[:d]}  # node -> the fast state its children start from
        self.kv_rows: list[int] = []  # tree node of each fast K/V row so far (in the cache's free slots)

    def _level(
        self, tree: Tree, frontier: list[int], k: int | None = None
    ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """One fast step over a level's open nodes: their final fast states and, given ``k`` (greedy), their
        ``k`` best draft tokens and probabilities where one C++ call ran the whole level (else None)."""
        dev = self.fast.base.device
        rows = self.kv_rows + frontier
        vis = tree.ancestors(rows)[len(self.kv_rows) :]  # new rows over old + new fast keys
        positions = [self.verified + tree.depths[r] for r in frontier]
        tokens = [tree.tokens[r] for r in frontier]
        seeds = torch.stack([self.seeds[tree.parents[r]] for r in frontier])
        drafted = len(self.kv_rows)
        done = None
        if k is not None and not self.taps:
            done = self.fast.draft_top_fused(seeds, tokens, positions, self.cache, self.verified, drafted, vis, k)
        if done is not None:
            f, ids, probs = done
            top: tuple[Tensor, Tensor] | None = (ids, probs)
        else:
            taps = None if self.tap_feats is None else self.tap_feats.expand(1, len(frontier), *self.tap_feats.shape)
            states = self.fast.step(
                seeds[None],
                torch.tensor([tokens], device=dev),
                torch.tensor(positions, device=dev),
                self.cache,
                self.verified,
                drafted,
                vis.to(dev),
                taps,
            )
            f, top = states[-1][0], None
        self.kv_rows = rows
        self.seeds.update(zip(frontier, f, strict=True))
        return f, top

    def grow(self, h_last: Tensor, tok: int, cache: KVCache, verified: int, limits: TreeLimits) -> Tree | None:
        """The whole greedy tree under ``tok`` in one C++ call (:meth:`SeededFastStream.draft_tree_fused`), or None
        where that does not apply (then :meth:`TreeSpeculative.draft` runs the levels one by one through
        :meth:`top`: the same tree)."""
        if self.taps:
            return None
        grown = self.fast.draft_tree_fused(
            h_last.reshape(-1)[: self.fast.base.cfg.hidden_size], tok, cache, verified, limits
        )
        if grown is None:
            return None
        tree = Tree([tok], [-1], [0], [1.0], [None])
        for t, p, score in zip(*grown, strict=True):
            tree.add(t, p, score)
        return tree

    def top(self, tree: Tree, frontier: list[int], k: int) -> tuple[Tensor, Tensor]:
        f, top = self._level(tree, frontier, k)
        return top if top is not None else self.fast.draft_top(f, k)

    def logits(self, tree: Tree, frontier: list[int]) -> Tensor:
        return self.fast.draft_logits(self._level(tree, frontier)[0])


class TreeSpeculative:
    """Lossless speculative decoding drafting token trees with a :class:`TreeDrafter` (a
    :class:`SeededFastStream` is drafted with :class:`SeededDrafter`); lossy exits with ``exit_threshold``."""

    def __init__(
        self,
        name: str,
        model: Transformer,
        drafter: TreeDrafter | SeededFastStream,
        eos_ids: list[int],
        decode: object = None,
        max_nodes: int = 8,
        max_depth: int = 5,
        width: int = 2,
        branch: int = 2,
        costs: TreeCosts | None = None,
        lookup: int = 0,
        exit_threshold: float | None = None,
        answers: AnswerStore | None = None,
        online_costs: bool = True,
        draft: str = "pays",
        copy_price: str = "opinion",
        store_calib: str = "depth",
    ) -> None:
        limit = min(CACHE_SLACK, ROW_INVARIANT_MAX_ROWS) - 1
        if not 1 <= max_nodes <= limit:
            raise SettingsError(f"max_nodes must be in 1..{limit}, got {max_nodes}")
        for opt, val in (("max_depth", max_depth), ("width", width), ("branch", branch)):
            if not 1 <= val <= limit:
                raise SettingsError(f"{opt} must be in 1..{limit}, got {val}")
        if not 0 <= lookup <= limit:
            raise SettingsError(f"lookup must be in 0..{limit} (0 = off), got {lookup}")
        if draft not in DRAFT_WHEN:
            raise SettingsError(f"draft must be one of {', '.join(DRAFT_WHEN)}, got {draft!r}")
        if copy_price not in COPY_PRICES:
            raise SettingsError(f"copy_price must be one of {', '.join(COPY_PRICES)}, got {copy_price!r}")
        if store_calib not in STORE_CALIBS:
            raise SettingsError(f"store_calib must be one of {', '.join(STORE_CALIBS)}, got {store_calib!r}")
        if isinstance(drafter, SeededFastStream):
            drafter = SeededDrafter(drafter)
        self.name, self.model, self.drafter, self.eos_ids, self.decode = name, model, drafter, eos_ids, decode
        self.max_nodes, self.max_depth, self.width, self.branch = max_nodes, max_depth, width, branch
        self.costs, self.lookup, self.answers = costs, lookup, answers
        #: correct the measured verify costs by each sequence's own verify passes (:class:`VerifyFit`)
        self.online_costs = online_costs
        #: when the drafter drafts (:data:`DRAFT_WHEN`); ``pays``: where the ledger says it has paid, over every answer
        self.draft_when, self.ledger = draft, DraftLedger()
        #: how copied nodes are priced (:data:`COPY_PRICES`), the answer store's calibrated (:data:`STORE_CALIBS`)
        self.copy_price, self.store_calib = copy_price, store_calib
        #: base layers whose outputs the drafter fuses into its seeds (a tapped seeded stream), else []
        self.taps: list[int] = list(getattr(drafter, "taps", []))
        #: lossy dynamic compute (``m2r2-dynamic``): a draft whose own probability reaches this exits at the
        #: fast stream (is kept even where the full model disagrees); None or >= 1: lossless
        self.exit_threshold = exit_threshold if exit_threshold is not None and exit_threshold < 1 else None
        self.last_cache: KVCache | None = None
        #: where ``costs`` are cached (:func:`m2r2.decoding.costs.cached_costs`), to drop when a sequence shows
        #: them timed on a busier machine (:func:`m2r2.decoding.costs.drop_loaded_costs`); None: not cached
        self.cost_file: Path | None = None
        #: where ``ledger`` is kept between processes (:meth:`DraftLedger.save`); None: not kept
        self.ledger_file: Path | None = None

    def seed_state(self, h: Tensor, layers: list[Tensor] | None, i: int) -> Tensor:
        """What the next tree starts from, for row ``i`` of a pass's final states ``h`` ``[1, T, d]``: that
        row's state ``[1, 1, d]``, followed for a tapped drafter by the row's outputs of its tap layers
        (``layers``: every block's output of the pass)."""
        row = [h[:, i : i + 1]]
        if self.taps:
            assert layers is not None
            row += [layers[j][:, i : i + 1] for j in self.taps]
        return torch.cat(row, dim=-1) if len(row) > 1 else row[0]

    # ---- drafting -------------------------------------------------------------------------------
    def draft(
        self,
        h_last: Tensor,
        tok: int,
        cache: KVCache,
        room: int,
        gen: GenerationConfig,
        calib: float = 1.0,
        costs: TreeCosts | None = None,
    ) -> Tree:
        """Grow a tree under ``tok`` (node 0) for at most ``room`` nodes besides the root.

        With costs (the sequence's, :meth:`costs_for`; by default the measured ones), a level is only
        drafted while its best open node's calibrated path probability exceeds what one more draft step
        and one more verify row cost (in steps): deeper drafts would not pay for themselves.
        """
        costs = self.costs if costs is None else costs
        greedy = gen.greedy
        width, branch = (self.width, self.branch) if greedy else (1, 1)
        # a seeded drafter keeps each level's fast K/V in the cache's free slots: 1 + width per later level
        free = cache.max_len - cache.length
        depth_cap = min(self.max_depth, room, self.drafter.max_levels, 1 + (free - 1) // width)
        grow = getattr(self.drafter, "grow", None)
        if greedy and grow is not None:  # the whole tree in one C++ call where the drafter has one
            level_cost = self._level_cost(costs) if costs is not None else 0.0
            limits = TreeLimits(depth_cap, width, branch, self.max_nodes * 2, calib, level_cost)
            grown = grow(h_last, tok, cache, cache.length, limits)
            if grown is not None:
                return grown
        tree = Tree([tok], [-1], [0], [1.0], [None])
        self.drafter.start(h_last, cache, cache.length)
        frontier = [0]
        for _ in range(depth_cap):
            n = len(frontier)
            if greedy:
                top_ids, top_p = (t.expand(n, -1) for t in self.drafter.top(tree, frontier, branch))
            else:
                q = warp_probs(self.drafter.logits(tree, frontier), gen).expand(n, -1)
            cands: list[tuple[float, int, int, int]] = []  # (path probability, frontier row, token, parent)
            for i, r in enumerate(frontier):
                if greedy:
                    for p, t in zip(top_p[i].tolist(), top_ids[i].tolist(), strict=True):
                        cands.append((tree.scores[r] * p, i, t, r))
                else:
                    t = int(torch.multinomial(q[i], 1, generator=self._rng))
                    cands.append((tree.scores[r] * float(q[i, t]), i, t, r))
            cands.sort(key=lambda c: -c[0])
            new = [tree.add(t, r, score, None if greedy else q[i]) for score, i, t, r in cands]
            frontier = new[:width]
            if not frontier or len(tree.tokens) - 1 >= self.max_nodes * 2:
                break
            if greedy and costs is not None and calib * tree.scores[frontier[0]] < self._level_cost(costs):
                break
        return tree

    def choose(
        self, tree: Tree, room: int, calib: float, draft_steps: int, costs: TreeCosts | None = None
    ) -> list[int]:
        """Tree rows to verify: the root plus the most probable nodes, as many as maximise the expected
        tokens per second under ``costs`` (the sequence's, :meth:`costs_for`; by default the measured
        ones). The top-n set by path probability is closed under ancestors: a child's probability never
        exceeds its parent's, and a stable sort keeps a parent, created first, ahead on ties."""
        order = sorted(range(1, len(tree.tokens)), key=lambda r: -tree.value(r, calib))[: min(self.max_nodes, room)]
        c = self.costs if costs is None else costs
        if c is None:
            return [0, *sorted(order)]
        # drafting already spent (it scales every rate); a round of copies alone spent nothing
        draft_s = (c.start + draft_steps * c.draft[min(self.width, len(c.draft)) - 1]) if draft_steps else 0.0
        best_n, best_rate, gain = 0, 1.0 / (draft_s + c.verify[0]), 0.0
        for n, r in enumerate(order, start=1):
            gain += tree.value(r, calib)
            if n >= len(c.verify):
                break
            rate = (1.0 + gain) / (draft_s + c.verify[n])
            if rate > best_rate:
                best_n, best_rate = n, rate
        return [0, *sorted(order[:best_n])]

    # ---- the loop -------------------------------------------------------------------------------
    #: the server's scheduler starts every sequence's running acceptance here (unused by trees)
    prior_accept = 1.0

    def costs_for(self, state: TreeState) -> TreeCosts | None:
        """The costs a round of ``state``'s sequence decides with: the measured ones, corrected by its
        own verify passes (:class:`VerifyFit`) unless ``online_costs`` is off."""
        if self.costs is None or not self.online_costs:
            return self.costs
        return state.verify_fit.corrected(self.costs)

    def make_drafter(self, cache: KVCache) -> TreeState:
        """Per-sequence drafting state; ``h_last`` is set from the prefill (or a batched step). A store whose
        shares were calibrated on held-out answers (:meth:`AnswerStore.build_calibrated`) starts its sequences'
        calibrations at 1: its shares already say how often a follower is right."""
        if getattr(self.answers, "calibrated", False):  # (any object with ``propose`` can serve as a store)
            return TreeState(answer_calib=1.0, answer_deeper=1.0)
        return TreeState()

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        gen: GenerationConfig,
        stream: StreamCallback | None = None,
        session: Conversation | None = None,
    ) -> GenerationResult:
        if self.exit_threshold is not None and not gen.greedy:
            raise SettingsError(f"{self.name} decodes greedily only (temperature 0); it is lossy by design")
        model = self.model
        hidden: list[Tensor] = []
        layers: list[Tensor] | None = [] if self.taps else None
        earlier = session.cache if session is not None else None
        t0, stopper, cache, logits = begin(
            model,
            prompt,
            gen,
            self.eos_ids,
            self.decode,  # type: ignore[arg-type]
            hidden,
            layers=layers,
            session=session,
        )
        sampler = Sampler(gen, model.device)
        self.last_cache = cache
        state = self.make_drafter(cache)
        state.h_last = self.seed_state(hidden[1], layers, hidden[1].shape[1] - 1)
        self.prefilled(state, cache, hidden[1], prompt, earlier)
        tok = sampler(logits[0, -1])
        emitted = [tok]
        while True:
            kept = stopper.push(emitted)
            if kept and stream is not None:
                stream(emitted[:kept])
            if stopper.done:
                break
            emitted, *_ = self.round(state, cache, tok, stopper, 1.0, gen, sampler)
            tok = emitted[-1]
        ntok = max(len(stopper.tokens), 1)
        passes, fit = state.passes, state.verify_fit
        n_layers = model.cfg.num_layers
        scale_base = fit.used[1] / fit.used[0] if fit.used[0] else None  # the online correction, as it decided
        drop_loaded_costs(self.cost_file, scale_base, fit.used[0])
        if self.draft_when == "pays":
            self.ledger.save(self.ledger_file)
        return GenerationResult(
            tokens=stopper.tokens,
            seconds=time.perf_counter() - t0,
            stop_reason=str(stopper.reason),
            prompt_tokens=len(prompt),
            stats={
                "verify_passes": passes,
                "mean_accepted": (state.accepted + passes) / passes if passes else 0.0,
                "acceptance_rate": state.accepted / state.drafted if state.drafted else 0.0,
                "verify_rows_per_pass": state.rows / passes if passes else 0.0,
                "verify_passes_per_token": passes / ntok,
                "copied_accepted_per_token": state.copied_accepted / ntok,
                "draft_layers_per_token": state.draft_steps * self.drafter.layers_per_level / ntok,
                "drafting_share": state.draft_rounds / passes if passes else 0.0,
                **(
                    {  # as the pending-completion exits report them (m2r2.decoding.dynamic)
                        "exit_rate": state.exits / ntok,
                        "exits": state.exits,
                        "overrides_per_token": state.overrides / ntok,
                        "exit_precision": state.exits_agreed / state.exits if state.exits else None,
                    }
                    if self.exit_threshold is not None
                    else {}
                ),
                "layers_per_token": (passes * n_layers + state.draft_steps * self.drafter.layers_per_level) / ntok,
                **(
                    {
                        "draft_cost": self.costs.draft[0] / self.costs.verify[0],
                        "draft_start_cost": self.costs.start / self.costs.verify[0],
                        "verify_cost": [v / self.costs.verify[0] for v in self.costs.verify],
                    }
                    if self.costs is not None
                    else {}
                ),
                **(
                    {  # the online correction of the verify costs, averaged over the passes it decided
                        "verify_scale_base": scale_base,
                        "verify_scale_row": fit.used[2] / fit.used[0] if fit.used[0] else None,
                        "verify_scaled_share": fit.used[0] / passes if passes else 0.0,
                    }
                    if self.costs is not None and self.online_costs
                    else {}
                ),
            },
        )

    def round(
        self,
        state: TreeState,
        cache: KVCache,
        tok: int,
        stopper: Stopper,
        accept_rate: float,
        gen: GenerationConfig,
        sampler: Sampler,
    ) -> tuple[list[int], int, int, float]:
        """One draft-and-verify round after ``tok`` (the newest token, not yet in ``cache``), whose
        previous position's final slow state is ``state.h_last``.

        Returns the emitted tokens (accepted drafts, then the slow model's next token, again not in
        the cache), drafts accepted and verified, and ``accept_rate`` unchanged (trees calibrate in
        ``state``). The same signature as :meth:`SelfSpeculative.round`: the server interleaves rounds
        of either with batched steps.
        """
        model = self.model
        self._rng = sampler.rng
        started = time.perf_counter()
        verified = cache.length
        room = min(stopper.budget - len(stopper.tokens) - 1, cache.max_len - verified - 1, self.max_nodes)
        rows, steps = [0], 0
        costs = self.costs_for(state)
        tree = Tree([tok], [-1], [0], [1.0], [None])
        looked_chain: list[int] = []  # prompt lookup's proposal, else the answer store's (with its shares)
        stored_chain: tuple[list[int], list[float]] = ([], [])
        k = 0  # copied tokens a chain may offer
        match = EVERY_MATCH  # the hit rates' table of lookup's chain (:data:`COPY_PRICES`)
        if state.context is not None:  # prompt lookup: the root joins the context, its continuation is proposed
            state.context.extend([tok])
            k = min(self.lookup, room) if gen.greedy else 0
            looked_chain = state.context.propose(room) if k > 0 else []
            cls = state.context.match_class() if looked_chain and self.copy_price != "depth" else PLAIN
            if cls != LONG:
                looked_chain = looked_chain[:k]
            if looked_chain:
                match = self._copy_table(state.context, cls, looked_chain)
            if k > 0 and self.answers is not None and not looked_chain:  # the model's phrasing
                stored_chain = self.answers.propose(state.context.tokens, k)
        copied = bool(looked_chain or stored_chain[0])
        kind = int(copied) if gen.greedy else 2  # ROUND_KINDS (a sampled round is never copied)
        drafting = room > 0 and self._draft_now(state, kind)
        if drafting:
            tree = self.draft(state.h_last, tok, cache, room, gen, state.calib, costs)
            steps = max(tree.depths)
            state.draft_steps += steps
            state.draft_rounds += 1
        looked, stored = self._copy_in(tree, state, looked_chain, stored_chain, match, self.store_calib)
        if len(tree.tokens) > 1:
            rows = self.choose(tree, room, state.calib, steps, costs) if gen.greedy else self._chain(tree, room)
        n_rows = len(rows)
        verify_started = time.perf_counter()
        tokens = [tree.tokens[r] for r in rows]
        layers: list[Tensor] | None = [] if self.taps else None
        positions = mask = None
        if n_rows > 1 and not _is_chain(tree, rows):
            positions = torch.tensor([verified + tree.depths[r] for r in rows], device=model.device)
            vis = tree.ancestors(rows)
            mask = torch.cat([torch.ones(n_rows, verified, dtype=torch.bool), vis], dim=1).to(model.device)
        if gen.greedy and layers is None:
            out, h = greedy_verify(model, tokens, cache, verified, positions, mask)
        else:
            x = model.embed_tokens(torch.tensor([tokens], device=model.device))
            h = model.run_layers(x, cache, verified, layers, positions=positions, mask=mask)
            out = head_argmax(model, h)[0] if gen.greedy else model.head(h)[0]
        if self.online_costs and self.costs is not None and gen.greedy:  # as measured: a greedy pass
            measured = self.costs.verify[min(n_rows, len(self.costs.verify)) - 1]
            state.verify_fit.add(n_rows, time.perf_counter() - verify_started, measured)
        lossy = self.exit_threshold if gen.greedy else None  # sampled requests (the server's) stay exact
        path, nxt = self._accept(tree, rows, out, gen, sampler, lossy)
        n = len(path) - 1
        if lossy is not None:
            self._count_exits(state, tree, rows, path, out)
        offered = [r for r in looked if r in rows]
        if offered:  # the copied chain's rows are a prefix of it (ancestor-closed); count its depths
            state.copies[match].record(len(offered), sum(1 for r in offered if r in path))
        offered_store = [(r, p) for r, p in stored if r in rows]
        if self.store_calib == "chain":  # one calibration of the shares' products, over every offered node
            first, later = offered_store, []
        else:
            first = [(r, p) for r, p in offered_store if tree.depths[r] == 1]
            later = [(r, p) for r, p in offered_store if tree.depths[r] > 1 and tree.parents[r] in path]
        if first:  # calibrate the store's shares against how many of its offered nodes were accepted: the first
            state.answer_calib = _calibrated(state.answer_calib, first, path)
        if later:  # ... and, apart, the later ones whose parent was
            state.answer_deeper = _calibrated(state.answer_deeper, later, path)
        copied_on_path = sum(1 for r in path[1:] if r in tree.copy_probs)
        state.copied_accepted += copied_on_path
        displaced = 0  # of the drafter's tokens, those the next round's copy would have given had this one not drafted
        if drafting and n and not copied_on_path and self.draft_when == "pays":  # (a sampled round offers k = 0)
            displaced = self._copied_after(state, [*(tree.tokens[r] for r in path[1:]), nxt], k)
        if state.context is not None:
            state.context.extend([tree.tokens[r] for r in path[1:]])
        predicted = sum(tree.scores[r] for r in rows[1:])
        if predicted > 0:  # calibrate the drafter's path probabilities against what of it was accepted
            drafted_hits = sum(1 for r in path[1:] if tree.scores[r] > 0)
            state.calib = 0.9 * state.calib + 0.1 * min(4.0, (drafted_hits + 0.1) / (predicted + 0.1))
        state.passes += 1
        state.rows += n_rows
        state.drafted += n_rows - 1
        state.accepted += n
        cache.keep([verified + rows.index(r) for r in path], verified)
        observe = getattr(self.drafter, "observe", None)
        if observe is not None:  # the verified pairs: (h_N(verified - 1), tok), then each accepted node's
            idx = torch.tensor([rows.index(r) for r in path[:-1]], dtype=torch.long, device=h.device)
            feats = torch.cat([state.h_last.reshape(1, -1), h[0].index_select(0, idx)])
            observe(cache, feats, [tree.tokens[r] for r in path], verified - 1)
        state.h_last = self.seed_state(h, layers, rows.index(path[-1]))
        seconds = time.perf_counter() - started
        self._account(state, seconds, n, n_rows, steps)
        if self.draft_when == "pays" and room > 0:
            if drafting:  # the drafter's own accepted nodes, and the rows the copies alone would have been given
                alone = Tree([tok], [-1], [0], [1.0], [None])
                self._copy_in(alone, state, looked_chain, stored_chain, match, self.store_calib)
                n_alone = len(self.choose(alone, room, state.calib, 0, costs)) if len(alone.tokens) > 1 else 1
                gain = sum(1 for r in path[1:] if r not in tree.copy_probs) - displaced
                self.ledger.record(kind, n + 1, seconds, n_rows, gain, n_alone)
            else:
                self.ledger.record(kind, n + 1, seconds, n_rows)
        return [*[tree.tokens[r] for r in path[1:]], nxt], n, n_rows - 1, accept_rate

    @staticmethod
    def _copy_in(
        tree: Tree,
        state: TreeState,
        looked_chain: list[int],
        stored_chain: tuple[list[int], list[float]],
        match: int = PLAIN,
        store_calib: str = "depth",
    ) -> tuple[list[int], list[tuple[int, float]]]:
        """Add a round's copied chain to ``tree``: prompt lookup's (priced by the hit rates by depth of its match
        class, ``match``), else the answer store's (each node as sure as its share, calibrated per sequence: the first
        node's and, given their parent, the later ones' apart; ``store_calib="chain"``: one calibration times the
        shares' product). Returns lookup's nodes and the store's, each with what its calibration scales (its share;
        under ``chain`` the shares' product up to it)."""
        if looked_chain:
            return tree.add_copies(looked_chain, state.copies[match].path_probs(len(looked_chain))), []
        if not stored_chain[0]:
            return [], []
        chain, shares = stored_chain
        deeper = state.answer_deeper if store_calib == "depth" else 1.0
        calib = [state.answer_calib, *[deeper] * (len(shares) - 1)]
        sure = list(itertools.accumulate((min(1.0, c * p) for c, p in zip(calib, shares, strict=True)), operator.mul))
        nodes = tree.add_copies(chain, sure)
        scaled = shares if store_calib == "depth" else list(itertools.accumulate(shares, operator.mul))
        return [], list(zip(nodes, scaled, strict=True))

    def _copy_table(self, context: NgramIndex, match: int, chain: list[int]) -> int:
        """Which of :attr:`TreeState.copies` prices prompt lookup's ``chain`` (of match class ``match``), as
        ``copy_price`` says: the table of every copy, that of its match class, or that of its match class and what the
        answer store proposes after the same context (its first token the chain's, another, or none)."""
        if self.copy_price == "depth":
            return EVERY_MATCH
        if self.copy_price == "match":
            return match
        own = self.answers.propose(context.tokens, 1)[0] if self.answers is not None else []
        return opinion_table(match, NO_OPINION if not own else AGREES if own[0] == chain[0] else DIFFERS)

    def _copied_after(self, state: TreeState, emitted: list[int], k: int) -> int:
        """How many of ``emitted[1:]`` (a round's accepted drafts after the first, then its next token) the copy
        proposed after ``emitted[0]`` alone would have matched: prompt lookup's, else the answer store's.

        Why: had the round not drafted it would have emitted ``emitted[0]`` only, and where the next round's copy
        carries on from there the drafter's later tokens cost that round nothing; credited anyway, the ledger
        overstated the drafter (MT-Bench, SmolLM2-135M: a fifth of the tokens drafted in rounds without copies,
        ``experiments/draft_displacement.py``)."""
        if state.context is None or k <= 0:
            return 0
        chain = state.context.propose_after(emitted[0], k)
        if not chain and self.answers is not None:
            chain = self.answers.propose([*state.context.tokens[-ORDERS[0] :], emitted[0]], k)[0]  # its n-grams' tail
        same = 0
        for want, got in zip(emitted[1:], chain, strict=False):
            if want != got:
                break
            same += 1
        return same

    def _draft_now(self, state: TreeState, kind: int) -> bool:
        """Whether a round of this kind (:data:`ROUND_KINDS`; 1: prompt lookup or the answer store proposes a chain)
        drafts, as :data:`DRAFT_WHEN` says."""
        when = self.draft_when
        if when == "never" or (when == "uncopied" and kind == 1):
            return False
        if when == "pays":
            return self.ledger.pays(kind)
        return self._worth_drafting(state)

    def _count_exits(
        self, state: TreeState, tree: Tree, rows: list[int], path: list[int], out: Tensor | list[int]
    ) -> None:
        """Exits on ``path``: drafts at or above the threshold, and whether the full model agreed."""
        assert self.exit_threshold is not None
        target = out if isinstance(out, list) else out.tolist()
        for parent, r in itertools.pairwise(path):
            agreed = tree.tokens[r] == target[rows.index(parent)]
            if tree.own(r) >= self.exit_threshold:
                state.exits += 1
                state.exits_agreed += agreed
            state.overrides += not agreed

    def _account(self, state: TreeState, seconds: float, gained: int, n_rows: int, steps: int) -> None:
        """What this round gained (tokens beyond the one a plain step gives) and cost (in plain rounds),
        by the wall clock: the cost model times the layers of a draft level and a verify pass, but not
        a round's own work around them (growing and choosing the tree, gathering keys for tree rows,
        compacting the cache: 0.06-0.14 of a step per pass on the bundled model, BENCHMARKS.md "Fifth
        round"); a drafter that gains less than a round really costs stops drafting
        (:meth:`_worth_drafting`). A plain round's time is learnt from the rounds that drafted nothing
        (until one has run, the measured one-token pass)."""
        if self.costs is None:
            return
        if n_rows == 1 and not steps:
            state.step_s = seconds if state.step_s is None else 0.8 * state.step_s + 0.2 * seconds
        elif steps:
            spent = seconds / (state.step_s or self.costs.verify[0])
            state.gain = 0.8 * state.gain + 0.2 * gained
            state.cost = 0.8 * state.cost + 0.2 * (spent - 1.0)

    def prefilled(
        self, state: TreeState, cache: KVCache, h: Tensor, prompt: list[int], earlier: KVCache | None = None
    ) -> None:
        """After the prompt's prefill: prompt lookup indexes the prompt; a drafter with its own memory of
        verified states (EAGLE) sees every prefilled position's final slow state ``h`` ``[1, n, d]`` (the
        prompt's last ``n``) with the token after it, after carrying over its memory of the positions
        taken from a conversation's ``earlier`` cache."""
        if self.lookup:
            state.context = NgramIndex(prompt)
        first = len(prompt) - h.shape[1]
        carry = getattr(self.drafter, "carry", None)
        if first and carry is not None and earlier is not None:
            carry(earlier, cache, first)
        observe = getattr(self.drafter, "observe", None)
        if observe is not None:
            observe(cache, h[0, :-1], prompt[first + 1 :], first)

    def stepped(self, state: TreeState, cache: KVCache, tok: int, h: Tensor) -> None:
        """A plain step (the server's batched decoding) put ``tok`` in ``cache`` and produced its final
        slow state ``h``: the drafter's memory gets the pair (previous state, ``tok``), the seed moves on."""
        observe = getattr(self.drafter, "observe", None)
        if observe is not None and state.h_last is not None:
            observe(cache, state.h_last.reshape(1, -1), [tok], cache.length - 2)
        if state.context is not None:
            state.context.extend([tok])
        state.h_last = h

    def _level_cost(self, costs: TreeCosts | None = None) -> float:
        """One more draft level plus one more verify row, in one-token steps (of ``costs``, by default
        the measured ones)."""
        c = self.costs if costs is None else costs
        assert c is not None
        extra_row = (c.verify[1] - c.verify[0]) if len(c.verify) > 1 else 0.0
        return (c.draft[min(self.width, len(c.draft)) - 1] + extra_row) / c.verify[0]

    def _worth_drafting(self, state: TreeState) -> bool:
        """Draft when recent rounds gained more tokens than drafting and verifying them cost (in steps);
        after 8 rounds without drafting, draft once more to keep the estimate current."""
        if self.costs is None:
            return True
        if state.gain >= state.cost or state.idle >= 8:
            state.idle = 0
            return True
        state.idle += 1
        return False

    def _chain(self, tree: Tree, room: int) -> list[int]:
        rows, r = [0], 0
        while len(rows) <= room:
            kids = [i for i, p in enumerate(tree.parents) if p == r]
            if not kids:
                break
            r = kids[0]
            rows.append(r)
        return rows

    @staticmethod
    def _accept(
        tree: Tree,
        rows: list[int],
        out: Tensor | list[int],
        gen: GenerationConfig,
        sampler: Sampler,
        exit_threshold: float | None = None,
    ) -> tuple[list[int], int]:
        """Accepted path (tree nodes from the root) and the slow model's token after it.

        ``out``: per verify row, the greedy token (greedy) or the logits (sampling). With an
        ``exit_threshold`` (greedy only), where no child matches the full model's token, the most
        probable child whose own draft probability reaches it is accepted all the same (a lossy exit);
        the rows below it were computed on it, so the full model's tokens there still hold.
        """
        index = {r: i for i, r in enumerate(rows)}
        children: dict[int, list[int]] = {}
        for r in rows[1:]:
            children.setdefault(tree.parents[r], []).append(r)
        path = [0]
        if gen.greedy:  # ``out`` holds each row's argmax token (a list from the fused pass)
            target = out if isinstance(out, list) else out.tolist()
            while True:
                want = target[index[path[-1]]]
                kids = children.get(path[-1], [])
                nxt = next((c for c in kids if tree.tokens[c] == want), None)
                if nxt is None and exit_threshold is not None and kids:
                    best = max(kids, key=tree.own)
                    nxt = best if tree.own(best) >= exit_threshold else None
                if nxt is None:
                    return path, int(want)
                path.append(nxt)
        p = warp_probs(out, gen)
        rng = sampler.rng
        while True:  # a chain: speculative sampling, accept with min(1, p/q), else resample the residual
            i = index[path[-1]]
            kids = children.get(path[-1], [])
            if not kids:
                return path, int(torch.multinomial(p[i], 1, generator=rng))
            c = kids[0]
            q, d = tree.probs[c], tree.tokens[c]
            if float(torch.rand((), generator=rng)) * float(q[d]) < float(p[i, d]):
                path.append(c)
                continue
            residual = (p[i] - q).clamp_min(0)
            total = float(residual.sum())
            return path, int(torch.multinomial(residual / total if total > 0 else p[i], 1, generator=rng))


def greedy_verify(
    model: Transformer,
    tokens: list[int],
    cache: KVCache,
    pos: int,
    positions: Tensor | None = None,
    mask: Tensor | None = None,
) -> tuple[list[int] | Tensor, Tensor]:
    """A greedy verify pass of ``tokens`` at cache slots ``pos..``: each row's token (a list, or a tensor off the
    fused path) and the rows' final states ``[1, T, d]``. One C++ call where the kernel has it
    (:meth:`Transformer.greedy_pass`), else the layers and the certified head argmax: the same tokens either way."""
    fused = model.greedy_pass(tokens, cache, pos, positions, mask)
    if fused is not None:
        return fused
    x = model.embed_tokens(torch.tensor([tokens], device=model.device))
    h = model.run_layers(x, cache, pos, positions=positions, mask=mask)
    return head_argmax(model, h)[0], h


def _is_chain(tree: Tree, rows: list[int]) -> bool:
    return all(tree.parents[r] == rows[i] for i, r in enumerate(rows[1:]))


#: the depth of the deepest trees that :func:`measure_tree_costs` times for a drafter that grows whole trees
DEEP = 4


def measure_tree_costs(model: Transformer, drafter: TreeDrafter, k_max: int, repeats: int = 15) -> TreeCosts:
    """Time a drafter's start, its levels over 1..4 open nodes and greedy slow passes (certified head
    argmax, as a greedy verify runs) over 1..k_max+1 rows at a 128-token context. A drafter that grows a
    whole tree in one call (``grow``) is timed that way, each tree right after a one-row slow pass as in
    generation: a level over r open nodes is the slope from one-level trees to trees of ``DEEP`` levels whose
    later levels have r; its start is a one-level tree less one level (what a tree's first level pays for
    its weights coming from further away, and the call).

    Interleaved rounds, minimum kept (so a burst of other load cannot make one look cheap). A level
    is timed after a start (its K/V restart there) and the start's own time is taken off. Fifteen
    rounds, not five: after one five-round measurement Medusa drafted 1.84 tokens per pass on
    MT-Bench, after others 2.26-2.33 (the shapes follow the costs for a whole run; BENCHMARKS.md,
    ninth round).
    """
    ctx = 128
    cache = model.new_cache(ctx + k_max + 2)
    dev = model.device
    ids = torch.arange(ctx, device=dev)[None] % model.cfg.vocab_size
    h = torch.zeros(1, 1, model.cfg.hidden_size, dtype=model.dtype, device=dev)

    def timed(f: Callable[[], object], after_pass: bool = False) -> Callable[[], float]:
        """``f``'s seconds, after a one-row slow pass when ``after_pass`` (a draft follows a verify pass, which
        leaves the drafter's weights out of the nearer caches)."""

        def run() -> float:
            if after_pass:
                greedy_verify(model, [1], cache, ctx)
            t = time.perf_counter()
            f()
            return time.perf_counter() - t

        return run

    grow = getattr(drafter, "grow", None)
    tree_cache = model.new_cache(ctx + 4 * DEEP + 2)  # room for the fast K/V of the deepest trees timed
    with torch.inference_mode():
        whole = grow is not None and grow(h, 1, tree_cache, ctx, TreeLimits(1, 2, 2, 64)) is not None
    if whole:  # trees in one call, of 1 and DEEP levels whose later levels have r open nodes
        assert grow is not None
        limits = [TreeLimits(d, r, max(2, r), 64) for d in (1, DEEP) for r in range(1, 5)]
        calls = [timed(lambda lim=lim: grow(h, 1, tree_cache, ctx, lim), after_pass=True) for lim in limits]
    else:
        calls = [timed(lambda: drafter.start(h, cache, ctx))]
        for r in range(1, 5):
            tree = Tree([1] * r, [-1] * r, [0] * r, [1.0] * r)  # r open nodes drafted from the seed

            def level(tree=tree, r=r) -> None:
                drafter.start(h, cache, ctx)
                drafter.top(tree, list(range(r)), 2)

            calls.append(timed(level))
    drafting = len(calls)
    for k in range(1, k_max + 2):
        calls.append(timed(lambda k=k: greedy_verify(model, [1] * k, cache, ctx)))
    best = [math.inf] * len(calls)
    with torch.inference_mode():
        model(ids, cache, 0, last_only=True)
        model(ids, tree_cache, 0, last_only=True)
        for f in calls:
            f()
        for _ in range(repeats):
            for i, f in enumerate(calls):
                best[i] = min(best[i], f())
    if whole:  # a level: the slope from 1 to DEEP levels; the start: a one-level tree of width 2 less its level
        draft = [max((best[4 + i] - best[i]) / (DEEP - 1), 1e-6) for i in range(4)]
        return TreeCosts(draft=draft, verify=best[drafting:], start=max(best[1] - draft[1], 0.0))
    start = best[0]
    draft = [max(b - start, 1e-6) for b in best[1:5]]
    return TreeCosts(draft=draft, verify=best[drafting:], start=start)


def _tree_costs(raw: dict[str, object]) -> TreeCosts:
    draft, verify = raw["draft"], raw["verify"]
    costs = TreeCosts([float(x) for x in draft], [float(x) for x in verify], float(raw.get("start", 0.0)))  # type: ignore[union-attr]
    if not (costs.draft and costs.verify and min(costs.draft + costs.verify) > 0 and costs.start >= 0):
        raise ValueError("non-positive cost")
    check_verify_curve(costs.verify)
    return costs


def build_tree_speculative(
    name: str,
    engine: Loaded,
    drafter: TreeDrafter,
    adaptive: bool = True,
    cost_cache: bool = True,
    max_nodes: int = 8,
    max_depth: int = 5,
    width: int = 2,
    branch: int = 2,
    lookup: int = 0,
    exit_threshold: float | None = None,
    answers: str | None = None,
    online_costs: bool = True,
    draft: str = "pays",
    copy_price: str = "opinion",
    store_calib: str = "depth",
) -> TreeSpeculative:
    """A :class:`TreeSpeculative` drafting with ``drafter`` (in its inference form) and measured costs
    (``adaptive``; kept per machine and drafter shape in ``$M2R2_CACHE/costs`` for a day when ``cost_cache``;
    corrected by each sequence's own verify passes when ``online_costs``, :class:`VerifyFit`), plus up to
    ``lookup`` tokens of prompt lookup per round (0 = off; a long match's chain up to the round's room, unless
    ``copy_price="depth"``; :mod:`m2r2.decoding.lookup`), lossy exits at
    ``exit_threshold`` (None = lossless)."""
    model = engine.model
    costs, path = None, None
    if adaptive:

        def measure() -> TreeCosts:
            return measure_tree_costs(model, drafter, max_nodes)

        path = cost_cache_path(engine, drafter.module, max_nodes)
        path = path.with_name(f"tree-{path.name}")
        costs = cached_costs(path, measure, _tree_costs) if cost_cache else measure()
    tok = engine.tokenizer
    store = answer_store_for(engine.fingerprint, answers) if lookup else None
    tree = (max_nodes, max_depth, width, branch, costs, lookup, exit_threshold, store, online_costs, draft, copy_price)
    spec = TreeSpeculative(name, model, drafter, tok.eos_ids, tok.decode, *tree, store_calib=store_calib)
    spec.cost_file = path if cost_cache else None
    if path is not None and cost_cache:  # what drafting has bought here, kept beside the costs it was bought at
        spec.ledger_file = path.with_name(f"ledger-{path.name}")
        spec.ledger = DraftLedger.load(spec.ledger_file)
    return spec
