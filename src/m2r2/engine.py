"""The user-facing entry point: load a model once, then generate with any decoding method.

``Engine`` owns the model, tokenizer and settings that every strategy shares; strategies are
built on demand by name from :mod:`m2r2.decoding` and cached, so the benchmark and the CLI use
exactly the same objects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from m2r2.cache import Conversation
from m2r2.decoding import AUTO_METHOD, DEFAULT_METHOD, build_strategy, check_options, method_names
from m2r2.decoding.base import GenerationConfig, GenerationResult, Strategy, StreamCallback, trim_stop_text
from m2r2.errors import UnknownNameError
from m2r2.loading import load_model, parse_dtype, resolve_model
from m2r2.machine import default_device, set_threads
from m2r2.model import Transformer
from m2r2.tokenizer import ChatTokenizer, Message

#: Reference precision: plain fp32 kernels, greedy output identical to transformers' generate.
REFERENCE_DTYPE = "fp32"
#: Default precision, chosen by measurement on the project's CPU (BENCHMARKS.md).
DEFAULT_DTYPE = "bf16"


@dataclass
class Completion:
    """One generated answer: decoded text plus the raw result."""

    text: str
    result: GenerationResult
    method: str
    prompt_ids: list[int] = field(repr=False, default_factory=list)

    def summary(self) -> str:
        r = self.result
        line = f"[{self.method}] {r.new_tokens} tokens in {r.seconds:.2f} s = {r.tokens_per_s:.1f} tok/s"
        acc = r.stats.get("mean_accepted")
        if acc is not None:
            line += f", mean accepted {acc:.2f} tokens/verify"
        if reused := r.stats.get("prompt_reused"):
            line += f", {reused} of {r.prompt_tokens} prompt tokens cached"
        return line + f" (stop: {r.stop_reason})"

    def to_json(self) -> dict[str, Any]:
        r = self.result
        return {
            "text": self.text,
            "new_tokens": r.new_tokens,
            "prompt_tokens": r.prompt_tokens,
            "seconds": r.seconds,
            "tokens_per_s": r.tokens_per_s,
            "method": self.method,
            "stop_reason": r.stop_reason,
            "stats": r.stats,
        }


class Engine:
    """A loaded model plus tokenizer; ``generate`` runs any registered decoding method."""

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        dtype: str = DEFAULT_DTYPE,
        device: str | None = None,
        kernel: str = "auto",
        threads: int | None = None,
        quiet: bool = False,
    ) -> None:
        set_threads(threads)
        self.dtype_name = "fp32" if parse_dtype(dtype) == torch.float32 else "bf16"
        self.device = device or default_device()
        # fp32 is the reference mode: plain kernels, so output matches transformers exactly. A bf16 kernel asked
        # for by name is refused by load_model (one line) rather than quietly replaced.
        if self.dtype_name == REFERENCE_DTYPE and kernel == "auto":
            kernel = "plain"
        self.model_dir: Path = resolve_model(model, quiet=quiet)
        loaded = load_model(self.model_dir, parse_dtype(dtype), self.device, kernel=kernel)
        self.model: Transformer = loaded.model
        self.fingerprint = loaded.fingerprint
        self.kernel = loaded.kernel
        self.tokenizer = ChatTokenizer(self.model_dir, extra_eos=self.model.cfg.eos_token_ids)
        self._strategies: dict[tuple[str, tuple[tuple[str, Any], ...]], Strategy] = {}

    @property
    def context(self) -> int:
        return self.model.cfg.max_position_embeddings

    def resolve_method(self, method: str, **options: Any) -> str:
        """``auto`` -> ``m2r2`` when adapters are given or ship for this base model, else ``vanilla``.

        Lossless either way, so ``auto`` can be the CLI default: the bundled SmolLM2 ships adapters,
        any other model decodes plainly until adapters are trained for it (``m2r2 train``).
        """
        if method != AUTO_METHOD:
            return method
        from m2r2.multirate.io import bundled_adapters

        return "m2r2" if options.get("adapters") or bundled_adapters(self.fingerprint, None) else "vanilla"

    def strategy(self, method: str, **options: Any) -> Strategy:
        """The strategy called ``method`` (built once per option set; ``auto`` as in :meth:`resolve_method`)."""
        method = self.resolve_method(method, **options)
        if method not in method_names():
            choices = ", ".join([AUTO_METHOD, *method_names()])
            raise UnknownNameError(f"unknown method {method!r}; choose from {choices}")
        options = check_options(method, options)
        key = (method, tuple(sorted(options.items())))
        if key not in self._strategies:
            self._strategies[key] = build_strategy(method, self, **options)
        return self._strategies[key]

    def generate_ids(
        self,
        prompt_ids: list[int],
        method: str = DEFAULT_METHOD,
        gen: GenerationConfig | None = None,
        stream: StreamCallback | None = None,
        session: Conversation | None = None,
        **options: Any,
    ) -> GenerationResult:
        """Generate after ``prompt_ids``; ``session`` carries a conversation's KV cache from turn to turn
        (a later turn prefills only what the earlier ones have not seen; ``stats["prompt_reused"]``)."""
        gen = (gen or GenerationConfig()).validate()
        strategy = self.strategy(method, **options)
        if session is None:
            return strategy.generate(prompt_ids, gen, stream)
        session.reused = 0
        result = strategy.generate(prompt_ids, gen, stream, session=session)
        result.stats["prompt_reused"] = session.reused
        return result

    def chat(
        self,
        messages: list[Message],
        method: str = DEFAULT_METHOD,
        gen: GenerationConfig | None = None,
        stream: StreamCallback | None = None,
        session: Conversation | None = None,
        **options: Any,
    ) -> Completion:
        """Answer the last user message of ``messages`` (chat template applied); ``session``: the
        conversation's cache, carried from turn to turn (:meth:`generate_ids`)."""
        gen = (gen or GenerationConfig()).validate()
        method = self.resolve_method(method, **options)
        ids = self.tokenizer.encode_chat(messages)
        result = self.generate_ids(ids, method, gen, stream, session, **options)
        text = self.tokenizer.decode(result.tokens)
        if gen.stop:
            text = trim_stop_text(text, gen.stop)
        return Completion(text=text, result=result, method=method, prompt_ids=ids)
