"""Plain autoregressive decoding on our model: the ``vanilla`` method and the reference for all others."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from m2r2.decoding import register
from m2r2.decoding.base import (
    GenerationConfig,
    GenerationResult,
    Sampler,
    StreamCallback,
    begin,
)
from m2r2.model import Transformer

if TYPE_CHECKING:
    from m2r2.cache import Conversation
    from m2r2.decoding.base import Loaded


class Autoregressive:
    """One forward pass per token over the preallocated KV cache."""

    name = "vanilla"

    def __init__(
        self, model: Transformer, eos_ids: list[int], decode: Callable[[list[int]], str] | None = None
    ) -> None:
        self.model = model
        self.eos_ids = eos_ids
        self.decode = decode

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        gen: GenerationConfig,
        stream: StreamCallback | None = None,
        session: Conversation | None = None,
    ) -> GenerationResult:
        t0, stopper, cache, logits = begin(self.model, prompt, gen, self.eos_ids, self.decode, session=session)
        sampler = Sampler(gen, self.model.device)
        steps, nxt = 1, None
        while True:
            tok = sampler(logits[0, -1]) if nxt is None else nxt
            stopper.emit([tok], stream)
            if stopper.done:
                break
            steps += 1
            # greedy: the whole step and its argmax in one C++ call where the kernel has it (the same token)
            fused = self.model.greedy_pass([tok], cache, cache.length) if gen.greedy else None
            if fused is not None:
                nxt = fused[0][0]
                continue
            # else the argmax reads the head's own output (the same token, no float32 copy of it)
            logits = self.model(torch.tensor([[tok]], device=self.model.device), cache, float_logits=not gen.greedy)
        return stopper.result(
            t0,
            prompt,
            stats={"forward_passes": steps, "layers_per_token": float(self.model.cfg.num_layers)},
        )


@register("vanilla", "plain autoregressive decoding on m2r2's own model (the baseline of every speedup)")
def _vanilla(engine: Loaded) -> Autoregressive:
    return Autoregressive(engine.model, engine.tokenizer.eos_ids, engine.tokenizer.decode)
