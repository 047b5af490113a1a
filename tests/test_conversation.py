"""A conversation carries its KV cache from turn to turn: a later turn prefills only what the earlier
ones have not seen, by one rule for every method, so that every lossless method still gives vanilla's
tokens turn after turn (tiny random models, every drafter shape; the real model through the bench's
two-turn loop)."""

from __future__ import annotations

import random

import pytest
import torch
from tests.test_eagle import eagle_head
from tests.test_peers import loop, small_draft
from tests.test_speculative import tiny_model
from tests.test_tree import seeded_stream

from m2r2.cache import Conversation
from m2r2.decoding.autoregressive import Autoregressive
from m2r2.decoding.base import GenerationConfig
from m2r2.decoding.eagle import EagleDrafter
from m2r2.decoding.tree import TreeSpeculative
from m2r2.decoding.two_model import ModelDrafter


def test_the_reusable_prefix_is_one_short_of_the_common_one_and_never_the_last_prompt_token():
    conv = Conversation()
    model = tiny_model(0)
    assert conv.reusable([1, 2, 3], model) == 0  # nothing carried yet
    cache = model.new_cache(64)
    model(torch.tensor([[1, 2, 3, 4, 5, 6]]), cache, 0)  # a turn's cache: the prompt, then what it verified
    conv.started(cache, [1, 2, 3, 4], 0, [5, 6, 7], model)  # 7 was emitted last: no method has its K/V yet
    assert conv.tokens == [1, 2, 3, 4, 5, 6]
    assert conv.reusable([1, 2, 3, 4, 5, 6, 7, 8], model) == 5  # common prefix 6, one short
    assert conv.reusable([1, 2, 3, 4, 5, 6], model) == 5  # the whole prompt is held: its last token still runs
    assert conv.reusable([1, 2, 9, 9], model) == 1
    assert conv.reusable([9, 2, 3], model) == 0
    assert conv.reusable([1, 2, 3, 4, 5, 6, 7, 8], tiny_model(1)) == 0  # another model's K/V are never reused
    cache.truncate(5)  # a cache rolled back under the tokens it claims: nothing is reused
    assert conv.reusable([1, 2, 3, 4, 5, 6, 7, 8], model) == 0
    conv.reset()
    assert conv.cache is None and conv.tokens == []


def _strategies(seed: int, dtype: torch.dtype) -> dict[str, object]:
    model = tiny_model(seed, dtype=dtype)
    rng = random.Random(seed)
    fast = seeded_stream(model, 1 + seed % 2, 0.05, seed, fold=seed % 2 == 1)
    head = eagle_head(model, 0.05, seed)
    draft = small_draft(model, 2, 0.05, seed)
    nodes, depth = rng.randint(2, 10), rng.randint(1, 5)
    return {
        "vanilla": Autoregressive(model, []),
        "m2r2": TreeSpeculative("m2r2", model, fast, [], None, nodes, depth, 2, 2, lookup=4),
        "eagle": TreeSpeculative("eagle", model, EagleDrafter(head.freeze()), [], None, nodes, depth, 2, 2),
        "two-model": loop(model, lambda c, d=draft: ModelDrafter(d, c.max_len), 4),
    }


@pytest.mark.parametrize(("seed", "dtype"), [(1, torch.float32), (2, torch.bfloat16), (3, torch.float32)])
def test_every_method_gives_vanillas_tokens_turn_after_turn_with_the_cache_carried(seed, dtype):
    """Each method has its own conversation, as in the bench: later prompts repeat the history (with the
    last answer token sometimes re-tokenized otherwise) and add a new message; each turn's output equals
    vanilla's, only the rest of the prompt is prefilled, and the cache holds the true K/V of the turn."""
    strategies = _strategies(seed, dtype)
    model = strategies["vanilla"].model
    convs = {name: Conversation() for name in strategies}
    rng = random.Random(100 + seed)
    prompt = [rng.randrange(64) for _ in range(rng.randint(2, 20))]
    for turn in range(3):
        gen = GenerationConfig(max_new_tokens=rng.randint(1, 40))
        expect = convs["vanilla"].reusable(prompt, model)
        ref = strategies["vanilla"].generate(prompt, gen, session=convs["vanilla"])
        for name, strat in strategies.items():
            conv = convs[name]
            if name != "vanilla":
                assert conv.reusable(prompt, model) == expect
            out = ref if name == "vanilla" else strat.generate(prompt, gen, session=conv)
            assert out.tokens == ref.tokens, (name, turn)
            assert conv.reused == expect
            assert conv.tokens == prompt + out.tokens[:-1]
            n = len(conv.tokens)
            fresh = model.new_cache(conv.cache.max_len)
            model(torch.tensor([conv.tokens]), fresh, 0)
            assert torch.allclose(conv.cache.k[:, :, :, :n].float(), fresh.k[:, :, :, :n].float(), atol=3e-2)
        if turn:
            assert expect > 0
        answer = ref.tokens if rng.random() < 0.5 else [*ref.tokens[:-1], (ref.tokens[-1] + 1) % 64]
        prompt = prompt + answer + [rng.randrange(64) for _ in range(rng.randint(1, 12))]


def test_eagles_memory_of_the_earlier_turns_moves_to_the_next_turns_cache():
    strategies = _strategies(4, torch.float32)
    strat = strategies["eagle"]
    conv = Conversation()
    prompt = [random.Random(4).randrange(64) for _ in range(15)]
    out = strat.generate(prompt, GenerationConfig(max_new_tokens=20), session=conv)
    second = prompt + out.tokens + [7, 8, 9]
    strat.generate(second, GenerationConfig(max_new_tokens=20), session=conv)
    assert conv.reused == len(prompt) + len(out.tokens) - 2
    mem = strat.drafter.memories[strat.last_cache]
    assert mem.lo == 0 and mem.end == strat.last_cache.length - 1  # every verified pair, from the start


def test_the_bench_loop_carries_the_cache_and_stays_identical_on_the_real_model(real_engine_bf16):
    """Two MT-Bench turns as `m2r2 bench` runs them: the second turn prefills only its new message."""
    from m2r2.bench.datasets import load_dataset
    from m2r2.bench.harness import answer

    engine = real_engine_bf16
    prompt = load_dataset("mt_bench", 1).prompts[0]
    gen = GenerationConfig(max_new_tokens=24)
    runs = {m: answer(engine, prompt, m, gen) for m in ("vanilla", "m2r2", "medusa")}
    fresh = answer(engine, prompt, "vanilla", gen, fresh_turns=True)
    for r in runs.values():
        assert r["ids"] == runs["vanilla"]["ids"]
        assert r["stats"][0]["prompt_reused"] == 0 and r["stats"][1]["prompt_reused"] > 50
    assert "prompt_reused" not in fresh["stats"][1]
    assert fresh["ids"][0] == runs["vanilla"]["ids"][0]
