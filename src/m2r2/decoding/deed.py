"""``deed``: DEED-style dynamic early-exit drafting, verified by the self-speculative loop (lossless).

DEED (Tang et al., "DEED: Dynamic Early Exit on Decoder for Accelerating Encoder-Decoder Transformer
Models", arXiv 2311.08623) makes every decoder layer an exit: a multi-exit decoder trained with deep
supervision, one generation head shared by all exits, small adaptation modules so shallow layers
predict well, and a *step-level* exit: each decoding step stops at the first layer whose confidence
(the top-1 probability of its exit) passes a threshold. Because steps stop at different depths, a
step that goes deeper than earlier ones first computes those earlier steps' missing deep layers
*just in time*, so every layer attends to features of the same depth.

Here it is a drafter of :class:`m2r2.decoding.speculative.SelfSpeculative` (the loop that verifies
``m2r2``'s chains), mapped onto the trained prefix fast stream (:class:`m2r2.multirate.fast.FastStream`:
base layers 1..K with accelerator adapters over the shared slow KV cache):

* DEED's decoder layers = the fast layers; its exits = the adapter file's trained exits
  (``FastConfig.exits``, KL to the full model at each: deep supervision; ``m2r2 train --exits
  4,6,8,10`` trains several) or the ``exits`` option;
* shared generation head = the base LM head ``W . Norm`` over the stored draft vocabulary;
* adaptation modules = the accelerator adapters (low-rank deltas inside the layers, trained with
  per-layer alignment to slow layer ``R*j``, rather than DEED's modules in front of the head);
* step-level exit: a draft stops at the shallowest exit whose top-1 probability reaches
  ``threshold`` (the last exit always exits);
* just-in-time computation: the block's earlier drafts that exited below the layer a draft reaches
  are run through the missing layers as extra rows of that draft's pass (:meth:`DeedDrafter.step`),
  so their fast K/V exist at every depth a later draft attends to.

What differs: DEED decodes with its exits (lossy); here the exited drafts are only proposals, and
the verify pass, which runs every drafted token through all N base layers anyway, completes their
deep slow K/V and keeps only tokens the full model agrees with (greedy bit-identical to
``vanilla``, sampling exact). DEED fine-tunes the whole model with cross-entropy on labels; here the
base is frozen and the exits distil the full model. With the shipped prefix adapters (one trained
exit, fast layer 10) ``deed`` drafts like ``m2r2``'s prefix chains plus the confidence exit.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from m2r2.decoding import register
from m2r2.decoding.costs import cached_costs, cost_cache_path, measure_costs
from m2r2.decoding.dynamic import check_layers, check_threshold
from m2r2.decoding.speculative import Drafter, SelfSpeculative
from m2r2.multirate.fast import FastStream, draft_mask, fast_layer

if TYPE_CHECKING:
    from m2r2.cache import KVCache
    from m2r2.decoding.base import Loaded


class DeedDrafter:
    """Drafts exit at the shallowest confident exit; earlier drafts' missing layers are computed just in time.

    Invariant (why one contiguous pass per layer suffices): when a draft reaches layer j, every earlier
    draft of the block is brought to layer j too, so the drafts with fast K/V at layer j always form
    a prefix of the block, and the ones lacking it a contiguous suffix ending at the new draft.
    """

    def __init__(self, fast: FastStream, cache: KVCache, exits: list[int], threshold: float) -> None:
        self.fast, self.cache, self.exits, self.threshold = fast, cache, exits, threshold
        self.layers = self.rows = self.steps = 0  # counters for the statistics

    @property
    def layers_per_step(self) -> float:
        """Mean fast layers a draft ran to (its exit depth); the loop's statistics multiply by the steps."""
        return self.layers / max(self.steps, 1)

    def start(self, verified_len: int) -> None:
        self.verified = verified_len
        self.kv: list[tuple[Tensor, Tensor] | None] = [None] * self.fast.cfg.depth  # per layer, block order
        self.states: list[Tensor] = []  # each draft's state at its current depth, [1, 1, d]
        self.depths: list[int] = []  # fast layers each draft has run

    def observe(self, tokens: list[int]) -> None:
        pass  # the verified context is the slow cache itself

    def step(self, token: int) -> tuple[Tensor, float | None]:
        fast, base = self.fast, self.fast.base
        n = len(self.depths)  # drafts already in the block; the new one sits at block index n
        f = base.embed_tokens(torch.tensor([[token]], device=base.device))
        last = self.exits[-1]
        for j in range(last):
            lag = next((i for i, d in enumerate(self.depths) if d <= j), n)  # first draft without layer j
            x = torch.cat([*self.states[lag:], f], dim=1) if lag < n else f
            rows = n + 1 - lag
            cos, sin = base.rope(self.verified + lag, rows, base.dtype)
            mask = draft_mask(self.verified, n + 1, rows, base.device)
            blk, lora = fast.layer(j)
            layer = fast.cfg.path[j]
            x, self.kv[j] = fast_layer(blk, x, cos, sin, self.cache.view(layer, self.verified), mask, lora, self.kv[j])
            for i in range(lag, n):  # just in time: earlier drafts now have layer j
                self.states[i], self.depths[i] = x[:, i - lag : i - lag + 1], j + 1
            f = x[:, -1:]
            self.rows += rows
            if j + 1 in self.exits:
                logits = fast.exit_logits(f)[0, -1]
                conf = float(torch.softmax(logits, -1).max())
                if conf >= self.threshold or j + 1 == last:
                    break
        self.states.append(f)
        self.depths.append(j + 1)
        self.layers += j + 1
        self.steps += 1
        return logits, conf

    def stats(self) -> dict[str, float]:
        return {
            "mean_exit_layer": self.layers_per_step,
            "rows_per_draft_layer": self.rows / max(self.layers, 1),  # above 1: just-in-time rows
        }


