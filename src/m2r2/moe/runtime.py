"""Decoding an MoE model whose experts live in slow memory: store + cache + loader + policy.

:class:`OffloadedMoE` runs the same decoding loop as ``vanilla`` (same cache capacity, sampler and
stopping) with every MoE layer's ``source`` set to the policy for the duration of a generation, so
the model computes exactly what it computes with all experts resident: only *when* the weights
arrive changes. ``tests/test_moe_runtime.py`` checks the greedy outputs are identical.

The cache starts cold for every generation, so every policy starts from the same state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from m2r2.decoding.autoregressive import Autoregressive
from m2r2.decoding.base import GenerationConfig, GenerationResult, StreamCallback
from m2r2.errors import SettingsError
from m2r2.model import Transformer
from m2r2.moe.cache import ExpertCache
from m2r2.moe.loader import Loader
from m2r2.moe.policies import Policy, Trace, TraceRecorder, make_policy, moe_layers
from m2r2.moe.store import ExpertStore
from m2r2.multirate.fast import FastStream
from m2r2.paths import cache_root

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "fp32"}


def total_experts(model: Transformer) -> int:
    return sum(model.layers[i].mlp.num_experts for i in moe_layers(model))


def store_path(fingerprint: str, dtype: torch.dtype) -> Path:
    """Where the expert file of a model lives: ``$M2R2_CACHE/experts/<fingerprint>-<dtype>.safetensors``."""
    return cache_root() / "experts" / f"{fingerprint}-{_DTYPE_NAMES.get(dtype, str(dtype))}.safetensors"


def expert_store(model: Transformer, path: Path, verify: bool = True) -> ExpertStore:
    """Open the expert file at ``path``, writing it from the model's resident experts if missing."""
    if not path.is_file():
        experts = {}
        for i in moe_layers(model):
            moe = model.layers[i].mlp
            for e in range(moe.num_experts):
                experts[(i, e)] = (moe.w13[e], moe.w2[e])
        if not experts:
            raise SettingsError("the model has no MoE layers: nothing to offload")
        ExpertStore.write(path, experts, {"dtype": str(model.dtype)})
    store = ExpertStore(path, verify=verify)
    moe = model.layers[moe_layers(model)[0]].mlp
    want = (tuple(moe.w13.shape[1:]), tuple(moe.w2.shape[1:]), model.dtype, total_experts(model))
    if (store.w13_shape, store.w2_shape, store.dtype, len(store.layout)) != want:
        store.close()
        raise SettingsError(f"the expert file {path} belongs to another model or dtype; delete it to rebuild")
    return store


@contextmanager
def attached(model: Transformer, source: Any) -> Iterator[None]:
    """Route every MoE layer of ``model`` through ``source`` (restored to resident weights afterwards)."""
    blocks = [model.layers[i].mlp for i in moe_layers(model)]
    for moe in blocks:
        moe.source = source
    try:
        yield
    finally:
        for moe in blocks:
            moe.source = None
        source.finish()


class OffloadedMoE:
    """Autoregressive decoding with experts copied on demand / ahead of time into a bounded cache."""

    def __init__(
        self,
        model: Transformer,
        store: ExpertStore,
        capacity: int,
        eos_ids: list[int],
        decode: Callable[[list[int]], str] | None = None,
        bandwidth: float | None = None,
    ) -> None:
        sparse = moe_layers(model)
        if not sparse:
            raise SettingsError("the model has no MoE layers: nothing to offload")
        widest = max(model.layers[i].mlp.num_experts for i in sparse)
        if capacity < widest:  # one pass may need every expert of a layer at once
            raise SettingsError(f"the expert cache must hold at least one layer's {widest} experts, got {capacity}")
        self.model, self.store, self.eos_ids, self.decode = model, store, eos_ids, decode
        self.bandwidth = bandwidth
        self.cache = ExpertCache(capacity, store.w13_shape, store.w2_shape, model.dtype, model.device)

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        gen: GenerationConfig,
        policy: str = "on-demand",
        fast: FastStream | None = None,
        trace: Trace | None = None,
        stream: StreamCallback | None = None,
        **options: Any,
    ) -> GenerationResult:
        """Generate with ``policy``; ``stats`` carries hit rate, stalls, bytes and prediction scores."""
        self.cache.reset()
        with Loader(self.store, self.cache, self.bandwidth) as loader:
            pol = make_policy(policy, self.model, self.cache, loader, fast, trace, **options)
            out = _decode(self.model, pol, prompt, gen, self.eos_ids, self.decode, stream)
            stats = loader.stats.to_dict()
        rep = pol.report()
        out.stats.update(summarize(rep, stats, out, self.cache, self.store.expert_bytes))
        out.stats["policy"] = policy
        return out


