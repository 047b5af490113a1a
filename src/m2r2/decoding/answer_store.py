"""An answer store: the base model's own phrasing, and a corpus's, as a third source of tree nodes beside
the drafter and prompt lookup (retrieval drafting in the manner of REST, He et al. 2024).

Why (measured, BENCHMARKS.md "Thirteenth round"): a 135M model's greedy answers reuse their phrasing
across prompts ("Here are some ...", list scaffolding, closing lines). An n-gram table of its answers
to *training* prompts proposes the next few tokens at no drafting cost: for each 4-, 3- and 2-gram
seen at least ``min_count`` times, the token that most often followed it and its *share* of what
followed (how sure the table is); a proposal follows the longest n-gram that ends the context, token
after token. The share predicts acceptance (replayed on MT-Bench answers: right 0.75-0.91 of the time
where it is >= 0.9, 0.02-0.31 where it is < 0.3; BENCHMARKS.md "Fourteenth round"), so the tree weighs
each proposed node by the product of the shares along its chain, calibrated per sequence, and the
verifier's cost model spends rows only where a chain is likely to hold. Greedy only, like prompt
lookup; outputs stay the plain greedy ones (every node is verified).

REST's own datastore is human/assistant text, not the model's: the training corpus's assistant turns
(~5M tokens, several times the own answers) also count (``m2r2 answer-store --corpus``), each own
answer weighing ``--own-weight`` times, and a store built from own answers can be laid *over* it
(:meth:`AnswerStore.over`: its followers win where it has any). Replayed on MT-Bench answers this
adds tokens where the own answers have nothing (BENCHMARKS.md "Twenty-third round"), and it gives a
model with no own answers yet a store at all.

Built by ``m2r2 answer-store`` from ``distill-data`` files and/or conversations; stored as a bound
weight file (``NAME.safetensors`` + ``NAME.json``: base model fingerprint, checksum), refused for
another model.
"""

from __future__ import annotations

import array
import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from m2r2 import weightfile
from m2r2.errors import InputError, SettingsError

KIND = weightfile.Kind(
    format="m2r2-answer-store",
    name="answer store",
    title="an m2r2 answer store config",
    trains="`m2r2 answer-store --data ANSWERS.jsonl`",
    none_shipped="no answer store ships for this base model; build one with `m2r2 answer-store`",
)
VERSION = 2  # 2: follower shares stored beside the followers
#: n-gram orders, longest first: a proposal follows the longest that ends the context
ORDERS = (4, 3, 2)


#: a follower's share of what followed its n-gram is stored in 8 bits (k / 255)
SHARE_STEPS = 255
MASK64 = (1 << 64) - 1
#: a key's bucket is the top bits of key * HASH modulo 2^64 (Fibonacci hashing)
HASH = 0x9E3779B97F4A7C15
#: calibration cells (:func:`calibrate`): an n-gram's order, its follower's share in tenths and how often it was seen,
#: in the bins [1] (kept with --min-count 1), [2], [3, 4], [5, 9], [10, 19], [20, 49], [50, ...)
SHARE_BINS = 10
SEEN_EDGES = (1, 2, 3, 5, 10, 20, 50)
#: a cell's held-out hit rate is pulled towards each entry's own share by this many pseudo-tries
CALIB_PRIOR = 10


