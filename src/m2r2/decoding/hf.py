"""Peer methods on transformers (and llama.cpp when installed): the baselines M2R2 is measured against.

They run the very weights our model runs (``engine.model_dir``), so differences in speed come from
the decoding method and the implementation, not the model. Stopping goes through the shared
:class:`~m2r2.decoding.base.Stopper`, hooked into ``generate`` as a stopping criterion, so these
methods end their output at exactly the token ours do and stop computing there too.
"""

from __future__ import annotations

import importlib.util
import json
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from m2r2.decoding import register
from m2r2.decoding.base import GenerationConfig, GenerationResult, Stopper, StreamCallback, check_prompt
from m2r2.errors import M2R2Error, SettingsError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from m2r2.cache import Conversation
    from m2r2.decoding.base import Loaded

#: Prompt-lookup draft length, as in transformers' documentation and Spec-Bench.
PLD_TOKENS = 10

# One transformers model per engine, shared by all hf methods; weak so it goes with the engine.
_MODELS: weakref.WeakKeyDictionary[Loaded, PreTrainedModel] = weakref.WeakKeyDictionary()


class UnsupportedMethodError(M2R2Error):
    """A peer method that this installation (library version, architecture) cannot run."""


def hf_model(engine: Loaded) -> PreTrainedModel:
    """The transformers model on the engine's weights, dtype and device (loaded once per engine)."""
    model = _MODELS.get(engine)
    if model is None:
        from transformers import AutoModelForCausalLM
        from transformers import GenerationConfig as HFConfig
        from transformers.utils import logging as hf_logging

        from m2r2.loading import parse_dtype

        hf_logging.set_verbosity_error()
        bars_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # its "Loading weights" bar would garble the benchmark's
        try:
            model = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=parse_dtype(engine.dtype_name))
        finally:
            if bars_on:
                hf_logging.enable_progress_bar()
        model = model.to(engine.device).eval()
        # Start from a blank config so nothing from generation_config.json (top_k=50 defaults, ...)
        # leaks into a run: every setting comes from our GenerationConfig.
        model.generation_config = HFConfig(pad_token_id=engine.tokenizer.eos_ids[0])
        _MODELS[engine] = model
    return model


class _StopAt:
    """transformers stopping criterion that feeds new ids to our Stopper (and the stream callback)."""

    def __init__(self, stopper: Stopper, prompt_len: int, stream: StreamCallback | None) -> None:
        self.stopper, self.seen, self.stream = stopper, prompt_len, stream

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        new = input_ids[0, self.seen :].tolist()
        self.seen = input_ids.shape[1]
        self.stopper.emit(new, self.stream)
        return torch.full((input_ids.shape[0],), self.stopper.done, dtype=torch.bool, device=input_ids.device)


class HFGenerate:
    """``model.generate`` with extra generation settings (prompt lookup, early-exit drafting)."""

    def __init__(
        self,
        name: str,
        model: PreTrainedModel,
        eos_ids: list[int],
        decode: Callable[[list[int]], str] | None,
        extra: dict[str, Any] | None = None,
        exit_layer: int | None = None,
    ) -> None:
        self.name, self.model, self.eos_ids, self.decode = name, model, eos_ids, decode
        self.extra = extra or {}
        self.exit_layer = exit_layer
        self.layers = int(model.config.num_hidden_layers)
        self.calls = {"full": 0, "draft": 0}
        base = getattr(model, model.base_model_prefix)
        # Count forward passes: early-exit drafts run the same module with fewer layers configured.
        model.register_forward_pre_hook(lambda *_: self._count(base.config.num_hidden_layers))

    def _count(self, layers: int) -> None:
        self.calls["full" if layers == self.layers else "draft"] += 1

    def _config(self, gen: GenerationConfig, budget: int) -> Any:
        from transformers import GenerationConfig as HFConfig

        sampling = {} if gen.greedy else {"temperature": gen.temperature, "top_k": gen.top_k, "top_p": gen.top_p}
        return HFConfig(
            max_new_tokens=budget,
            do_sample=not gen.greedy,
            eos_token_id=self.eos_ids,
            pad_token_id=self.eos_ids[0],
            **sampling,
            **self.extra,
        )

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        gen: GenerationConfig,
        stream: StreamCallback | None = None,
        session: Conversation | None = None,
    ) -> GenerationResult:
        from transformers import StoppingCriteriaList

        gen.validate()
        ctx = int(self.model.config.max_position_embeddings)
        check_prompt(prompt, ctx)
        stopper = Stopper(gen, self.eos_ids, self.decode, ctx - len(prompt))
        config = self._config(gen, stopper.budget)
        stop = _StopAt(stopper, len(prompt), stream)
        ids = torch.tensor([prompt], device=self.model.device)
        if not gen.greedy:
            # transformers samples from torch's global generator; a seed makes runs reproducible.
            torch.manual_seed(gen.seed if gen.seed is not None else time.time_ns() % (2**63))
        self.calls.update(full=0, draft=0)
        t0 = time.perf_counter()
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([stop]),
        )
        seconds = time.perf_counter() - t0
        if not stopper.done:  # generate ended on its own (budget/EOS) after our last look
            stop(out)
        stats: dict[str, Any] = {"forward_passes": self.calls["full"]}
        if self.extra:  # speculative: tokens per full forward pass, the usual "accepted length"
            stats["mean_accepted"] = len(stopper.tokens) / max(1, self.calls["full"])
        if self.exit_layer is not None:
            stats["draft_passes"] = self.calls["draft"]
            stats["exit_layer"] = self.exit_layer
        return GenerationResult(
            tokens=stopper.tokens,
            seconds=seconds,
            stop_reason=str(stopper.reason),
            prompt_tokens=len(prompt),
            stats=stats,
        )


