"""Prefetch policies: each is the :class:`~m2r2.model.ExpertSource` every MoE layer of the model fetches from.

All policies share one :class:`ExpertCache` and one :class:`Loader`; they differ only in what they
predict, and so in what they ask the loader to copy ahead of time:

* ``on-demand``: nothing; an expert is copied when its layer's router asks for it (LRU cache,
  Mixtral-offloading style).
* ``next-gate``: at layer i, layer i+1's router (after its ``mlp_norm``) is applied to the current
  residual and its top-k are prefetched one layer ahead (Pre-gated MoE / AdapMoE style).
* ``m2r2``: the M2R2 fast stream runs in lockstep with the slow stream, one fast layer alongside
  each slow layer; fast layer j approximates ``h_{R*j}``, so the routers of the layers it reaches
  (0-based ``R*j-R .. R*j-1``, shifted by ``offset``) applied to its state predict their experts
  several layers ahead. Layers not predicted in time (and, with ``refine``, every layer) also get
  the next-gate prediction one layer ahead. The fast stream's own MoE layers use **cache-only
  routing**: their source (:class:`CacheOnly`) returns only experts already resident, and the MoE
  drops the others' terms, so the predictor never causes a copy or a stall. Lockstep makes this
  cheap: fast layer j runs base layer j-1 just after the slow stream fetched that layer's experts.
  With ``overlap`` (default), when the slow stream is about to stall on a copy, the fast layer runs
  *during* the stall instead (its compute is then hidden; the experts still in flight are dropped
  from it, like any non-resident one). Prefill (many rows) runs no fast stream: next-gate only.
  ``depth`` (default :data:`DEFAULT_FAST_DEPTH`) caps the fast layers run per step; layers beyond
  their reach get the next-gate prediction only.
  ``fast_experts="none"`` (default) drops the routed experts from the fast layers altogether
  (attention + shared expert only): on the MoEfied SmolLM2 that predicts as well (hit rate 0.82 /
  0.86 at 25% / 50% cache either way) for about a third less fast-stream compute; ``"cache"`` uses the
  resident ones.
  ``load_top`` = m copies only the m most probable of a fast prediction's k experts (default
  ceil(k/2); all k are still claimed, so the resident ones stay): far predictions are less precise,
  and a wrong copy costs bandwidth and a slot (measured: same hit rate, ~25% fewer bytes than m = k).
* ``oracle``: the routing of the same generation recorded beforehand (an all-resident run: greedy
  output, hence routing, is identical); every expert needed within the next ``horizon`` layers is
  requested with its exact need time: the upper bound.

Every request carries a *need time* (``step * num_layers + layer``): the loader serves the most
urgent first, and the cache never evicts an expert claimed by a prediction for an earlier time to
make room for a prefetch (eviction rule in :mod:`m2r2.moe.cache`); ``on-demand`` makes no
predictions, so its cache is plain LRU.

Accounting (per phase, prefill or decode): every expert the slow stream asks for is a *hit*
(resident and copied at the time of the call), *late* (requested or in flight, not finished) or a
*miss*; stall time is the time a fetch waited. Decode-step predictions are scored when their layer
runs: precision and recall per lookahead distance (layers between prediction and use) and source.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, defaultdict
from typing import Any

import torch
from torch import Tensor

from m2r2.cache import KVCache
from m2r2.errors import M2R2Error, SettingsError
from m2r2.model import MoE, Transformer
from m2r2.moe.cache import ExpertCache, Key
from m2r2.moe.loader import Loader
from m2r2.multirate.fast import FastStream, draft_mask, fast_layer

#: Fast layers the ``m2r2`` policy runs per step. Measured on the MoEfied SmolLM2 (top-8 of 16, so
#: chance precision is 0.5): fast layer j predicts layers ~2j ahead, with precision 0.77 at 1
#: layer, ~0.6 at 10 and 0.50-0.55 at 18-20; running 5 of the 10 fast layers kept the hit rate
#: within 0.02 and cut the fast stream's cost from 16% to 3% of a token (BENCHMARKS.md).
DEFAULT_FAST_DEPTH = 5
#: Routing of one generation: per forward pass, ``{layer: sorted expert ids}``.
Trace = list[dict[int, list[int]]]


def moe_layers(model: Transformer) -> list[int]:
    return [i for i, b in enumerate(model.layers) if isinstance(b.mlp, MoE)]


def wait_until(deadline: float) -> None:
    """Sleep, then spin the last half millisecond: ``time.sleep`` alone overshoots short waits."""
    while (left := deadline - time.perf_counter()) > 0:
        if left > 1e-3:
            time.sleep(left - 5e-4)


class CacheOnly:
    """The fast stream's source: experts already resident, nothing else (no copy, no wait).

    With ``use=False`` it returns none at all: the fast layers then run attention and the shared
    expert only, which is all the prediction needs on the MoEfied model (measured, BENCHMARKS.md)
    at a fraction of the compute.
    """

    def __init__(self, policy: Policy, use: bool = True) -> None:
        self.policy = policy
        self.use = use
        self.pinned: list[Key] = []

    def fetch(self, layer: int, ids: list[int], resid: Tensor | None) -> dict[int, tuple[Tensor, Tensor]]:
        cache = self.policy.cache
        t = time.perf_counter()
        out = {}
        if not self.use:
            self.policy.counts["fast"]["requests"] += len(ids)
            return out
        with cache.cond:
            for e in ids:
                key = (layer, e)
                if cache.is_ready(key, t):
                    cache.pin(key)  # until the fast layer is done (release())
                    self.pinned.append(key)
                    out[e] = cache.weights(key)
        c = self.policy.counts["fast"]
        c["requests"] += len(ids)
        c["hits"] += len(out)
        return out

    def release(self) -> None:
        with self.policy.cache.cond:
            for key in self.pinned:
                self.policy.cache.unpin(key)
        self.pinned = []


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


class Policy:
    """``on-demand``: the shared fetch/accounting machinery, with no predictions."""

    name = "on-demand"
    #: run :meth:`after_fetch` while waiting for this layer's experts instead of after (see M2R2Prefetch)
    overlap = False

    def __init__(self, model: Transformer, cache: ExpertCache, loader: Loader) -> None:
        self.model, self.cache, self.loader = model, cache, loader
        self.n = model.cfg.num_layers
        self.sparse = moe_layers(model)
        self.next_sparse = {a: b for a, b in zip(self.sparse, self.sparse[1:], strict=False)}
        self.step = -1
        self.rows = 0
        self.pinned: list[Key] = []
        self.acct = Accounting()

    # ------------------------------------------------------------------ hooks for subclasses

    def begin_step(self, tokens: Tensor, pos: int, kv: KVCache) -> None:
        """A forward pass over ``tokens`` (``[1, T]``) at cache position ``pos`` starts."""
        self.step += 1
        self.rows = tokens.numel()
        if self.rows == 1 and self.acct.decode_start is None:
            with self.cache.cond:
                self.acct.decode_start = self.loader_totals()

    def hints(self, layer: int, ids: list[int], resid: Tensor | None) -> list[tuple[int, list[int], str, int]]:
        """Predictions made at slow ``layer`` before waiting: ``(target layer, ids, source, steps ahead)``."""
        return []

    def after_fetch(self, layer: int) -> None:
        """Runs once the slow stream's experts of ``layer`` are resident (before its MoE computes)."""

    def finish(self) -> None:
        with self.cache.cond:
            for key in self.pinned:
                self.cache.unpin(key)
        self.pinned = []

    # ------------------------------------------------------------------ machinery

    @property
    def phase(self) -> str:
        return "decode" if self.rows == 1 else "prefill"

    def time_of(self, layer: int, steps_ahead: int = 0) -> int:
        return (self.step + steps_ahead) * self.n + layer

    def gate(self, layer: int, x: Tensor) -> list[int]:
        """Experts that layer ``layer``'s router picks for the residual ``x``: for one row in the router's
        order (most probable first), for several the union (sorted)."""
        block = self.model.layers[layer]
        ids, _ = block.mlp.route(block.mlp_norm(x).reshape(-1, x.shape[-1]))
        return ids[0].tolist() if ids.shape[0] == 1 else torch.unique(ids).tolist()

    def next_gate(self, layer: int, resid: Tensor | None) -> list[tuple[int, list[int], str, int]]:
        nxt = self.next_sparse.get(layer)
        if nxt is None or resid is None:
            return []
        return [(nxt, self.gate(nxt, resid), "gate", 0)]

    def issue(
        self, layer: int, ids: list[int], source: str, steps_ahead: int, at: int, load: int | None = None
    ) -> None:
        """Predict that ``layer`` of step ``step + steps_ahead`` uses ``ids``: claim them all (so the
        resident ones stay) and request copies of the first ``load`` (default all) (cond held)."""
        need = self.time_of(layer, steps_ahead)
        if need <= self.cache.now:
            return
        if self.phase == "decode":
            self.acct.predicted(need, source, need - at, ids)
        for i, e in enumerate(ids):
            key = (layer, e)
            self.cache.predict(key, need)
            if (load is None or i < load) and not self.cache.is_ready(key):
                self.loader.request(key, need)

    def loader_totals(self) -> dict[str, int]:
        return {"bytes": self.loader.stats.bytes, "loads": self.loader.stats.loads}

    def fetch(self, layer: int, ids: list[int], resid: Tensor | None) -> dict[int, tuple[Tensor, Tensor]]:
        cache, loader = self.cache, self.loader
        now = self.time_of(layer)
        hints = self.hints(layer, ids, resid)  # router matmuls: outside the lock
        c = self.acct.counts[self.phase]
        keys = [(layer, e) for e in ids]
        t_call = time.perf_counter()
        with cache.cond:
            loader.check()
            for key in self.pinned:
                cache.unpin(key)
            cache.now = now
            for key in keys:
                cache.pin(key)
                if cache.is_ready(key, t_call):
                    c["hits"] += 1
                elif key in cache or loader.pending(key):
                    c["late"] += 1
                else:
                    c["misses"] += 1
                cache.used(key)
                loader.request(key, now)
            self.pinned = keys
            c["requests"] += len(keys)
            if self.phase == "decode":
                self.acct.score(now, ids)
            for target, eids, source, ahead in hints:
                self.issue(target, eids, source, ahead, now)
            ready_now = all(cache.is_ready(k, t_call) for k in keys)
        if not ready_now and self.overlap:
            self.after_fetch(layer)  # a stall is coming: do the policy's own work during it
        with cache.cond:
            t_wait = time.perf_counter()
            waited = False
            while not all(cache.is_ready(k) for k in keys):
                waited = True
                loader.check()
                if not loader.thread.is_alive():
                    raise M2R2Error("the expert loader thread stopped")
                cache.cond.wait(0.05)
            deadline = max(cache.ready_at[k] for k in keys)
            out = {e: cache.weights(k) for e, k in zip(ids, keys, strict=True)}
        if waited or deadline > time.perf_counter():
            wait_until(deadline)
            self.acct.stall_s[self.phase] += time.perf_counter() - t_wait
            c["stalls"] += 1
        if ready_now or not self.overlap:
            self.after_fetch(layer)
        return out

    def report(self) -> dict[str, Any]:
        """Counts, stall seconds and prediction scores of this generation."""
        return self.acct.report(self.loader_totals())


