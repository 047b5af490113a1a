"""Dynamic compute (lossy, tunable): tokens that look easy exit early and are completed later.

One loop, :class:`PendingDecoder`, serves every method; a method is only an *exit rule*. Here:
``m2r2-dynamic`` with prefix adapters, where the M2R2 fast stream runs layer by layer and ARLA decides
the exit; the distance-based baselines (static, CALM, SkipDecode) are in :mod:`m2r2.decoding.exits`.
With seeded adapters (the shipped default) ``m2r2-dynamic`` is instead the token-tree loop of
:mod:`m2r2.decoding.tree` with lossy exits, where the verify pass completes the exited tokens.

A token that exits has no slow K/V: it stays *pending* until the next token that does not exit
runs one slow pass over ``[pending..., token]``, which leaves the cache exactly as a full pass
would. With no exits possible the loop is plain greedy decoding, bit for bit. Why (masking over
state copying, cost accounting, SkipDecode's deviation): docs/DYNAMIC.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from m2r2.cache import KVCache
from m2r2.decoding import register
from m2r2.decoding.base import (
    GenerationConfig,
    GenerationResult,
    StreamCallback,
    begin,
)
from m2r2.errors import SettingsError
from m2r2.model import ROW_INVARIANT_MAX_ROWS, Transformer
from m2r2.multirate.fast import FastStream, fast_layer

if TYPE_CHECKING:
    from m2r2.cache import Conversation
    from m2r2.decoding.base import Loaded
    from m2r2.decoding.tree import TreeSpeculative

#: A completion pass holds max_pending + 1 rows; beyond the row-invariant limit it is not bit-exact.
MAX_PENDING_LIMIT = ROW_INVARIANT_MAX_ROWS - 1
MEASURES = ("maxprob", "margin")


# --------------------------------------------------------------------------- option checks


def check_threshold(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise SettingsError(f"threshold must be a finite number >= 0 (>= 1 never exits), got {value!r}")
    return float(value)


def check_layer(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SettingsError(f"{name} must be an integer in {low}..{high}, got {value!r}")
    return value


def check_layers(name: str, value: Any, low: int, high: int) -> list[int]:
    """A list of layers from a list, one int, or a comma string (``--option exits=8,10``)."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list | tuple) else [value]
    out: list[int] = []
    for item in items:
        try:
            layer = int(item.strip()) if isinstance(item, str) else item
        except ValueError:
            raise SettingsError(f"{name} must be integers in {low}..{high}, got {value!r}") from None
        out.append(check_layer(f"each of {name}", layer, low, high))
    if not out:
        raise SettingsError(f"{name} must list at least one layer in {low}..{high}")
    return sorted(set(out))


def check_max_pending(value: Any) -> int:
    return check_layer("max_pending", value, 1, MAX_PENDING_LIMIT)


# --------------------------------------------------------------------------- the shared loop


@dataclass
class Probe:
    """What a probe found: exit logits (None = no exit) and what it cost."""

    logits: Tensor | None
    depth: int  # layers run; the token has K/V below this depth
    layers: int
    heads: int
    #: (state, next base layer) when the probe ran the slow stream's own first layers with exact
    #: context, so a deep pass may continue from there
    resume: tuple[Tensor, int] | None = None


@dataclass
class _Counters:
    probe_layers: int = 0
    slow_layers: int = 0
    row_layers: int = 0
    heads: int = 0
    exits: int = 0
    exit_depth: int = 0
    probes: int = 0
    completions: int = 0
    forced: int = 0
    checked: int = 0  # exits whose output the completion pass could check against the full model
    agreed: int = 0
    exit_layers: dict[int, int] = field(default_factory=dict)


