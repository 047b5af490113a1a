"""MoE offloading runtime: expert store, cache, loader thread and prefetch policies on tiny random MoEs."""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from m2r2.config import ModelConfig
from m2r2.decoding.autoregressive import Autoregressive
from m2r2.decoding.base import GenerationConfig
from m2r2.errors import SettingsError, WeightsError
from m2r2.model import Transformer
from m2r2.moe.cache import ExpertCache
from m2r2.moe.policies import POLICIES, moe_layers
from m2r2.moe.runtime import OffloadedMoE, expert_store, record_trace, total_experts
from m2r2.moe.store import ExpertStore
from m2r2.multirate.fast import FastConfig, FastStream

LAYERS, EXPERTS, TOP_K = 6, 4, 2
PROMPT = [3, 17, 42, 9, 88, 5, 61]
GEN = GenerationConfig(max_new_tokens=12)


def tiny_moe(seed: int = 0, sparse: list[int] | None = None) -> Transformer:
    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=16,
        router_weights="softmax_topk_renorm",
        sparse_layers=sparse,
    )
    torch.manual_seed(seed)
    model = Transformer(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    model.reset_rope()
    return model.eval().requires_grad_(False)


def tiny_fast(model: Transformer) -> FastStream:
    """A fast stream with non-zero adapters (R = 2, prefix path), so the adapter path really runs."""
    fast = FastStream(model, FastConfig.build(model.cfg.num_layers, rate=2, rank=4))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in fast.named_parameters():
            if ".B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return fast.freeze()


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_moe()


@pytest.fixture(scope="module")
def store(model: Transformer, tmp_path_factory: pytest.TempPathFactory) -> ExpertStore:
    return expert_store(model, tmp_path_factory.mktemp("experts") / "experts.safetensors")


@pytest.fixture(scope="module")
def reference(model: Transformer) -> list[int]:
    return Autoregressive(model, eos_ids=[]).generate(PROMPT, GEN).tokens


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "m2r2-expert-loader" and t.is_alive()]


# --------------------------------------------------------------------------- store


def test_store_roundtrip(model: Transformer, store: ExpertStore) -> None:
    assert len(store.keys) == total_experts(model) == LAYERS * EXPERTS
    for layer, e in [(0, 0), (3, 2), (LAYERS - 1, EXPERTS - 1)]:
        w13, w2 = store.read((layer, e))
        moe = model.layers[layer].mlp
        assert torch.equal(w13, moe.w13[e]) and torch.equal(w2, moe.w2[e])
    assert store.expert_bytes == (moe.w13[0].numel() + moe.w2[0].numel()) * 4


def test_corrupt_expert_file(store: ExpertStore, tmp_path: Path) -> None:
    data = store.path.read_bytes()
    cases = {
        "truncated": data[: len(data) - 100],
        "no header": data[:5],
        "bad header": data[:8] + b"{not json" + data[17:],
        "flipped byte": data[:-50] + bytes([data[-50] ^ 0xFF]) + data[-49:],
    }
    for what, blob in cases.items():
        path = tmp_path / f"{what}.safetensors"
        path.write_bytes(blob)
        with pytest.raises(WeightsError, match="expert file") as err:
            ExpertStore(path)
        assert "corrupt" in str(err.value) or "truncated" in str(err.value), what
    with pytest.raises(WeightsError, match="cannot be opened"):
        ExpertStore(tmp_path / "missing.safetensors")


# --------------------------------------------------------------------------- cache


