"""transformers peer methods (hf, hf-pld, hf-early-exit) on the real bundled model.

In fp32 our model's greedy output equals transformers', and prompt lookup / early-exit
self-speculation are lossless under greedy decoding, so all of them must produce the very same
tokens as ``vanilla`` and stop at the same token (EOS, stop string, budget).
"""

from __future__ import annotations

import importlib.util

import pytest

from m2r2.decoding import method_names
from m2r2.decoding.base import GenerationConfig
from m2r2.errors import SettingsError

PROMPTS = [
    "Write a short Python function that reverses a string.",
    "Name three planets of the solar system and one fact about each.",
]


@pytest.fixture(scope="module")
def engine(real_engine):
    return real_engine


def _ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_methods_registered() -> None:
    names = method_names()
    assert {"vanilla", "hf", "hf-pld", "hf-early-exit"} <= set(names)
    # llamacpp is offered exactly when llama-cpp-python is installed
    assert ("llamacpp" in names) == (importlib.util.find_spec("llama_cpp") is not None)


@pytest.mark.slow
def test_greedy_identical_to_vanilla(engine) -> None:
    gen = GenerationConfig(max_new_tokens=16)
    for text in PROMPTS:
        ids = _ids(engine, text)
        ref = engine.generate_ids(ids, "vanilla", gen)
        assert ref.new_tokens == 16 and ref.stop_reason == "max_new_tokens"
        for method in ("hf", "hf-pld"):
            streamed: list[int] = []
            got = engine.generate_ids(ids, method, gen, stream=streamed.extend)
            assert got.tokens == ref.tokens, method
            assert streamed == got.tokens
            assert got.stop_reason == "max_new_tokens" and got.seconds > 0
            assert got.stats["forward_passes"] >= 1


@pytest.mark.slow
def test_stops_like_vanilla_on_eos_and_stop_string(engine) -> None:
    ids = _ids(engine, "What is 2+2? Answer with a number only.")
    gen = GenerationConfig(max_new_tokens=32)
    ref = engine.generate_ids(ids, "vanilla", gen)
    assert ref.stop_reason == "eos" and ref.new_tokens < 32  # a short answer ending in EOS
    for method in ("hf", "hf-pld"):
        got = engine.generate_ids(ids, method, gen)
        assert (got.tokens, got.stop_reason) == (ref.tokens, "eos")
        assert not set(got.tokens) & set(engine.tokenizer.eos_ids)

    ids = _ids(engine, PROMPTS[0])
    full = engine.generate_ids(ids, "vanilla", GenerationConfig(max_new_tokens=10)).tokens
    stop = engine.tokenizer.decode(full[:6])[-3:]  # text that certainly appears within 6 tokens
    gen = GenerationConfig(max_new_tokens=10, stop=[stop])
    ref = engine.generate_ids(ids, "vanilla", gen)
    assert ref.stop_reason == "stop_string" and ref.new_tokens <= 6
    for method in ("hf", "hf-pld"):
        got = engine.generate_ids(ids, method, gen)
        assert (got.tokens, got.stop_reason) == (ref.tokens, "stop_string")


@pytest.mark.slow
def test_sampling_settings_reach_generate(engine) -> None:
    ids = _ids(engine, PROMPTS[1])
    greedy = engine.generate_ids(ids, "hf", GenerationConfig(max_new_tokens=8)).tokens
    # top_k=1 leaves only the argmax: sampling must then reproduce greedy output
    top1 = engine.generate_ids(ids, "hf", GenerationConfig(max_new_tokens=8, temperature=1.5, top_k=1, seed=0))
    assert top1.tokens == greedy
    hot = GenerationConfig(max_new_tokens=8, temperature=1.5, seed=7)
    a = engine.generate_ids(ids, "hf", hot).tokens
    assert engine.generate_ids(ids, "hf", hot).tokens == a  # a seed makes sampling reproducible
    assert a != greedy  # and temperature 1.5 over the full vocabulary does sample


@pytest.mark.slow
def test_early_exit_is_lossless_self_speculation(engine) -> None:
    ids = _ids(engine, PROMPTS[0])
    gen = GenerationConfig(max_new_tokens=8)
    ref = engine.generate_ids(ids, "vanilla", gen)
    got = engine.generate_ids(ids, "hf-early-exit", gen)
    assert got.tokens == ref.tokens
    layers = engine.model.cfg.num_layers
    assert got.stats["exit_layer"] == layers // 3
    assert got.stats["draft_passes"] > 0  # drafts ran with fewer layers than the full passes
    assert 1.0 <= got.stats["mean_accepted"] <= 8
    with pytest.raises(SettingsError, match="exit_layer"):
        engine.strategy("hf-early-exit", exit_layer=layers)


@pytest.mark.slow
def test_hf_methods_share_one_model(engine) -> None:
    assert engine.strategy("hf").model is engine.strategy("hf-pld").model