class NextGate(Policy):
    name = "next-gate"

    def hints(self, layer: int, ids: list[int], resid: Tensor | None) -> list[tuple[int, list[int], str, int]]:
        return self.next_gate(layer, resid)


class M2R2Prefetch(Policy):
    """Lockstep fast stream predicting experts several layers ahead (see the module docstring)."""

    name = "m2r2"

    def __init__(
        self,
        model: Transformer,
        cache: ExpertCache,
        loader: Loader,
        fast: FastStream,
        offset: int = 0,
        refine: bool = True,
        overlap: bool = True,
        load_top: int | None = None,
        fast_experts: str = "none",
        depth: int | None = DEFAULT_FAST_DEPTH,
    ) -> None:
        super().__init__(model, cache, loader)
        if fast.base is not model:
            raise SettingsError("the fast stream belongs to another model")
        self.fast, self.refine, self.overlap = fast, refine, overlap
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise SettingsError(f"depth must be a number of fast layers >= 1 (None = all), got {depth!r}")
        #: fast layers run per step: deeper ones predict far-off layers barely better than chance
        self.depth = fast.cfg.depth if depth is None else min(depth, fast.cfg.depth)
        k = max(model.layers[i].mlp.top_k for i in self.sparse)
        self.load_top = (k + 1) // 2 if load_top is None else load_top
        cfg = fast.cfg
        r, sparse = cfg.rate, set(self.sparse)
        self.targets = {
            j: [t for t in range(r * j - r + offset, r * j + offset) if t in sparse] for j in range(1, cfg.depth + 1)
        }
        if fast_experts not in ("cache", "none"):
            raise SettingsError(f"fast_experts must be 'cache' or 'none', got {fast_experts!r}")
        self.cache_only = CacheOnly(self, use=fast_experts == "cache")
        self.f: Tensor | None = None

    def begin_step(self, tokens: Tensor, pos: int, kv: KVCache) -> None:
        super().begin_step(tokens, pos, kv)
        self.covered: set[int] = set()
        self.f = None
        if self.rows != 1:  # prefill: no fast stream (next-gate only)
            return
        base = self.model
        self.kv, self.pos, self.j = kv, pos, 0
        self.cos, self.sin = base.rope(pos, 1, base.dtype)
        self.mask = draft_mask(pos, 1, 1, base.device)
        self.f = base.embed_tokens(tokens)

    def hints(self, layer: int, ids: list[int], resid: Tensor | None) -> list[tuple[int, list[int], str, int]]:
        nxt = self.next_sparse.get(layer)
        if nxt is not None and (self.refine or nxt not in self.covered):
            return self.next_gate(layer, resid)
        return []

    def after_fetch(self, layer: int) -> None:
        """Run the fast layers whose base layer the slow stream has reached; prefetch what they predict."""
        path = self.fast.cfg.path
        while self.f is not None and self.j < self.depth and path[self.j] <= layer:
            b = path[self.j]
            block, lora = self.fast.layer(self.j)
            moe = block.mlp if isinstance(block.mlp, MoE) else None
            if moe is not None:
                moe.source = self.cache_only
            try:
                self.f, _ = fast_layer(block, self.f, self.cos, self.sin, self.kv.view(b, self.pos), self.mask, lora)
            finally:
                if moe is not None:
                    moe.source = self
                self.cache_only.release()
            self.j += 1
            preds = [(t, self.gate(t, self.f)) for t in self.targets[self.j] if t > layer]
            now = self.time_of(layer)
            with self.cache.cond:
                for t, ids in preds:
                    self.issue(t, ids, "fast", 0, now, self.load_top)
                    self.covered.add(t)


