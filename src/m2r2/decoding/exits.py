"""Distance-based exits (lossy baselines of dynamic compute): tokens exit at a layer of the base model.

- ``static-exit``: every token exits at base layer L (plain early exit ``W . Norm(h_L)``).
- ``calm``: CALM-style confidence exit (softmax max-probability or top-2 margin) on plain
  early-exit logits at a list of base layers.
- ``skip-decoding``: SkipDecode's position-dependent budget, linear from ``max_layer`` at the first
  generated token to ``min_layer`` at the last one the budget allows.

They share the pending-completion loop of :mod:`m2r2.decoding.dynamic`; their probes run the base
model's own first layers and write exact K/V into the slow cache (docs/DYNAMIC.md).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from m2r2.decoding import register
from m2r2.decoding.dynamic import MEASURES, PendingDecoder, Probe, check_layer, check_layers, check_threshold
from m2r2.errors import SettingsError
from m2r2.model import Transformer

if TYPE_CHECKING:
    from m2r2.decoding.base import Loaded


class BaseLayerExit(PendingDecoder):
    """Probes over the base model's own layers (no adapters), writing their K/V into the slow cache.

    Subclasses say which layers are checked (:meth:`checks`) and whether a check exits (:meth:`decide`).
    """

    def checks(self, index: int) -> list[int]:
        """Base layers (1-based count of layers run) where the token at ``index`` may exit."""
        raise NotImplementedError

    def decide(self, h: Tensor, layer: int, index: int) -> tuple[Tensor | None, int]:
        """Exit logits or None, and the number of LM-head evaluations spent deciding."""
        raise NotImplementedError

    def may_exit(self, index: int) -> bool:
        return bool(self.checks(index))

    def probe(self, token: int, pos: int, index: int) -> Probe:
        model, cache = self.model, self.cache
        assert cache is not None
        checks = self.checks(index)
        x = model.embed_tokens(torch.tensor([[token]], device=model.device))
        cos, sin = model.rope(pos, 1, x.dtype)
        causal = model.causal_mask(pos, 1, cache.max_len)
        heads = 0
        last = checks[-1]
        for i in range(last):
            x = model.layers[i](x, cos, sin, cache, i, pos, self._mask(causal, i))
            if i + 1 in checks:
                logits, spent = self.decide(x, i + 1, index)
                heads += spent
                if logits is not None:
                    return Probe(logits, i + 1, i + 1, heads)
        return Probe(None, last, last, heads, resume=(x, last) if not self.pending else None)

    def _mask(self, causal: Tensor, layer: int) -> Tensor:
        """``causal`` with the pending slots that have no K/V at ``layer`` masked out."""
        assert self.cache is not None
        hidden = [self.cache.length + k for k, d in enumerate(self.depths) if d <= layer]
        if not hidden:
            return causal
        mask = causal.clone()
        mask[0, hidden] = False
        return mask


class StaticExit(BaseLayerExit):
    name = "static-exit"

    def __init__(
        self, model: Transformer, eos_ids: list[int], decode=None, layer: int | None = None, max_pending: int = 16
    ):
        super().__init__(model, eos_ids, decode, max_pending)
        n = model.cfg.num_layers
        self.layer = check_layer("layer", default_depth(n) if layer is None else layer, 1, n - 1)

    def checks(self, index: int) -> list[int]:
        return [self.layer]

    def decide(self, h: Tensor, layer: int, index: int) -> tuple[Tensor | None, int]:
        return self.model.head(h)[0, -1], 1


class CalmExit(BaseLayerExit):
    """CALM (Schuster et al. 2022) softmax-confidence exit: max probability or top-2 margin."""

    name = "calm"

    def __init__(
        self,
        model: Transformer,
        eos_ids: list[int],
        decode=None,
        threshold: float = 0.9,
        measure: str = "maxprob",
        exits: Any = None,
        max_pending: int = 16,
    ):
        super().__init__(model, eos_ids, decode, max_pending)
        n = model.cfg.num_layers
        self.threshold = check_threshold(threshold)
        if measure not in MEASURES:
            raise SettingsError(f"measure must be one of {', '.join(MEASURES)}, got {measure!r}")
        self.measure = measure
        self.exits = check_layers("exits", exits if exits is not None else default_calm_exits(n), 1, n - 1)

    def checks(self, index: int) -> list[int]:
        return self.exits if self.threshold < 1.0 else []

    def decide(self, h: Tensor, layer: int, index: int) -> tuple[Tensor | None, int]:
        logits = self.model.head(h)[0, -1]
        probs = torch.softmax(logits, -1)
        if self.measure == "maxprob":
            conf = float(probs.max())
        else:
            top = probs.topk(2).values
            conf = float(top[0] - top[1])
        return (logits if conf >= self.threshold else None), 1


def default_depth(num_layers: int) -> int:
    """Default exit layer of the static baselines: two thirds of the depth (30 layers: 20)."""
    return max(1, round(2 * num_layers / 3))


def default_calm_exits(num_layers: int) -> list[int]:
    """Every sixth layer from a third of the depth (30 layers: 10, 16, 22, 28): each check costs an LM head."""
    return list(range(num_layers // 3, num_layers, max(1, num_layers // 5)))


def skip_schedule(index: int, budget: int, max_layer: int, min_layer: int) -> int:
    """SkipDecode's exit budget for generated token ``index`` (0-based) of ``budget`` tokens.

    Linear from ``max_layer`` at the first token to ``min_layer`` at the last, rounded to the
    nearest layer (halves up); non-increasing in ``index`` (so a token finds K/V at every layer it runs).
    """
    if budget <= 1:
        return max_layer
    frac = min(index, budget - 1) / (budget - 1)
    return math.floor(max_layer - (max_layer - min_layer) * frac + 0.5)


class SkipDecoding(BaseLayerExit):
    name = "skip-decoding"

    def __init__(
        self,
        model: Transformer,
        eos_ids: list[int],
        decode=None,
        max_layer: int | None = None,
        min_layer: int | None = None,
        max_pending: int = 16,
    ):
        super().__init__(model, eos_ids, decode, max_pending)
        n = model.cfg.num_layers
        self.max_layer = check_layer("max_layer", n if max_layer is None else max_layer, 1, n)
        low = min(default_depth(n), self.max_layer) if min_layer is None else min_layer
        self.min_layer = check_layer("min_layer", low, 1, self.max_layer)

    def exit_layer(self, index: int) -> int:
        return skip_schedule(index, self.budget, self.max_layer, self.min_layer)

    def checks(self, index: int) -> list[int]:
        layer = self.exit_layer(index)
        return [layer] if layer < self.model.cfg.num_layers else []

    def decide(self, h: Tensor, layer: int, index: int) -> tuple[Tensor | None, int]:
        return self.model.head(h)[0, -1], 1


# --------------------------------------------------------------------------- registry


@register("static-exit", "baseline (lossy): every token exits at base layer L (options layer, max_pending)")
def _static_exit(engine: Loaded, layer: int | None = None, max_pending: int = 16) -> StaticExit:
    return StaticExit(engine.model, engine.tokenizer.eos_ids, engine.tokenizer.decode, layer, max_pending)


@register(
    "calm",
    "baseline (lossy): CALM confidence exit on plain early-exit logits (options threshold, measure=maxprob|margin, "
    "exits, max_pending)",
)
def _calm(
    engine: Loaded, threshold: float = 0.9, measure: str = "maxprob", exits: Any = None, max_pending: int = 16
) -> CalmExit:
    tok = engine.tokenizer
    return CalmExit(engine.model, tok.eos_ids, tok.decode, threshold, measure, exits, max_pending)


@register(
    "skip-decoding",
    "baseline (lossy): SkipDecode's exit budget falling linearly with position (options max_layer, min_layer, "
    "max_pending)",
)
def _skip_decoding(
    engine: Loaded, max_layer: int | None = None, min_layer: int | None = None, max_pending: int = 16
) -> SkipDecoding:
    tok = engine.tokenizer
    return SkipDecoding(engine.model, tok.eos_ids, tok.decode, max_layer, min_layer, max_pending)
