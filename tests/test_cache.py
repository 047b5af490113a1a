"""The preallocated KV cache: append, truncate / rollback, overflow (fp32 tiny models, ``atol=1e-5``)."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_VOCAB
from m2r2.cache import CacheRows, KVCache, KVPool
from m2r2.config import ModelConfig
from m2r2.decoding.base import CACHE_CLASS, cache_capacity
from m2r2.errors import InputError
from m2r2.loading import load_model
from m2r2.model import Transformer

ATOL = 1e-5


def rand_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=[{"arch": "llama"}, {"arch": "mistral", "sliding_window": 8}], ids=["llama", "mistral-window8"])
def model(request, tiny_model) -> Transformer:
    return load_model(tiny_model(**request.param), torch.float32, kernel="plain").model


def test_shape_and_dtype() -> None:
    cfg = ModelConfig(num_layers=3, num_kv_heads=2, head_dim=8)
    c = KVCache(cfg, max_len=10, batch=2, dtype=torch.bfloat16)
    assert c.k.shape == c.v.shape == (3, 2, 2, 10, 8)
    assert c.k.dtype == torch.bfloat16 and c.batch == 2 and c.length == 0 and c.max_len == 10


def test_write_view_and_overflow() -> None:
    cfg = ModelConfig(num_layers=1, num_kv_heads=1, head_dim=4)
    c = KVCache(cfg, max_len=5)
    k = torch.arange(12.0).view(1, 1, 3, 4)
    c.write(0, 1, k, -k)
    keys, values = c.view(0, 4)
    torch.testing.assert_close(keys[:, :, 1:4], k, atol=0, rtol=0)
    torch.testing.assert_close(values[:, :, 1:4], -k, atol=0, rtol=0)
    assert keys.shape[2] == 4
    with pytest.raises(InputError, match="overflow"):
        c.write(0, 3, k, k)  # positions 3..5 > capacity 5


@pytest.mark.parametrize("max_len", [0, -3])
def test_non_positive_length_rejected(max_len: int) -> None:
    with pytest.raises(InputError):
        KVCache(ModelConfig(), max_len=max_len)


def test_truncate_bounds() -> None:
    c = KVCache(ModelConfig(num_layers=1), max_len=8)
    c.length = 5
    c.truncate(5)
    c.truncate(2)
    assert c.length == 2
    for bad in (3, -1):
        with pytest.raises(ValueError):
            c.truncate(bad)
    assert c.length == 2


@torch.inference_mode()
def test_forward_past_capacity_raises_input_error(model: Transformer) -> None:
    cache = model.new_cache(10)
    with pytest.raises(InputError):
        model(rand_tokens(11, seed=0), cache, 0)
    model(rand_tokens(8, seed=0), cache, 0)
    with pytest.raises(InputError):
        model(rand_tokens(3, seed=1), cache)  # 8 + 3 > 10
    assert cache.length == 8  # a refused append leaves the verified prefix alone
    model(rand_tokens(2, seed=1), cache)  # exactly full is fine
    assert cache.length == 10


@torch.inference_mode()
def test_forward_advances_length(model: Transformer) -> None:
    cache = model.new_cache(32)
    model(rand_tokens(5, seed=2), cache, 0)
    assert cache.length == 5
    model(rand_tokens(3, seed=3), cache)
    assert cache.length == 8


@pytest.mark.parametrize("accepted", [0, 2, 5])
@torch.inference_mode()
def test_rollback_then_reappend_equals_fresh_prefill(model: Transformer, accepted: int) -> None:
    """Speculative decoding's pattern: append a 5-token draft, keep ``accepted`` of it, append others."""
    prompt, draft, other = rand_tokens(14, seed=4), rand_tokens(5, seed=5), rand_tokens(4, seed=6)
    cache = model.new_cache(32)
    model(prompt, cache, 0)
    model(draft, cache)
    cache.truncate(14 + accepted)
    got = model(other, cache)

    seq = torch.cat([prompt, draft[:, :accepted], other], dim=1)
    fresh_cache = model.new_cache(32)
    fresh = model(seq, fresh_cache, 0)
    n = seq.shape[1]
    assert cache.length == fresh_cache.length == n
    torch.testing.assert_close(got, fresh[:, -4:], atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.k[:, :, :, :n], fresh_cache.k[:, :, :, :n], atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.v[:, :, :, :n], fresh_cache.v[:, :, :, :n], atol=ATOL, rtol=0)
    if accepted < 5:
        # the rejected draft tokens really were in the cache, and really are gone from the result
        no_rollback = model(other, model.new_cache(32), 0)
        assert (got - no_rollback).abs().max() > 1e-3