class AnswerStore:
    """Per order n: the kept n-grams (rows of ``grams[n]``), each one's most frequent follower
    ``next[n]`` and that follower's share of the n-gram's followers (``share[n]``, k / 255).

    Why arrays and not a dict: a store that also holds the corpus's responses keeps ~1.3M n-grams; as
    Python tuples that is ~450 MB and 2 s to load, as arrays 13 MB and no time. A lookup packs the
    n-gram into a 64-bit key (16 bits a token: exact below 65,536 ids; wider ids wrap, and the row is
    compared before it is used) and reads its bucket: the rows sorted by a hash of the key, ``starts``
    where each of ~n/2 buckets begins. In generation a binary search over the sorted keys (17 probes
    into a megabyte the model's weights had just pushed out of the caches) took 11 us a lookup and a
    proposal ~6 lookups, 2% of a round on a fast 2-vCPU Xeon; a bucket is 2-3 reads."""

    def __init__(
        self,
        grams: dict[int, np.ndarray],
        nxt: dict[int, np.ndarray],
        share: dict[int, np.ndarray],
        calibrated: bool = False,
    ) -> None:
        #: whether the shares are held-out hit rates (:meth:`build_calibrated`) rather than counts' ratios
        self.calibrated = calibrated
        self.grams, self.next, self.share, self._lookup = {}, {}, {}, {}
        for n in ORDERS:
            g = np.asarray(grams.get(n, np.zeros((0, n))), dtype=np.int64).reshape(-1, n)
            keys = _keys(g)
            bits = max(1, len(keys).bit_length() - 1)  # about two rows a bucket
            bucket = (keys * np.uint64(HASH)) >> np.uint64(64 - bits)  # the product wraps modulo 2^64
            order = np.lexsort((keys, bucket))
            self.grams[n] = g[order]
            self.next[n] = np.asarray(nxt.get(n, np.zeros(0)), dtype=np.int64)[order]
            self.share[n] = np.asarray(share.get(n, np.zeros(0)), dtype=np.uint8)[order]
            starts = np.searchsorted(bucket[order], np.arange((1 << bits) + 1, dtype=np.uint64)).astype(np.int64)
            # what a lookup reads, as flat arrays whose items come out as Python ints (a numpy scalar costs ~0.5 us)
            self._lookup[n] = (
                64 - bits,
                array.array("Q", keys[order].tobytes()),
                array.array("q", starts.tobytes()),
                array.array("q", self.next[n].tobytes()),
                self.share[n].tobytes(),
                bool(((g >= 0) & (g < 1 << 16)).all()),  # every key exact: no rows to compare
            )

    @classmethod
    def build(cls, answers: list[list[int]], min_count: int = 2) -> AnswerStore:
        if min_count < 1:
            raise SettingsError(f"min_count must be >= 1, got {min_count}")
        return cls.from_tensors(_tables(answers, min_count))

    @classmethod
    def build_calibrated(
        cls,
        answers: list[list[int]],
        every: int,
        min_count: int = 2,
        weight: int = 1,
        extra: list[list[int]] | None = None,
    ) -> tuple[AnswerStore, dict[str, object]]:
        """:meth:`build` over ``answers`` (each counted ``weight`` times) and ``extra`` text, each follower's share
        replaced by how often a follower of its kind was right on own answers the counts did not see.

        Why: a share is a count's ratio, and counts of 2 or 3 overstate it. Replayed on the model's MT-Bench answers, a
        4-gram's follower with a share >= 0.9 was right 0.93 of the time where the 4-gram had been seen 20+ times and
        0.70 where 2-4 times; a 2-gram's 0.80 and 0.46 (``experiments/store_runner_up.py``); the tree prices a store
        chain by its shares, so a share that says how likely the token is spends its verify rows better. Every
        ``every``-th answer is held out, the rest (and ``extra``) counted, and the held-out answers replayed:
        :func:`calibrate` bins each prediction by its n-gram's order, share and support. The store itself then counts
        everything. Returns the store and what the calibration saw (its cells' tries and hits)."""
        extra = extra or []
        check_hold_out(every, len(answers))
        held = answers[::every]
        fit = [a for i, a in enumerate(answers) if i % every]
        tries, hits = _replay_cells(_tables(fit * weight + extra, min_count), held)
        tables = _tables(answers * weight + extra, min_count)
        calibrate(tables, tries, hits)
        cells = [
            {
                "order": n,
                "share": f"{s / SHARE_BINS:.1f}",
                "seen": f">={SEEN_EDGES[b]}",
                "tries": int(t),
                "hits": int(h),
            }
            for (n, s, b), t, h in zip(_cell_names(), tries.tolist(), hits.tolist(), strict=True)
            if t
        ]
        summary = {
            "held_out_answers": len(held),
            "predicted": int(tries.sum()),
            "hits": int(hits.sum()),
            "cells": cells,
        }
        return cls.from_tensors(tables, calibrated=True), summary

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], calibrated: bool = False) -> AnswerStore:
        grams, nxt, shares = {}, {}, {}
        for n in ORDERS:
            g, x, share = (tensors.get(f"{key}{n}") for key in ("grams", "next", "share"))
            if g is None or x is None or g.dim() != 2 or g.shape[1] != n or len(g) != len(x):
                raise InputError(f"answer store tensors grams{n}/next{n} are missing or malformed")
            if share is None or share.shape != x.shape:
                raise InputError(
                    "this answer store has no follower shares (built by an older m2r2): rebuild it with "
                    "`m2r2 answer-store`"
                )
            grams[n], nxt[n], shares[n] = _widen(g).numpy(), _widen(x).numpy(), share.numpy()
        return cls(grams, nxt, shares, calibrated)

    def to_tensors(self) -> dict[str, Tensor]:
        """Token ids as int16 bit patterns where every id fits 16 bits (half the file), else int32."""
        out = {}
        for n in ORDERS:
            out[f"grams{n}"] = torch.from_numpy(self.grams[n].astype(np.int32))
            out[f"next{n}"] = torch.from_numpy(self.next[n].astype(np.int32))
        if all(t.numel() == 0 or (int(t.max()) < 1 << 16 and int(t.min()) >= 0) for t in out.values()):
            out = {k: (t - (t >= 1 << 15).int() * (1 << 16)).to(torch.int16) for k, t in out.items()}
        return out | {f"share{n}": torch.from_numpy(self.share[n].copy()) for n in ORDERS}

    def over(self, other: AnswerStore) -> AnswerStore:
        """This store's n-grams, then ``other``'s where this one has none (e.g. the model's own answers
        over the corpus's responses: its own phrasing decides wherever it has any). Calibrated only where both
        are."""
        grams, nxt, share = {}, {}, {}
        for n in ORDERS:
            g = np.concatenate([self.grams[n], other.grams[n]])
            _, first = np.unique(g, axis=0, return_index=True)  # the first occurrence: this store's
            grams[n], nxt[n] = g[first], np.concatenate([self.next[n], other.next[n]])[first]
            share[n] = np.concatenate([self.share[n], other.share[n]])[first]
        return AnswerStore(grams, nxt, share, self.calibrated and other.calibrated)

    def __len__(self) -> int:
        return sum(len(g) for g in self.grams.values())

    def get(self, gram: tuple[int, ...]) -> tuple[int, float] | None:
        """The kept follower of ``gram`` and its share, or None."""
        n = len(gram)
        if n not in self._lookup:
            return None
        shift, keys, starts, nxt, share, exact = self._lookup[n]
        key = 0
        for t in gram:
            key = ((key << 16) + t) & MASK64
            exact = exact and 0 <= t < 1 << 16
        b = ((key * HASH) & MASK64) >> shift
        for i in range(starts[b], starts[b + 1]):
            if keys[i] == key and (exact or tuple(self.grams[n][i].tolist()) == tuple(gram)):
                return nxt[i], share[i] / SHARE_STEPS
        return None

    def entries(self) -> dict[tuple[int, ...], tuple[int, float]]:
        """Every kept n-gram with its follower and share (for tests and inspection)."""
        return {
            tuple(g): (int(x), int(s) / SHARE_STEPS)
            for n in ORDERS
            for g, x, s in zip(self.grams[n].tolist(), self.next[n].tolist(), self.share[n].tolist(), strict=True)
        }

    def propose(self, context: list[int], k: int) -> tuple[list[int], list[float]]:
        """Up to ``k`` tokens, each the most frequent follower of the longest n-gram ending the context
        (extended by the tokens proposed so far), and each one's share of its n-gram's followers."""
        tail, out, shares = list(context[-ORDERS[0] :]), [], []
        for _ in range(k):
            hit = None
            for n in ORDERS:
                if len(tail) >= n and (hit := self.get(tuple(tail[-n:]))) is not None:
                    break
            if hit is None:
                break
            out.append(hit[0])
            shares.append(hit[1])
            tail = [*tail[1:], hit[0]]
        return out, shares