class PendingDecoder:
    """Greedy decoding where a probe may exit a token early; pending tokens are completed later.

    Subclasses implement :meth:`may_exit` (whether probing the token at generated index ``i`` can
    exit at all) and :meth:`probe`; :meth:`start` and :meth:`completed` let them keep per-generation
    state (the fast stream's draft block).
    """

    name = "dynamic"

    def __init__(
        self,
        model: Transformer,
        eos_ids: list[int],
        decode: Callable[[list[int]], str] | None = None,
        max_pending: int = 16,
    ) -> None:
        self.model = model
        self.eos_ids = eos_ids
        self.decode = decode
        self.max_pending = check_max_pending(max_pending)
        self.last_cache: KVCache | None = None  # the last generation's cache, for inspection and tests
        self.cache: KVCache | None = None
        self.pending: list[int] = []
        self.depths: list[int] = []
        self.budget = 0

    # ---- hooks
    def start(self, cache: KVCache) -> None:
        """A new generation begins on ``cache`` (its prompt is in it)."""

    def completed(self) -> None:
        """The pending tokens were just written to the slow cache."""

    def may_exit(self, index: int) -> bool:
        raise NotImplementedError

    def probe(self, token: int, pos: int, index: int) -> Probe:
        raise NotImplementedError

    # ---- loop
    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        gen: GenerationConfig,
        stream: StreamCallback | None = None,
        session: Conversation | None = None,
    ) -> GenerationResult:
        gen.validate()
        if not gen.greedy:
            raise SettingsError(f"{self.name} decodes greedily only (temperature 0); it is lossy by design")
        model = self.model
        t0, stopper, cache, logits = begin(model, prompt, gen, self.eos_ids, self.decode)
        self.budget = stopper.budget
        self.cache = self.last_cache = cache
        self.pending, self.depths = [], []
        tok = int(logits[0, -1].argmax())
        self.start(cache)
        c = _Counters()
        index = 1  # generated index of the token the next step produces (0 came from the prompt pass)
        while True:
            stopper.emit([tok], stream)
            if stopper.done:
                break
            pos = cache.length + len(self.pending)
            probe = None
            if len(self.pending) >= self.max_pending:
                c.forced += 1
            elif self.may_exit(index):
                probe = self.probe(tok, pos, index)
                c.probes += 1
                c.probe_layers += probe.layers
                c.row_layers += probe.layers
                c.heads += probe.heads
            if probe is not None and probe.logits is not None:
                self.pending.append(tok)
                self.depths.append(probe.depth)
                c.exits += 1
                c.exit_depth += probe.depth
                c.exit_layers[probe.depth] = c.exit_layers.get(probe.depth, 0) + 1
                tok = int(probe.logits.argmax())
            else:
                c.completions += bool(self.pending)
                tok = int(self._deep(tok, pos, probe, c).argmax())
            index += 1
        ntok = max(len(stopper.tokens), 1)
        return stopper.result(
            t0,
            prompt,
            stats={
                "layers_per_token": (c.probe_layers + c.slow_layers) / ntok,
                "row_layers_per_token": c.row_layers / ntok,
                "probe_layers_per_token": c.probe_layers / ntok,
                "head_calls_per_token": c.heads / ntok,
                "exit_rate": c.exits / ntok,
                "exits": c.exits,
                "probes": c.probes,
                "mean_exit_layer": c.exit_depth / c.exits if c.exits else 0.0,
                "exit_layers": dict(sorted(c.exit_layers.items())),
                "pending_completions": c.completions,
                "forced_completions": c.forced,
                # in situ: the completion pass gives the full model's choice after each pending token
                "exit_precision": c.agreed / c.checked if c.checked else None,
            },
        )

    def _deep(self, tok: int, pos: int, probe: Probe | None, c: _Counters) -> Tensor:
        """The full model's logits after ``tok``, completing every pending token on the way."""
        model, cache = self.model, self.cache
        assert cache is not None
        n_layers = model.cfg.num_layers
        if not self.pending and probe is not None and probe.resume is not None:
            x, first = probe.resume  # the probe was the slow stream's layers 0..first-1: go on from there
            cos, sin = model.rope(pos, 1, x.dtype)
            mask = model.causal_mask(pos, 1, cache.max_len)
            for i in range(first, n_layers):
                x = model.layers[i](x, cos, sin, cache, i, pos, mask)
            cache.length = pos + 1
            c.slow_layers += n_layers - first
            c.row_layers += n_layers - first
            c.heads += 1
            return model.head(x)[0, -1]
        rows = [*self.pending, tok]
        logits = model(torch.tensor([rows], device=model.device), cache, cache.length)[0]
        if len(rows) > 1:  # row i is the full model's choice after pending token i; its exit chose rows[i + 1]
            c.checked += len(rows) - 1
            c.agreed += int((logits[:-1].argmax(-1).cpu() == torch.tensor(rows[1:])).sum())
        logits = logits[-1]
        c.slow_layers += n_layers
        c.row_layers += n_layers * len(rows)
        c.heads += 1
        self.pending, self.depths = [], []
        self.completed()
        return logits


# --------------------------------------------------------------------------- M2R2 fast-stream exits


