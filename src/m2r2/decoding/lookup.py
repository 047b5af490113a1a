"""Prompt lookup as a second source of tree nodes: the continuation of the latest earlier occurrence
of the context's last n-gram, verified in the same pass as the fast stream's tree.

Why (measured, BENCHMARKS.md): the fast stream agrees with the full model on about a third of tokens,
but answers often repeat what the context already holds (a rewrite of the previous turn, names and
phrases of the question, code identifiers). There a copy is right for several tokens in a row at no
drafting cost; where it is wrong it costs only the verify rows the cost model chose to spend on it.
Each depth's chance of being right is learnt per sequence (:class:`LookupStats`), so the verifier's
cost model weighs copied nodes against the fast stream's by how often each was accepted.

Greedy only: a copied token has no draft distribution, and a tree of them would need its own exact
acceptance rule under sampling; sampled requests draft with the fast stream alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Copied tokens per round that the tree drafters (``m2r2``, ``m2r2-dynamic``, ``medusa``, ``eagle``)
#: offer by default (``lookup=0`` turns it off).
DEFAULT_LOOKUP = 6

#: What a proposal's match says of it (:meth:`NgramIndex.match_class`): an n-gram whose earlier occurrences were
#: followed by different tokens (``SPLIT``); a match that runs ``LONG_MATCH`` or more tokens back (``LONG``); any other
#: (``PLAIN``). Replayed over MT-Bench 60's greedy answers (``experiments/copy_by_match.py``) the first copied token was
#: right in 0.91-0.96 of the rounds after a match of 8+ tokens, 0.12-0.27 after a split 2-gram, 0.52-0.66 otherwise.
PLAIN, SPLIT, LONG = 0, 1, 2
LONG_MATCH = 8
#: each class's starting hit rate for every depth (:class:`LookupStats`'s prior, worth two rounds): a plain chain's the
#: 1/2 every chain started at until now, a split one's lower, a long one's near its measured rate (in real generation on
#: MT-Bench first turns the first copy was right in 0.62 / 0.43 / 0.89 of the rounds, ``experiments/copy_classes.py``;
#: a plain prior of 0.6 verified more rows than it won)
MATCH_PRIORS = (0.5, 0.3, 0.9)


class NgramIndex:
    """The token context, indexed so that a proposal costs a few dict lookups whatever its length: for
    each n-gram of ``min_n..max_n`` tokens, where its latest occurrence ended. A proposal follows the
    longest n-gram that ends the context and also occurred earlier (most recent occurrence first)."""

    def __init__(self, tokens: list[int] | None = None, max_n: int = 3, min_n: int = 2) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its latest occurrence
        self.earlier: dict[int, int] = {}  # n -> where the final n-gram occurred before (if it did)
        self.split: set[tuple[int, ...]] = set()  # n-grams two of whose occurrences were followed by different tokens
        self.extend(tokens or [])

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            for n, start in self.earlier.items():  # the final n-grams, now followed by t: as at their last occurrence?
                if self.tokens[start] != t:
                    self.split.add(tuple(self.tokens[len(self.tokens) - n :]))
            self.tokens.append(t)
            end = len(self.tokens)
            self.earlier = {}
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(self.tokens[end - n :])
                before = self.ends.get(key)
                if before is not None:
                    self.earlier[n] = before
                self.ends[key] = end

    def _match(self) -> tuple[int, int] | None:
        """The longest final n-gram that occurred earlier: its size, and where its latest earlier occurrence ended."""
        return next(((n, self.earlier[n]) for n in range(self.max_n, self.min_n - 1, -1) if n in self.earlier), None)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the context's final n-gram."""
        match = self._match()
        return [] if match is None else self.tokens[match[1] : match[1] + k]

    def match_class(self) -> int:
        """What :meth:`propose`'s match says of its proposal: ``SPLIT``, ``LONG`` or ``PLAIN`` (:data:`MATCH_PRIORS`;
        ``PLAIN`` where nothing is proposed). A match is as long as the occurrence's tokens before it agree with the
        context's, counted back up to ``LONG_MATCH``."""
        match = self._match()
        if match is None:
            return PLAIN
        (n, start), end = match, len(self.tokens)
        if tuple(self.tokens[end - n :]) in self.split:
            return SPLIT
        m = n
        while m < LONG_MATCH and m < start and self.tokens[start - 1 - m] == self.tokens[end - 1 - m]:
            m += 1
        return LONG if m >= LONG_MATCH else PLAIN

    def propose_after(self, token: int, k: int) -> list[int]:
        """What :meth:`propose` would give once ``token`` is appended, without appending it (what the next round
        would have been offered had this one emitted only ``token``)."""
        end = len(self.tokens)
        for n in range(min(self.max_n, end + 1), self.min_n - 1, -1):
            start = self.ends.get((*self.tokens[end - n + 1 :], token))
            if start is not None:
                chain = self.tokens[start : start + k]
                if len(chain) < k and start + len(chain) == end:  # the occurrence runs into the token itself
                    chain.append(token)
                return chain
        return []


@dataclass
class LookupStats:
    """How often a copied token at each depth of a proposal was accepted, given its parent was: the
    path probability of a copied node at depth d is the product of these rates up to d. A Beta prior
    worth two rounds starts the first depth at ``prior`` (1/2 unless a match class says otherwise:
    :data:`MATCH_PRIORS`) and every later one at ``deeper`` (the same by default: a copy whose parent was
    right is right more often than the chain's first); the counts are per sequence (a rewrite request
    copies a lot, a story little)."""

    hits: list[float] = field(default_factory=list)
    tries: list[float] = field(default_factory=list)
    prior: float = 0.5
    deeper: float | None = None

    def path_probs(self, depth: int) -> list[float]:
        self._grow(depth)
        out, p = [], 1.0
        for d in range(depth):
            prior = self.prior if d == 0 or self.deeper is None else self.deeper
            p *= (self.hits[d] + 2.0 * prior) / (self.tries[d] + 2.0)
            out.append(p)
        return out

    def record(self, offered: int, accepted: int) -> None:
        """``offered`` copied tokens of one chain were verified; its first ``accepted`` matched."""
        self._grow(offered)
        for d in range(min(offered, accepted + 1)):  # depths past the first miss were not really tried
            self.tries[d] += 1.0
            self.hits[d] += 1.0 if d < accepted else 0.0

    def _grow(self, depth: int) -> None:
        while len(self.hits) < depth:
            self.hits.append(0.0)
            self.tries.append(0.0)
