"""The one interface every decoding strategy implements, plus what they all share.

A strategy turns prompt token ids into new token ids. Everything around that (chat templates,
timing, the benchmark) lives outside, so a new method is one small module with a ``generate``.
Stopping (EOS, stop strings, token budget, context end) and sampling are shared here so that all
strategies cut their output at exactly the same place, which the lossless tests rely on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from m2r2.errors import InputError, SettingsError
from m2r2.kernels import argmax_rows

if TYPE_CHECKING:
    from pathlib import Path

    from m2r2.cache import Conversation, KVCache
    from m2r2.model import Transformer
    from m2r2.tokenizer import ChatTokenizer

#: Called with the token ids accepted since the last call (one or several at a time).
StreamCallback = Callable[[list[int]], None]


class Loaded(Protocol):
    """What a strategy is built from: a loaded model and what comes with it. The engine is one;
    strategies need no more than this, so they never import the engine."""

    model: Transformer
    tokenizer: ChatTokenizer
    fingerprint: str  # of the base weights: adapters and routers are bound to it
    model_dir: Path
    dtype_name: str
    kernel: str
    device: str


@dataclass
class GenerationConfig:
    """Sampling and stopping settings. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    def validate(self) -> GenerationConfig:
        if self.max_new_tokens < 1:
            raise SettingsError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SettingsError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SettingsError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SettingsError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise SettingsError("stop strings must not be empty")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise SettingsError(f"seed must fit in 64 bits, got {self.seed}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerationResult:
    """New tokens and what it took to produce them."""

    tokens: list[int]
    seconds: float
    stop_reason: str
    prompt_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class Strategy(Protocol):
    """A decoding method: ``generate`` must honour every field of the :class:`GenerationConfig`.

    ``session`` carries a conversation's cache from turn to turn (:class:`m2r2.cache.Conversation`);
    a method that cannot reuse one (transformers', llama.cpp's, the lossy dynamic decoders whose
    deep K/V may be pending) ignores it and prefills its whole prompt.
    """

    name: str

    def generate(
        self,
        prompt: list[int],
        gen: GenerationConfig,
        stream: StreamCallback | None = None,
        session: Conversation | None = None,
    ) -> GenerationResult: ...


#: Cache slots every strategy allocates beyond prompt + budget (covers the longest draft or
#: lookahead block). Attention spans the whole cache for row invariance (see ``Transformer.causal_mask``),
#: so all strategies must allocate the *same* capacity for their outputs to be bit-identical.
CACHE_SLACK = 64
#: Capacities are rounded up to a multiple of this (a size class): ``m2r2 serve`` attends over the
#: caches of one class in one call (``Transformer.step_rows``). Small, because attention over a few
#: rows costs in proportion to the capacity (it is memory-bound on a CPU), while one more class in a
#: batched step costs one more call, ~20 us per layer (BENCHMARKS.md, "Serving").
CACHE_CLASS = 64


def cache_capacity(prompt_len: int, budget: int, context: int) -> int:
    """KV-cache capacity for a generation: identical for every method given the same request (and for
    ``m2r2 serve``, which is how a served request gets the bits ``Engine.generate`` gives it alone).

    Prompt, budget and :data:`CACHE_SLACK`, rounded up to a multiple of :data:`CACHE_CLASS`, at most
    the model's ``context``.
    """
    need = prompt_len + budget + CACHE_SLACK
    return min(context, -(-need // CACHE_CLASS) * CACHE_CLASS)


def check_prompt(prompt: list[int], context: int) -> None:
    """Reject prompts that are empty or leave no room for a single new token."""
    if not prompt:
        raise InputError("the prompt is empty")
    if len(prompt) >= context:
        raise InputError(f"the prompt has {len(prompt)} tokens; the model's context window is {context}")


def begin(
    model: Transformer,
    prompt: list[int],
    gen: GenerationConfig,
    eos_ids: list[int],
    decode: Callable[[list[int]], str] | None,
    last_hidden: list[Tensor] | None = None,
    new_cache: Callable[[int], KVCache] | None = None,
    layers: list[Tensor] | None = None,
    session: Conversation | None = None,
) -> tuple[float, Stopper, KVCache, Tensor]:
    """The start every strategy shares: check settings and prompt, start the clock, set up stopping,
    allocate the cache at the common capacity and prefill the prompt.

    Returns ``(t0, stopper, cache, logits)`` with the prompt's last-position logits ``[1, 1, V]``.
    One place for this is what gives every method the same cache capacity (so their outputs are
    bit-identical) and the same stopping rules. ``last_hidden``, when given, receives the final slow
    state of the prompt's last position (``[1, 1, d]``; seeded drafters start from it), then that of
    every prompt position (``[1, n, d]``; EAGLE's cache takes them in).
    ``new_cache`` allocates the cache of a given capacity (default ``model.new_cache``; the server
    lends pooled ones). ``layers``, with ``last_hidden``, receives every block's output over the prompt
    (a tapped seeded stream reads some of them).
    ``session``, a conversation's earlier turns: the prompt positions it holds are copied, not
    prefilled (:class:`m2r2.cache.Conversation`); ``last_hidden`` and ``layers`` then cover only the
    positions prefilled, the last ``h.shape[1]`` of the prompt.
    """
    gen.validate()
    ctx = model.cfg.max_position_embeddings
    check_prompt(prompt, ctx)
    t0 = time.perf_counter()
    stopper = Stopper(gen, eos_ids, decode, ctx - len(prompt))
    cache = (new_cache or model.new_cache)(cache_capacity(len(prompt), stopper.budget, ctx))
    reused = session.reusable(prompt, model) if session is not None else 0
    if reused:
        assert session is not None and session.cache is not None
        cache.take_prefix(session.cache, reused)
    if session is not None:
        session.started(cache, prompt, reused, stopper.tokens, model)
    tokens = torch.tensor([prompt[reused:]], device=model.device)
    if last_hidden is None:  # through ``model(...)``: wrappers that hook each forward pass see it
        return t0, stopper, cache, model(tokens, cache, reused, last_only=True)
    h = model.run_layers(model.embed_tokens(tokens), cache, reused, layers)
    last_hidden += [h[:, -1:], h]
    return t0, stopper, cache, model.head(h[:, -1:])


def warp_probs(logits: Tensor, gen: GenerationConfig) -> Tensor:
    """Probabilities after temperature, top-k and top-p (``logits``: ``[..., V]`` float32).

    Speculative sampling needs these exact distributions for both draft and target, so they are
    computed in one place.
    """
    # Shift the max to 0 first (softmax is shift-invariant): a tiny temperature then sends the
    # other logits to -inf instead of overflowing everything to inf (NaN probabilities).
    logits = (logits - logits.amax(-1, keepdim=True)) / gen.temperature
    if gen.top_k and gen.top_k < logits.shape[-1]:
        kth = torch.topk(logits, gen.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if gen.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (cum - sorted_p) >= gen.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class Sampler:
    """Picks the next token from logits: argmax when greedy, else seeded multinomial sampling."""

    def __init__(self, gen: GenerationConfig, device: torch.device | str = "cpu") -> None:
        self.gen = gen
        self.rng: torch.Generator | None = None
        if not gen.greedy:
            self.rng = torch.Generator(device=device)
            self.rng.manual_seed(gen.seed if gen.seed is not None else int(time.time_ns() % (2**63)))

    def __call__(self, logits: Tensor) -> int:
        """``logits``: ``[V]`` for one position: float32, or the head's own dtype when greedy."""
        if self.rng is None:
            return int(argmax_rows(logits))
        return int(torch.multinomial(warp_probs(logits, self.gen), 1, generator=self.rng))


class Stopper:
    """Decides where output ends: EOS, a stop string, the token budget or the context window.

    ``push`` takes any number of new tokens (speculative methods accept several at once) and
    returns how many of them to keep, so every method stops at the same token.
    """

    def __init__(
        self,
        gen: GenerationConfig,
        eos_ids: list[int],
        decode: Callable[[list[int]], str] | None,
        room: int,
    ) -> None:
        self.eos = set(eos_ids)
        self.stop = gen.stop
        self.decode = decode
        self.budget = min(gen.max_new_tokens, room)
        self.budget_reason = "max_new_tokens" if gen.max_new_tokens <= room else "context"
        self.tokens: list[int] = []
        self.reason: str | None = None

    @property
    def done(self) -> bool:
        return self.reason is not None

    def emit(self, new: list[int], stream: StreamCallback | None = None) -> int:
        """:meth:`push`, then stream the tokens kept: how every strategy outputs tokens."""
        kept = self.push(new)
        if kept and stream is not None:
            stream(new[:kept])
        return kept

    def result(self, t0: float, prompt: list[int], stats: dict[str, Any] | None = None) -> GenerationResult:
        """What every strategy returns: the tokens kept, the seconds since ``t0``, why output ended."""
        return GenerationResult(self.tokens, time.perf_counter() - t0, str(self.reason), len(prompt), stats or {})

    def push(self, new: list[int]) -> int:
        kept = 0
        for tok in new:
            if self.done:
                break
            if tok in self.eos:
                self.reason = "eos"
                break
            self.tokens.append(tok)
            kept += 1
            if self.stop and self.decode is not None:
                tail = self.decode(self.tokens[-64:])
                if any(s in tail for s in self.stop):
                    self.reason = "stop_string"
            if len(self.tokens) >= self.budget and not self.done:
                self.reason = self.budget_reason
        return kept


def trim_stop_text(text: str, stop: list[str]) -> str:
    """Cut decoded text at the first stop string."""
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=-1)
    return text if cut < 0 else text[:cut]
