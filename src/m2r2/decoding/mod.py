"""Method ``mod``: Mixture-of-Depths-style block skipping with routers trained on the frozen model.

Each generated token runs block ``i`` only if its router says so (``g_i(x) >= threshold``, see
:mod:`m2r2.training.mod`); otherwise its residual passes the block unchanged. The knob is a
per-token threshold rather than MoD's per-sequence capacity, because capacity-based top-k routing
needs the whole sequence (non-causal) and we decode one token at a time; the MoD paper's own answer
for sampling is likewise a causal per-token decision.

K/V of skipped tokens, the faithful MoD choice: a token that skips block ``i`` writes no K/V there,
and later tokens mask its slot out at block ``i`` (a per-layer validity mask over the cache).
Computing its K/V anyway would cost the block's q/k/v projection (~1/6 of a block here) and
would no longer be MoD, where a skipped token takes no part in the block at all; the routers are
trained for this masking (their gate weights keys in the soft-routed attention).

The prompt is prefilled through every block (one parallel pass, where skipping saves little on
a bandwidth-bound CPU); only generated tokens are routed. ``threshold = 0`` runs every block with
vanilla's arithmetic and reproduces ``vanilla`` greedy token for token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from m2r2.cache import KVCache
from m2r2.decoding import register
from m2r2.decoding.base import (
    GenerationConfig,
    GenerationResult,
    Sampler,
    StreamCallback,
    begin,
)
from m2r2.errors import SettingsError
from m2r2.model import Transformer
from m2r2.training.mod import Routers, load_default_routers

if TYPE_CHECKING:
    from m2r2.engine import Engine

#: Default threshold of the shipped routers (see benchmarks/dynamic/MOD_NOTES.md).
DEFAULT_THRESHOLD = 0.5


def check_threshold(threshold: object) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not math.isfinite(threshold):
        raise SettingsError(f"mod: threshold must be a number in [0, 1], got {threshold!r}")
    if not 0.0 <= threshold <= 1.0:
        raise SettingsError(f"mod: threshold must be in [0, 1] (0 = run every block), got {threshold}")
    return float(threshold)


class MixtureOfDepths:
    """Greedy/sampled decoding where each token runs only the blocks its routers pick."""

    name = "mod"

    def __init__(
        self,
        model: Transformer,
        routers: Routers,
        threshold: float,
        eos_ids: list[int],
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.model = model
        self.routers = routers
        self.threshold = check_threshold(threshold)
        self.eos_ids = eos_ids
        self.decode = decode
        self.routed = set(routers.cfg.routed)
        # g >= threshold  <=>  router logit >= logit(threshold): no sigmoid per block
        t = self.threshold
        self.cut = math.inf if t >= 1.0 else -math.inf if t <= 0.0 else math.log(t / (1.0 - t))
        self.holes: set[int] = set()  # blocks with a skipped slot in the current cache

    def step(self, tok: int, cache: KVCache, valid: Tensor) -> tuple[Tensor, int]:
        """Logits for one token at ``cache.length`` and the number of blocks it ran.

        ``valid[i, s]`` is False where slot ``s`` holds no K/V at block ``i`` (its token skipped it).
        """
        m, pos = self.model, cache.length
        x = m.embed_tokens(torch.tensor([[tok]], device=m.device))
        cos, sin = m.rope(pos, 1, x.dtype)
        causal = m.causal_mask(pos, 1, cache.max_len)
        ran = 0
        for i, blk in enumerate(m.layers):
            if self.threshold > 0 and i in self.routed and self.routers.logit(x, i) < self.cut:
                valid[i, pos] = False  # no K/V written at this block: masked out for later tokens
                self.holes.add(i)
                continue
            x = blk(x, cos, sin, cache, i, pos, causal & valid[i] if i in self.holes else causal)
            ran += 1
        cache.length = pos + 1
        return m.head(x), ran

    @torch.inference_mode()
    def generate(
        self, prompt: list[int], gen: GenerationConfig, stream: StreamCallback | None = None
    ) -> GenerationResult:
        m = self.model
        t0, stopper, cache, logits = begin(m, prompt, gen, self.eos_ids, self.decode)
        sampler = Sampler(gen, m.device)
        valid = torch.ones(m.cfg.num_layers, cache.max_len, dtype=torch.bool, device=m.device)
        self.holes = set()
        n_layers = m.cfg.num_layers
        layers_run, steps = [n_layers], 1  # the prefill's last position gives the first token
        while True:
            tok = sampler(logits[0, -1])
            if stopper.push([tok]) and stream is not None:
                stream([tok])
            if stopper.done:
                break
            logits, ran = self.step(tok, cache, valid)
            layers_run.append(ran)
            steps += 1
        return GenerationResult(
            tokens=stopper.tokens,
            seconds=time.perf_counter() - t0,
            stop_reason=str(stopper.reason),
            prompt_tokens=len(prompt),
            stats={
                "forward_passes": steps,
                "layers_per_token": sum(layers_run) / len(layers_run),
                "threshold": self.threshold,
            },
        )


@register("mod", "Mixture-of-Depths baseline: trained per-block routers let each token skip blocks (lossy)")
def _mod(engine: Engine, *, threshold: float = DEFAULT_THRESHOLD, routers: str | None = None) -> MixtureOfDepths:
    threshold = check_threshold(threshold)
    r = load_default_routers(engine.model, engine.fingerprint, Path(routers) if routers else None)
    return MixtureOfDepths(engine.model, r, threshold, engine.tokenizer.eos_ids, engine.tokenizer.decode)