@torch.inference_mode()
def test_explicit_pos_overwrites(model: Transformer) -> None:
    """Writing at an explicit ``pos`` below the length replaces those entries (rollback by position)."""
    a, b = rand_tokens(10, seed=7), rand_tokens(3, seed=8)
    cache = model.new_cache(16)
    model(a, cache, 0)
    got = model(b, cache, 6)
    assert cache.length == 9
    fresh = model(torch.cat([a[:, :6], b], dim=1), model.new_cache(16), 0)
    torch.testing.assert_close(got, fresh[:, 6:], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("prompt", "budget", "context", "capacity"),
    [(10, 20, 8192, 128), (10, 54, 8192, 128), (10, 55, 8192, 192), (200, 64, 8192, 384), (250, 100, 300, 300)],
)
def test_cache_capacity_rounds_up_to_a_size_class_within_the_context(prompt, budget, context, capacity) -> None:
    got = cache_capacity(prompt, budget, context)
    assert got == capacity and got >= min(context, prompt + budget)
    assert got == context or got % CACHE_CLASS == 0


def test_pool_lends_zeroed_items_kept_contiguous_and_frees_idle_classes() -> None:
    cfg = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)
    pool = KVPool(cfg, items=3, dtype=torch.bfloat16, device="cpu", store=torch.float32)
    a, b, c = (pool.take(8) for _ in range(3))
    other = pool.take(16)  # another capacity: another base
    assert [x.item for x in (a, b, c, other)] == [0, 1, 2, 0] and a.base is b.base is not other.base
    with pytest.raises(InputError, match="lent out"):
        pool.take(8)
    for i, x in enumerate((a, b, c)):
        x.write(1, 0, torch.full((1, 1, 5, 4), i + 1.5), torch.full((1, 1, 5, 4), -i - 1.5))
        x.length = 5
    assert torch.equal(a.base.k[1, 2, 0, :5], torch.full((5, 4), 3.5))  # lands in the base, in float32
    pool.give(a)  # the last item (c) moves into the gap, contents and length included
    assert c.item == 0 and c.length == 5 and torch.equal(c.view(1, 5)[0], torch.full((1, 1, 5, 4), 3.5).bfloat16())
    assert CacheRows(sorted([b, c], key=lambda x: x.item)).k is not None  # still one view
    d = pool.take(8)  # a reused item starts zeroed, like a fresh cache
    assert d.item == 2 and not d.k.any() and not d.v.any()
    with pytest.raises(ValueError, match="not lent"):
        pool.give(a)
    for x in (b, c, d, other):
        pool.give(x)
    assert len(pool) == 0 and not pool.lent


@pytest.mark.parametrize("store", [None, torch.float32])
def test_cache_rows_append_one_token_per_cache_through_a_view_or_a_stack(store) -> None:
    cfg = ModelConfig(num_layers=2, num_kv_heads=2, head_dim=4)
    pool = KVPool(cfg, items=2, dtype=torch.bfloat16, device="cpu", store=store)
    pooled = [pool.take(8), pool.take(8)]
    lone = [KVCache(cfg, 8, dtype=torch.bfloat16), KVCache(cfg, 8, dtype=torch.bfloat16)]
    k = torch.randn(2, 2, 1, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for caches in (pooled, lone):
        caches[0].length, caches[1].length = 3, 6
        rows = CacheRows(caches)
        assert (rows.k is not None) == (caches is pooled)
        keys, values = rows.append(1, k, -k)
        assert keys.shape == (2, 2, 8, 4) and keys.dtype == caches[0].k.dtype  # the store's dtype
        for b, (c, pos) in enumerate(zip(caches, (3, 6), strict=True)):
            ck, cv = c.view(1, 8)
            assert torch.equal(ck[0, :, pos], k[b, :, 0]) and torch.equal(cv[0, :, pos], -k[b, :, 0])
            assert torch.equal(keys[b], c.k[1, 0]) and torch.equal(values[b], c.v[1, 0])
    pooled[1].length = 8
    with pytest.raises(InputError, match="overflow"):
        CacheRows(pooled)