def record_trace(
    model: Transformer,
    prompt: list[int],
    gen: GenerationConfig,
    eos_ids: list[int],
    decode: Callable[[list[int]], str] | None = None,
) -> tuple[GenerationResult, Trace]:
    """Generate with all experts resident, recording the routing (the oracle's knowledge)."""
    rec = TraceRecorder(model)
    with torch.inference_mode():
        out = _decode(model, rec, prompt, gen, eos_ids, decode, None)
    return out, rec.trace


class _Hooked:
    """The model as ``Autoregressive`` sees it: each forward pass first tells the source a step begins.

    Reusing the ``vanilla`` loop itself (not a copy of it) is what makes the outputs comparable
    token for token; the proxy also notes when the prefill pass ended.
    """

    def __init__(self, model: Transformer, source: Policy | TraceRecorder) -> None:
        self.model, self.source = model, source
        self.prefill_end: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, ids: Tensor, kv: Any, pos: int | None = None, **kw: Any) -> Tensor:
        self.source.begin_step(ids, kv.length if pos is None else pos, kv)
        out = self.model(ids, kv, pos, **kw)
        if self.prefill_end is None:
            self.prefill_end = time.perf_counter()
        return out


def _decode(
    model: Transformer,
    source: Policy | TraceRecorder,
    prompt: list[int],
    gen: GenerationConfig,
    eos_ids: list[int],
    decode: Callable[[list[int]], str] | None,
    stream: StreamCallback | None,
) -> GenerationResult:
    """The ``vanilla`` decoding loop with every MoE layer fetching from ``source``."""
    hooked = _Hooked(model, source)
    with attached(model, source):
        t0 = time.perf_counter()
        out = Autoregressive(hooked, eos_ids, decode).generate(prompt, gen, stream)  # type: ignore[arg-type]
    prefill_s = (hooked.prefill_end or t0) - t0
    out.stats.update(prefill_s=prefill_s, decode_s=max(out.seconds - prefill_s, 0.0))
    return out


def summarize(
    rep: dict[str, Any], loader: dict[str, Any], out: GenerationResult, cache: ExpertCache, expert_bytes: int
) -> dict[str, Any]:
    """Flat per-generation metrics (decode steps unless named ``prefill_``); figures are measured
    unless named ``modelled``."""
    dec = rep["counts"].get("decode", {})
    pre = rep["counts"].get("prefill", {})
    fast = rep["counts"].get("fast", {})
    steps = max(out.stats["forward_passes"] - 1, 1)  # decode forward passes
    req = dec.get("requests", 0)
    return {
        "hit_rate": dec.get("hits", 0) / req if req else 0.0,
        "late_rate": dec.get("late", 0) / req if req else 0.0,
        "miss_rate": dec.get("misses", 0) / req if req else 0.0,
        "stall_s_per_token": rep["stall_s"].get("decode", 0.0) / steps,
        "stalls_per_token": dec.get("stalls", 0) / steps,
        "prefill_stall_s": rep["stall_s"].get("prefill", 0.0),
        "prefill_hit_rate": pre.get("hits", 0) / pre["requests"] if pre.get("requests") else 0.0,
        "loads": loader["loads"],
        "bytes_loaded": loader["bytes"],
        "bytes_per_token": (loader["bytes"] - rep["decode_start"]["bytes"]) / steps,
        "prefill_bytes": rep["decode_start"]["bytes"],
        "expert_bytes": expert_bytes,
        "read_s_measured": loader["read_s"],
        "copy_s_modelled": loader["modelled_s"],
        "link_busy_s": loader["link_busy_s"],
        "prefetch_cancelled": loader["cancelled"],
        "prefetch_dropped": loader["dropped"],
        "evictions": cache.evictions,
        "max_resident": cache.max_resident,
        "capacity": cache.capacity,
        "fast_expert_coverage": fast.get("hits", 0) / fast["requests"] if fast.get("requests") else 0.0,
        "decode_tokens_per_s": steps / out.stats["decode_s"] if out.stats["decode_s"] > 0 else 0.0,
        "prediction": rep["prediction"],
        "counts": rep["counts"],
    }