def _keys(grams: np.ndarray) -> np.ndarray:
    """64-bit keys of n-gram rows: 16 bits a token, wrapping (as :meth:`AnswerStore.get` packs them)."""
    keys = np.zeros(len(grams), dtype=np.uint64)
    for j in range(grams.shape[1]):
        keys = (keys << np.uint64(16)) + grams[:, j].astype(np.uint64)
    return keys


def check_hold_out(every: int, answers: int, name: str = "every") -> None:
    """Refuse a calibration stride (``name``: the argument as its caller spells it) that leaves no answer to hold out
    or none to count: one check for :meth:`AnswerStore.build_calibrated` and for the CLI, which asks before it loads
    a model."""
    if every < 2 or answers < every:
        raise SettingsError(
            f"{name} {every}: calibration holds out every Nth own answer, so it needs N >= 2 and at least N answers "
            f"({answers})"
        )


def _cell_of(order: int, share: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """Calibration cell ids of entries of one order (shares in 8 bits, ``seen`` their n-grams' counts)."""
    share_bin = np.minimum(share.astype(np.int64) * SHARE_BINS // (SHARE_STEPS + 1), SHARE_BINS - 1)
    seen_bin = np.searchsorted(np.asarray(SEEN_EDGES), seen, side="right") - 1  # a kept n-gram was seen once at least
    return (ORDERS.index(order) * SHARE_BINS + share_bin) * len(SEEN_EDGES) + seen_bin


def _cell_names() -> list[tuple[int, int, int]]:
    """(order, share tenth, seen bin) of each calibration cell id, in id order."""
    return [(n, s, b) for n in ORDERS for s in range(SHARE_BINS) for b in range(len(SEEN_EDGES))]


def _replay_cells(tables: dict[str, Tensor], held: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per calibration cell: how many positions of the ``held`` answers a store of ``tables`` predicts by an entry
    of that cell (the longest n-gram ending before the position, as :meth:`AnswerStore.propose` reads it) and how
    many of those predictions are the answer's token. Keys wrap above 65,535 ids as a lookup's do: a rare
    collision only blurs a count."""
    size = len(ORDERS) * SHARE_BINS * len(SEEN_EDGES)
    tries, hits = np.zeros(size, dtype=np.int64), np.zeros(size, dtype=np.int64)
    sorted_keys = {}  # order -> its n-grams' keys sorted, and the entries in that order
    for n in ORDERS:
        keys = _keys(tables[f"grams{n}"].numpy().astype(np.int64))
        order = np.argsort(keys, kind="stable")
        sorted_keys[n] = (keys[order], order)
    for a in held:
        ids = np.asarray(a, dtype=np.int64)
        todo = np.arange(ORDERS[-1], len(ids))  # positions with an n-gram of the shortest order before them
        for n in ORDERS:
            keys, order = sorted_keys[n]
            at = todo[todo >= n]
            if not len(at) or not len(keys):
                continue
            probe = _keys(np.stack([ids[at - n + j] for j in range(n)], axis=1))
            slot = np.minimum(np.searchsorted(keys, probe), len(keys) - 1)
            found = keys[slot] == probe
            entry = order[slot[found]]
            cells = _cell_of(n, tables[f"share{n}"].numpy()[entry], tables[f"seen{n}"].numpy()[entry])
            np.add.at(tries, cells, 1)
            np.add.at(hits, cells, (tables[f"next{n}"].numpy()[entry] == ids[at[found]]).astype(np.int64))
            todo = np.setdiff1d(todo, at[found], assume_unique=True)
    return tries, hits


def calibrate(tables: dict[str, Tensor], tries: np.ndarray, hits: np.ndarray) -> None:
    """Replace ``tables``' shares (in place) by their cells' held-out hit rates, each pulled towards the entry's own
    share by :data:`CALIB_PRIOR` pseudo-tries (a cell the held-out answers rarely reach keeps about its shares)."""
    for n in ORDERS:
        share = tables[f"share{n}"].numpy().astype(np.float64) / SHARE_STEPS
        cells = _cell_of(n, tables[f"share{n}"].numpy(), tables[f"seen{n}"].numpy())
        rate = (hits[cells] + CALIB_PRIOR * share) / (tries[cells] + CALIB_PRIOR)
        tables[f"share{n}"] = torch.from_numpy((rate * SHARE_STEPS).round().astype(np.uint8))


def _widen(ids: Tensor) -> Tensor:
    """Token ids stored as int16 bit patterns (ids up to 65,535) back to their values."""
    return ids.to(torch.int32) & 0xFFFF if ids.dtype == torch.int16 else ids


def _tables(answers: list[list[int]], min_count: int) -> dict[str, Tensor]:
    """Per order n: every (n-gram, next) pair of ``answers`` counted, and per n-gram the follower seen
    most often (ties: the smaller token id), kept where it was seen at least ``min_count`` times, with
    its share of all the n-gram's followers in 8 bits and how often the n-gram was seen (``seen{n}``: what
    :func:`calibrate` bins by; not saved)."""
    out = {}
    for n in ORDERS:
        rows = [torch.tensor(a, dtype=torch.long).unfold(0, n + 1, 1) for a in answers if len(a) > n]
        if not rows:
            out[f"grams{n}"], out[f"next{n}"] = torch.zeros(0, n, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
            out[f"share{n}"], out[f"seen{n}"] = torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.int64)
            continue
        pairs, counts = torch.unique(torch.cat(rows), dim=0, return_counts=True)  # sorted by (n-gram, next)
        new_gram = torch.ones(len(pairs), dtype=torch.bool)
        new_gram[1:] = (pairs[1:, :n] != pairs[:-1, :n]).any(dim=1)
        group = new_gram.cumsum(0)
        # within each n-gram's run, the pair with the highest count (stable: the smaller id on ties)
        order = torch.sort(-counts, stable=True).indices
        order = order[torch.sort(group[order], stable=True).indices]
        first = torch.ones(len(order), dtype=torch.bool)
        first[1:] = group[order][1:] != group[order][:-1]
        best = order[first]
        best = best[counts[best] >= min_count]
        totals = torch.zeros(int(group[-1]) + 1, dtype=counts.dtype).index_add_(0, group, counts)
        share = counts[best].double() / totals[group[best]].double()
        out[f"grams{n}"] = pairs[best, :n].to(torch.int32).contiguous()
        out[f"next{n}"] = pairs[best, n].to(torch.int32).contiguous()
        out[f"share{n}"] = (share * SHARE_STEPS).round().to(torch.uint8)
        out[f"seen{n}"] = totals[group[best]]
    return out


def read_answers(paths: list[Path]) -> list[list[int]]:
    """``answer_ids`` of ``m2r2 distill-data`` files (the base model's own answers to training prompts)."""
    from m2r2.paths import refuse_eval

    answers = []
    for path in paths:
        refuse_eval(path)
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise InputError(f"cannot read answers {path}: {e}") from e
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["answer_ids"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise InputError(f"{path}:{i + 1}: not a distill-data record (no answer_ids)") from None
            answers.append([int(t) for t in ids])
    if not answers:
        raise InputError("no answers in " + ", ".join(map(str, paths)))
    return answers


def save_answer_store(path: Path, store: AnswerStore, fingerprint: str, **info: object) -> Path:
    sizes = {str(n): len(g) for n, g in store.grams.items()}
    config = {"orders": list(ORDERS), "shares": "calibrated" if store.calibrated else "counted"}
    return weightfile.save(path, store.to_tensors(), KIND, fingerprint, VERSION, config, entries=sizes, **info)


def load_answer_store(path: Path, fingerprint: str) -> AnswerStore:
    tensors, meta = weightfile.load(Path(path), KIND, fingerprint)
    return AnswerStore.from_tensors(tensors, calibrated=meta.get("config", {}).get("shares") == "calibrated")


def answer_store_for(fingerprint: str, answers: str | None) -> AnswerStore | None:
    """A tree method's ``answers`` option: None = the store shipped for this base model (if any),
    ``none`` = off, else a store file."""
    if answers is not None and answers.lower() in ("none", "off", "0"):
        return None
    path = Path(answers) if answers else weightfile.bundled(KIND, fingerprint)
    return load_answer_store(path, fingerprint) if path is not None else None