def test_lru_eviction_order() -> None:
    cache = ExpertCache(3, (4, 2), (2, 2), torch.float32)

    def demand(key: tuple[int, int]) -> None:  # what a fetch does for a missing expert
        cache.pin(key)
        assert cache.reserve(key, None) is not None
        cache.complete(key, 0.0)
        cache.unpin(key)

    with cache.cond:
        for key in [(0, 0), (0, 1), (0, 2)]:
            demand(key)
        cache.used((0, 0))  # (0, 1) is now the least recently used
        demand((1, 0))
        assert (0, 1) not in cache and (0, 0) in cache
        cache.pin((0, 2))  # pinned: skipped although least recently used
        demand((1, 1))
        assert (0, 2) in cache and (0, 0) not in cache
        assert len(cache) == cache.capacity
        cache.unpin((0, 2))
        # a prefetch lands at the LRU front: once its prediction is stale and unused, it goes first
        cache.now = 0
        cache.predict((2, 0), 5)
        assert cache.reserve((2, 0), 5) is not None  # evicts (0, 2), the least recently used
        cache.complete((2, 0), 0.0)
        assert cache.victim(None) == (1, 0)  # claimed until time 5
        cache.now = 5
        assert cache.victim(None) == (2, 0)  # never used: first to go
        cache.used((2, 0))
        assert cache.victim(None) == (1, 0)


def test_prefetch_never_evicts_an_expert_needed_sooner() -> None:
    cache = ExpertCache(2, (4, 2), (2, 2), torch.float32)
    with cache.cond:
        cache.now = 0
        for key, need in [((1, 0), 5), ((2, 0), 9)]:
            cache.reserve(key, need)
            cache.complete(key, 0.0)
            cache.predict(key, need)
        assert cache.reserve((3, 0), 12) is None  # both are needed sooner: the prefetch is dropped
        cache.predict((3, 0), 7)
        assert cache.reserve((3, 0), 7) is not None  # evicts the one needed latest, (2, 0) at 9
        assert (2, 0) not in cache and (1, 0) in cache
        cache.complete((3, 0), 0.0)
        cache.now = 6  # (1, 0)'s prediction is stale now: plain LRU again
        assert cache.victim(20) == (1, 0)


# --------------------------------------------------------------------------- policies


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_outputs_identical_across_policies(
    model: Transformer, store: ExpertStore, reference: list[int], fraction: float
) -> None:
    capacity = max(EXPERTS, round(fraction * total_experts(model)))
    run = OffloadedMoE(model, store, capacity, eos_ids=[])
    _, trace = record_trace(model, PROMPT, GEN, eos_ids=[])
    fast = tiny_fast(model)
    for policy in POLICIES:
        out = run.generate(PROMPT, GEN, policy=policy, fast=fast, trace=trace)
        assert out.tokens == reference, policy
        s = out.stats
        assert s["max_resident"] <= capacity
        assert s["evictions"] > 0, "the test must exercise eviction"
        assert s["counts"]["decode"]["requests"] == sum(len(v) for step in trace[1:] for v in step.values())
        if policy == "oracle":
            assert all(v["precision"] == 1.0 and v["recall"] == 1.0 for v in s["prediction"]["oracle"].values())
        if policy == "m2r2":  # default: fast layers run attention + shared expert only
            assert s["prediction"]["fast"], "the fast stream made no predictions"
            assert s["fast_expert_coverage"] == 0
    out = run.generate(PROMPT, GEN, policy="m2r2", fast=fast, fast_experts="cache")
    assert out.tokens == reference
    assert 0 < out.stats["fast_expert_coverage"] <= 1  # fast layers used the resident experts
    with pytest.raises(SettingsError, match="fast_experts"):
        run.generate(PROMPT, GEN, policy="m2r2", fast=fast, fast_experts="all")
    with pytest.raises(SettingsError, match="depth"):
        run.generate(PROMPT, GEN, policy="m2r2", fast=fast, depth=0)
    # fewer fast layers: the same output, predictions only as far as the fast layers run reach
    for depth in (1, None):
        out = run.generate(PROMPT, GEN, policy="m2r2", fast=fast, depth=depth)
        assert out.tokens == reference
        reach = max(int(d) for d in out.stats["prediction"]["fast"])
        if depth == 1:
            assert reach <= fast.cfg.rate, reach  # fast layer 1 predicts layers 0..R-1 only
        else:
            assert reach > fast.cfg.rate
    for m in model.layers:  # sources are detached after each generation
        assert m.mlp.source is None