class FastStreamExit(PendingDecoder):
    """``m2r2-dynamic``: the fast stream over the shared cache, ARLA deciding the exit."""

    name = "m2r2-dynamic"

    def __init__(
        self,
        model: Transformer,
        fast: FastStream,
        eos_ids: list[int],
        decode=None,
        threshold: float = 0.8,
        exits: Any = None,
        max_pending: int = 16,
        backoff: int = 0,
    ):
        super().__init__(model, eos_ids, decode, max_pending)
        self.fast = fast
        self.threshold = check_threshold(threshold)
        self.backoff = check_layer("backoff", backoff, 0, 1 << 20)
        self.failed = 0  # consecutive probes that did not exit
        self.skip = 0  # tokens left to decode without probing
        depth = fast.cfg.depth
        self.exits = check_layers("exits", exits if exits is not None else [depth], 1, depth)
        #: fast K/V of the pending tokens per fast layer (zeros where a token exited below the layer)
        self.block: list[tuple[Tensor, Tensor] | None] = []

    def start(self, cache: KVCache) -> None:
        self.block = [None] * self.fast.cfg.depth
        self.failed = self.skip = 0

    def completed(self) -> None:
        self.block = [None] * self.fast.cfg.depth

    def may_exit(self, index: int) -> bool:
        """Probe unless backing off: after ``n`` probes in a row that did not exit, the next
        ``min(n, backoff)`` tokens run the full model without a probe.

        Why: unlike a probe over base layers (CALM, static exit), the fast stream's layers are not
        reused by the slow pass, so a probe that does not exit is pure overhead (~0.4 of a step
        here), and exits come in runs (easy spans of text). Skipping a probe only ever replaces an
        early exit by the full model's own token, so quality can only rise; ``backoff=0`` probes
        every token.
        """
        if self.threshold >= 1.0:
            return False
        if self.skip:
            self.skip -= 1
            return False
        return True

    def _outcome(self, exited: bool) -> None:
        self.failed = 0 if exited else self.failed + 1
        self.skip = min(self.failed, self.backoff)

    def probe(self, token: int, pos: int, index: int) -> Probe:
        fast, cache = self.fast, self.cache
        assert cache is not None
        base = fast.base
        verified = cache.length
        f = base.embed_tokens(torch.tensor([[token]], device=base.device))
        cos, sin = base.rope(pos, 1, base.dtype)
        states = [f]
        new_kv: list[tuple[Tensor, Tensor]] = []
        slow_keys = torch.ones(verified, dtype=torch.bool)
        last = self.exits[-1]
        for i in range(last):
            layer = fast.cfg.path[i]
            visible = [d > i for d in self.depths] + [True]
            mask = torch.cat([slow_keys, torch.tensor(visible)])[None].to(base.device)
            blk, lora = fast.layer(i)
            f, kv = fast_layer(blk, f, cos, sin, cache.view(layer, verified), mask, lora, self.block[i])
            states.append(f)
            new_kv.append(kv)
            j = i + 1
            if j in self.exits and float(fast.exit_probability([s[0, -1] for s in states], j)) >= self.threshold:
                self._extend_block(new_kv)
                self._outcome(True)
                return Probe(fast.exit_logits(f)[0, -1], j, j, 1)
        self._outcome(False)
        return Probe(None, last, last, 0)

    def _extend_block(self, new_kv: list[tuple[Tensor, Tensor]]) -> None:
        """Keep the exiting token's fast K/V in the block; zeros (masked out) above its exit."""
        for i in range(len(self.block)):
            if i < len(new_kv):
                self.block[i] = new_kv[i]
                continue
            k0, v0 = new_kv[0]
            pad = (k0.new_zeros(*k0.shape[:2], 1, k0.shape[3]), v0.new_zeros(*v0.shape[:2], 1, v0.shape[3]))
            prev = self.block[i]
            self.block[i] = pad if prev is None else (torch.cat([prev[0], pad[0]], 2), torch.cat([prev[1], pad[1]], 2))


# --------------------------------------------------------------------------- registry


@register(
    "m2r2-dynamic",
    "M2R2 dynamic compute (lossy): a draft exits at the fast stream when its confidence >= threshold "
    "(seeded adapters: draft probability, token trees; prefix adapters: ARLA, layer by layer); options "
    "threshold, adapters; prefix adapters also exits, max_pending, backoff",
)
def _m2r2_dynamic(
    engine: Loaded,
    threshold: float = 0.8,
    adapters: str | None = None,
    exits: Any = None,
    max_pending: int | None = None,
    backoff: int | None = None,
) -> FastStreamExit | TreeSpeculative:
    """Seeded adapters (the shipped default where they exist): the tree loop of ``m2r2`` with its
    settings, where a draft whose own probability reaches ``threshold`` is kept even if the verify
    pass disagrees (it exits at the fast stream; the pass that completes its slow K/V verifies the
    drafts below it). Prefix adapters: :class:`FastStreamExit`. Why: docs/DYNAMIC.md."""
    from m2r2.decoding.lookup import DEFAULT_LOOKUP
    from m2r2.decoding.tree import SeededDrafter, build_tree_speculative
    from m2r2.multirate.io import bundled_adapters, load_default
    from m2r2.multirate.seeded import SeededFastStream

    check_threshold(threshold)  # before loading anything
    path = Path(adapters) if adapters else bundled_adapters(engine.fingerprint, "seeded")
    fast = load_default(engine.model, engine.fingerprint, path)
    seeded = isinstance(fast, SeededFastStream)
    given = [k for k, v in {"exits": exits, "max_pending": max_pending, "backoff": backoff}.items() if v is not None]
    if seeded and given:
        raise SettingsError(f"m2r2-dynamic options for prefix adapters only (these are seeded): {', '.join(given)}")
    fast.to(engine.model.device).freeze(merge=True)
    if seeded:
        drafter = SeededDrafter(fast)
        return build_tree_speculative(  # every round drafts: its exits are the point, not only its accepted drafts
            "m2r2-dynamic", engine, drafter, lookup=DEFAULT_LOOKUP, exit_threshold=threshold, draft="always"
        )
    tok = engine.tokenizer
    pending = 16 if max_pending is None else max_pending
    return FastStreamExit(engine.model, fast, tok.eos_ids, tok.decode, threshold, exits, pending, backoff or 0)
