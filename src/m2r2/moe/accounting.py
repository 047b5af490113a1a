"""Prefetch accounting: what one generation's expert fetches met, and how its predictions scored."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any


class Accounting:
    """What one generation's fetches met (hits, late, misses, stalls) and how its predictions scored.

    Counts and stall seconds are kept per phase (prefill, decode); a decode-step prediction is
    scored when its layer runs, per source and lookahead distance (layers between prediction and use).
    """

    def __init__(self) -> None:
        self.counts: dict[str, Counter[str]] = defaultdict(Counter)
        self.stall_s: Counter[str] = Counter()
        self.preds: dict[int, list[tuple[str, int, set[int]]]] = defaultdict(list)  # need time -> predictions
        self.scores: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0])  # tp, predicted, actual
        self.issued: set[tuple[int, str]] = set()
        self.decode_start: dict[str, int] | None = None  # loader totals when decoding started

    def predicted(self, need: int, source: str, distance: int, ids: list[int]) -> None:
        """A decode-step prediction (the first per need time and source counts)."""
        if (need, source) not in self.issued:
            self.issued.add((need, source))
            self.preds[need].append((source, distance, set(ids)))

    def score(self, now: int, ids: list[int]) -> None:
        """Score the predictions made for time ``now`` against the experts actually used."""
        actual = set(ids)
        for source, dist, pred in self.preds.pop(now, []):
            s = self.scores[(source, dist)]
            s[0] += len(pred & actual)
            s[1] += len(pred)
            s[2] += len(actual)
        for t in [t for t in self.preds if t < now]:
            del self.preds[t]

    def report(self, loader_totals: dict[str, int]) -> dict[str, Any]:
        """Counts, stall seconds and prediction scores of this generation."""
        pr: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
        for (source, dist), (tp, npred, nact) in sorted(self.scores.items()):
            pr[source][str(dist)] = {
                "precision": tp / npred if npred else 0.0,
                "recall": tp / nact if nact else 0.0,
                "predicted": npred,
                "actual": nact,
                "correct": tp,
            }
        return {
            "counts": {k: dict(v) for k, v in self.counts.items()},
            "stall_s": dict(self.stall_s),
            "prediction": dict(pr),
            "decode_start": self.decode_start or loader_totals,
        }