def test_dense_layers_between_sparse_ones(store: ExpertStore, tmp_path: Path) -> None:
    model = tiny_moe(seed=3, sparse=[1, 2, 4])
    ref = Autoregressive(model, eos_ids=[]).generate(PROMPT, GEN).tokens
    st = expert_store(model, tmp_path / "e.safetensors")
    assert sorted({k[0] for k in st.keys}) == moe_layers(model) == [1, 2, 4]
    run = OffloadedMoE(model, st, EXPERTS, eos_ids=[])
    _, trace = record_trace(model, PROMPT, GEN, eos_ids=[])
    for policy in POLICIES:
        assert run.generate(PROMPT, GEN, policy=policy, fast=tiny_fast(model), trace=trace).tokens == ref


def test_capacity_holds_under_prefetch_pressure(model: Transformer, store: ExpertStore) -> None:
    """The oracle asks for everything within a long horizon: far more than fits."""
    run = OffloadedMoE(model, store, EXPERTS, eos_ids=[])
    _, trace = record_trace(model, PROMPT, GEN, eos_ids=[])
    out = run.generate(PROMPT, GEN, policy="oracle", trace=trace, horizon=10 * LAYERS)
    assert out.stats["max_resident"] <= EXPERTS
    assert out.stats["prefetch_dropped"] + out.stats["prefetch_cancelled"] > 0
    with pytest.raises(SettingsError, match="at least one layer"):
        OffloadedMoE(model, store, EXPERTS - 1, eos_ids=[])


def test_on_demand_is_lru_and_counts_stalls(model: Transformer, store: ExpertStore, reference: list[int]) -> None:
    """With a slow modelled link every miss stalls; misses follow an LRU simulation of the trace exactly."""
    capacity = 2 * EXPERTS
    bandwidth = store.expert_bytes / 2e-3  # 2 ms per expert copy
    run = OffloadedMoE(model, store, capacity, eos_ids=[], bandwidth=bandwidth)
    _, trace = record_trace(model, PROMPT, GEN, eos_ids=[])
    out = run.generate(PROMPT, GEN, policy="on-demand")
    assert out.tokens == reference
    lru: OrderedDict[tuple[int, int], None] = OrderedDict()
    misses = stalls = 0
    for s, step in enumerate(trace):
        for layer, ids in step.items():
            keys = [(layer, e) for e in ids]
            missing = [k for k in keys if k not in lru]
            for k in keys:
                if k in lru:
                    lru.move_to_end(k)
            for k in missing:
                if len(lru) >= capacity:
                    del lru[next(v for v in lru if v not in keys)]
                lru[k] = None
            if s > 0:
                misses += len(missing)
                stalls += bool(missing)
    dec = out.stats["counts"]["decode"]
    assert (dec["misses"], dec.get("late", 0), dec["stalls"]) == (misses, 0, stalls)
    assert misses > 0
    assert out.stats["copy_s_modelled"] == pytest.approx(out.stats["loads"] * 2e-3)
    assert out.stats["stall_s_per_token"] > 0


# --------------------------------------------------------------------------- loader shutdown