def _supports_early_exit(model: PreTrainedModel) -> bool:
    """transformers' early exit works by lowering ``config.num_hidden_layers`` during drafting, which
    only takes effect if the decoder loop slices its layers by that config value (Llama does)."""
    import inspect

    base = getattr(model, model.base_model_prefix)
    try:
        src = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    return "[:self.config.num_hidden_layers]" in src.replace(" ", "")


@register("hf", "transformers generate on the same weights (greedy or sampling)")
def _hf(engine: Loaded) -> HFGenerate:
    return HFGenerate("hf", hf_model(engine), engine.tokenizer.eos_ids, engine.tokenizer.decode)


@register("hf-pld", f"transformers prompt lookup decoding ({PLD_TOKENS} draft tokens from n-gram matches)")
def _hf_pld(engine: Loaded) -> HFGenerate:
    extra = {"prompt_lookup_num_tokens": PLD_TOKENS}
    return HFGenerate("hf-pld", hf_model(engine), engine.tokenizer.eos_ids, engine.tokenizer.decode, extra)


@register("hf-early-exit", "transformers LayerSkip-style self-speculation: draft with the first layers, verify")
def _hf_early_exit(engine: Loaded, exit_layer: int | None = None) -> HFGenerate:
    model = hf_model(engine)
    layers = int(model.config.num_hidden_layers)
    exit_layer = layers // 3 if exit_layer is None else int(exit_layer)
    if not 1 <= exit_layer < layers:
        raise SettingsError(f"exit_layer must be in [1, {layers - 1}], got {exit_layer}")
    if not _supports_early_exit(model):
        import transformers

        raise UnsupportedMethodError(
            f"hf-early-exit: transformers {transformers.__version__} cannot exit early in "
            f"{type(model).__name__} (its decoder loop ignores config.num_hidden_layers)"
        )
    extra = {"assistant_early_exit": exit_layer}
    return HFGenerate(
        "hf-early-exit", model, engine.tokenizer.eos_ids, engine.tokenizer.decode, extra, exit_layer=exit_layer
    )


class LlamaCpp:
    """llama.cpp through llama-cpp-python on the original GGUF (its own quantized kernels)."""

    name = "llamacpp"

    def __init__(self, gguf: str, eos_ids: list[int], decode: Callable[[list[int]], str], threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=gguf, n_ctx=0, n_threads=threads, verbose=False)
        self.eos_ids, self.decode = eos_ids, decode

    def generate(
        self,
        prompt: list[int],
        gen: GenerationConfig,
        stream: StreamCallback | None = None,
        session: Conversation | None = None,
    ) -> GenerationResult:
        gen.validate()
        ctx = int(self.llm.n_ctx())
        check_prompt(prompt, ctx)
        stopper = Stopper(gen, self.eos_ids, self.decode, ctx - len(prompt))
        if not gen.greedy and gen.seed is not None:
            self.llm.set_seed(gen.seed)
        # Spell out every sampler llama.cpp would otherwise apply by default (min_p, repeat penalty).
        sampling = {
            "temp": gen.temperature,
            "top_k": gen.top_k,
            "top_p": gen.top_p,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
        }
        t0 = time.perf_counter()
        for tok in self.llm.generate(prompt, reset=True, **sampling):
            stopper.emit([int(tok)], stream)
            if stopper.done:
                break
        return stopper.result(
            t0,
            prompt,
        )


def _gguf_of(engine: Loaded) -> str:
    """The GGUF the engine's model was converted from (only the bundled one can be found again)."""
    from m2r2.loading import BUNDLED, FINGERPRINT_FILE, bundled_gguf

    source = json.loads((engine.model_dir / FINGERPRINT_FILE).read_text()).get("source", "")
    for name, spec in BUNDLED.items():
        if source.startswith(spec.gguf + " "):
            return str(bundled_gguf(name))
    raise SettingsError("llamacpp needs a GGUF file: pass the option gguf=PATH")


if importlib.util.find_spec("llama_cpp") is not None:

    @register("llamacpp", "llama.cpp (llama-cpp-python) on the original quantized GGUF")
    def _llamacpp(engine: Loaded, gguf: str | None = None) -> LlamaCpp:
        return LlamaCpp(
            gguf or _gguf_of(engine), engine.tokenizer.eos_ids, engine.tokenizer.decode, torch.get_num_threads()
        )