class Oracle(Policy):
    """Perfect knowledge from a recorded trace of the same generation."""

    name = "oracle"

    def __init__(
        self, model: Transformer, cache: ExpertCache, loader: Loader, trace: Trace, horizon: int | None = None
    ) -> None:
        super().__init__(model, cache, loader)
        self.trace = trace
        if horizon is None:  # as far ahead as the cache can hold beside the layer in use
            k = max(model.layers[i].mlp.top_k for i in self.sparse) if self.sparse else 1
            e = max(model.layers[i].mlp.num_experts for i in self.sparse) if self.sparse else 1
            horizon = max(1, (cache.capacity - e) // k)
        self.horizon = horizon
        self.flat = sorted(
            (s * self.n + layer, s, layer, ids) for s, step in enumerate(trace) for layer, ids in step.items()
        )
        self.times = [x[0] for x in self.flat]
        self.upto = 0  # index into flat of the first entry not yet requested
        self.drops = 0

    def hints(self, layer: int, ids: list[int], resid: Tensor | None) -> list[tuple[int, list[int], str, int]]:
        """Entries newly inside the horizon; the whole window again after the loader dropped prefetches."""
        if self.step >= len(self.trace) or self.trace[self.step].get(layer) != ids:
            raise M2R2Error(
                f"the oracle's trace does not match this generation at step {self.step}, layer {layer}: "
                "record it from the same prompt, model and settings"
            )
        now = self.time_of(layer)
        lo, hi = bisect.bisect_right(self.times, now), bisect.bisect_right(self.times, now + self.horizon)
        if self.loader.stats.dropped == self.drops:
            lo = max(lo, self.upto)
        self.drops, self.upto = self.loader.stats.dropped, max(self.upto, hi)
        return [(lay, eids, "oracle", s - self.step) for _, s, lay, eids in self.flat[lo:hi]]


class TraceRecorder:
    """A source that serves the resident weights (all experts in fast memory) and records the routing."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.trace: Trace = []

    def begin_step(self, tokens: Tensor, pos: int, kv: KVCache) -> None:
        self.trace.append({})

    def fetch(self, layer: int, ids: list[int], resid: Tensor | None) -> dict[int, tuple[Tensor, Tensor]]:
        self.trace[-1][layer] = list(ids)
        moe = self.model.layers[layer].mlp
        return {e: (moe.w13[e], moe.w2[e]) for e in ids}

    def finish(self) -> None:
        pass


#: Every policy by name, and what its construction needs beyond the model, cache and loader.
POLICY_TABLE: dict[str, tuple[type[Policy], str | None]] = {
    "on-demand": (Policy, None),
    "next-gate": (NextGate, None),
    "m2r2": (M2R2Prefetch, "fast"),
    "oracle": (Oracle, "trace"),
}
POLICIES = tuple(POLICY_TABLE)
_NEEDS = {
    "fast": "the m2r2 policy needs a fast stream (adapters trained for this MoE model)",
    "trace": "the oracle policy needs a routing trace of the same generation",
}


def make_policy(
    name: str,
    model: Transformer,
    cache: ExpertCache,
    loader: Loader,
    fast: FastStream | None = None,
    trace: Trace | None = None,
    **options: Any,
) -> Policy:
    if name not in POLICY_TABLE:
        raise SettingsError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    cls, need = POLICY_TABLE[name]
    if need is None:
        return cls(model, cache, loader, **options)
    extra = fast if need == "fast" else trace
    if extra is None:
        raise SettingsError(_NEEDS[need])
    return cls(model, cache, loader, extra, **options)  # type: ignore[call-arg]