def test_loader_error_propagates_and_thread_stops(
    model: Transformer, store: ExpertStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = OffloadedMoE(model, store, EXPERTS * 2, eos_ids=[])
    calls = 0

    def broken(key, w13, w2):
        nonlocal calls
        calls += 1
        if calls > 5:
            raise OSError("disk on fire")
        return ExpertStore.read_into(store, key, w13, w2)

    monkeypatch.setattr(store, "read_into", broken)
    with pytest.raises(OSError, match="disk on fire"):
        run.generate(PROMPT, GEN, policy="next-gate")
    assert not loader_threads()
    assert all(m.mlp.source is None for m in model.layers)


def test_truncated_file_during_run_is_a_weights_error(model: Transformer, tmp_path: Path) -> None:
    path = tmp_path / "experts.safetensors"
    st = expert_store(model, path)
    os.truncate(path, path.stat().st_size // 2)  # damaged after it was opened and verified
    with pytest.raises(WeightsError, match="truncated"):
        OffloadedMoE(model, st, EXPERTS, eos_ids=[]).generate(PROMPT, GEN)
    assert not loader_threads()


def test_interrupt_stops_the_loader(model: Transformer, store: ExpertStore) -> None:
    run = OffloadedMoE(model, store, EXPERTS, eos_ids=[], bandwidth=store.expert_bytes / 1e-3)
    seen = []

    def interrupt(ids: list[int]) -> None:
        seen.extend(ids)
        if len(seen) >= 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run.generate(PROMPT, GEN, policy="next-gate", stream=interrupt)
    assert not loader_threads()
    # the runtime is usable again afterwards
    assert run.generate(PROMPT, GEN).tokens == Autoregressive(model, eos_ids=[]).generate(PROMPT, GEN).tokens


# --------------------------------------------------------------------------- the benchmark suite


def test_bench_suite_moe_end_to_end(tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`m2r2 bench --suite moe` on a tiny MoEfied model: results.json layout, table, plot, identical outputs."""
    import json
    import random

    from m2r2.cli import main
    from m2r2.engine import Engine
    from m2r2.moe.moefy import MoefySettings, moefy
    from m2r2.multirate.io import save_adapters

    monkeypatch.setenv("M2R2_CACHE", str(tmp_path / "cache"))
    g = random.Random(0)
    seqs = [[g.randrange(300) for _ in range(40)] for _ in range(8)]
    moe_dir = tmp_path / "moe"
    moefy(tiny_model(layers=4), moe_dir, seqs, MoefySettings(experts=4, top_k=2, tokens_per_layer=256, router_steps=30))
    eng = Engine(model=moe_dir, dtype="fp32", quiet=True)
    adapters = save_adapters(tmp_path / "fast" / "adapters", tiny_fast(eng.model), eng.fingerprint)
    out = tmp_path / "bench"
    args = ["bench", "--suite", "moe", "--model", str(moe_dir), "--dtype", "fp32", "--threads", "1"]
    args += ["--dataset", "builtin", "--limit", "2", "--max-new-tokens", "6", "--out", str(out)]
    args += ["--bandwidths", "measured,1GB/s", "--cache-fractions", "0.25,0.5", "--adapters", str(adapters)]
    assert main(args) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["moe"]) == {"measured", "1GB/s"}
    assert set(res["moe"]["1GB/s"]) == {"0.25", "0.5"}
    for cell in (c for by_f in res["moe"].values() for c in by_f.values()):
        assert list(cell) == list(POLICIES)
        assert cell["on-demand"]["speedup"] == pytest.approx(1.0)
        for m in cell.values():
            assert m["identical"] == 1.0 and 0 <= m["hit_rate"] <= 1 and m["tokens_per_s"] > 0
        assert cell["oracle"]["prediction"]["oracle"] and cell["m2r2"]["prediction"]["fast"]
    assert res["bandwidths"] == {"measured": None, "1GB/s": 1e9}
    assert (out / "moe.png").stat().st_size > 0 and "| 1GB/s |" in (out / "results.md").read_text()
    assert main([*args[:-8], "--bandwidths", "fast", "--out", str(out)]) == 2  # bad bandwidth: clear error


def test_train_init_copies_matching_adapters(model: Transformer, tmp_path: Path) -> None:
    """`m2r2 train --init`: tensors with matching names and shapes are copied, a misfit is refused."""
    from m2r2.multirate.io import save_adapters
    from m2r2.training.loop import init_from

    src = tiny_fast(model)
    path = save_adapters(tmp_path / "a", src, "fp", dtype=torch.float32)
    fresh = FastStream(model, FastConfig.build(model.cfg.num_layers, rate=2, rank=4))
    assert init_from(fresh, path) == len(src.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), src.state_dict().values(), strict=True))
    other = FastStream(model, FastConfig.build(model.cfg.num_layers, rate=2, rank=3))
    assert 0 < init_from(other, path) < len(src.state_dict())  # ARLA fits, rank-4 adapters do not
    from safetensors.torch import save_file

    save_file({"something.else": torch.zeros(3)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(SettingsError, match="no tensor"):
        init_from(other, tmp_path / "x.safetensors")