def build_deed(
    engine: Loaded,
    fast: FastStream,
    exits: list[int],
    threshold: float,
    max_draft: int = 8,
    stop_below: float = 0.0,
    adaptive: bool = True,
    cost_cache: bool = True,
) -> SelfSpeculative:
    """A :class:`SelfSpeculative` strategy drafting with :class:`DeedDrafter` (costs as for ``m2r2``'s chains)."""
    fast.to(engine.model.device).freeze(merge=True)

    def make(cache: object) -> Drafter:
        return DeedDrafter(fast, cache, exits, threshold)  # type: ignore[arg-type]

    costs = None
    if adaptive:

        def measure() -> Any:
            return measure_costs(engine.model, make, max_draft)

        path = cost_cache_path(engine, fast, max_draft)
        key = f"deed-{'.'.join(map(str, exits))}-{threshold:g}-{path.name}"
        costs = cached_costs(path.with_name(key), measure) if cost_cache else measure()
    tok = engine.tokenizer
    return SelfSpeculative("deed", engine.model, make, tok.eos_ids, tok.decode, max_draft, stop_below, costs)


@register(
    "deed",
    "DEED-style drafting (lossless): each draft exits at the shallowest trained fast-stream exit whose top-1 "
    "probability >= threshold, earlier drafts' deeper layers computed just in time; options threshold, exits, adapters",
)
def _deed(
    engine: Loaded,
    threshold: float = 0.9,
    exits: Any = None,
    adapters: str | None = None,
    max_draft: int = 8,
    stop_below: float = 0.2,
    adaptive: bool = True,
    cost_cache: bool = True,
) -> SelfSpeculative:
    from m2r2.errors import SettingsError
    from m2r2.multirate.io import load_default

    check_threshold(threshold)
    fast = load_default(engine.model, engine.fingerprint, Path(adapters) if adapters else None)
    if not isinstance(fast, FastStream):
        raise SettingsError("deed drafts with prefix fast-stream adapters (`m2r2 train`), not seeded ones")
    depth = fast.cfg.depth
    layers = check_layers("exits", exits if exits is not None else fast.cfg.exits, 1, depth)
    return build_deed(engine, fast, layers, threshold, max_draft, stop_below, adaptive, cost_cache)
