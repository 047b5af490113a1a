"""Sampling, stopping and streaming of the shared decoding machinery and the ``vanilla`` method."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m2r2.decoding.autoregressive import Autoregressive
from m2r2.decoding.base import GenerationConfig, Sampler, Stopper, trim_stop_text, warp_probs
from m2r2.engine import Engine

PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def engine(tiny_model) -> Engine:
    return Engine(model=tiny_model(arch="llama", seed=3), dtype="fp32", quiet=True)


@pytest.fixture(scope="module")
def prompt_ids(engine: Engine) -> list[int]:
    return engine.tokenizer.encode_chat(PROMPT)


def no_eos(engine: Engine) -> Autoregressive:
    return Autoregressive(engine.model, eos_ids=[], decode=engine.tokenizer.decode)


@torch.inference_mode()
def manual_greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """Independent reference: recompute the whole sequence every step, take the argmax."""
    seq = list(prompt)
    m = engine.model
    for _ in range(n):
        logits = m(torch.tensor([seq]), m.new_cache(len(seq)), 0)
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt) :]


def run(strategy, prompt: list[int], **gen):
    streamed: list[int] = []
    res = strategy.generate(prompt, GenerationConfig(**gen), streamed.extend)
    assert streamed == res.tokens, "the stream must carry exactly the returned tokens"
    return res


# --------------------------------------------------------------------------- greedy / sampling


def test_temperature_zero_is_greedy(engine: Engine, prompt_ids: list[int]) -> None:
    res = run(no_eos(engine), prompt_ids, max_new_tokens=16)
    assert res.tokens == manual_greedy(engine, prompt_ids, 16)
    assert res.stop_reason == "max_new_tokens" and res.new_tokens == 16 and res.prompt_tokens == len(prompt_ids)


def test_sampling_reproducible_with_seed(engine: Engine, prompt_ids: list[int]) -> None:
    s = no_eos(engine)
    a = run(s, prompt_ids, max_new_tokens=16, temperature=1.0, seed=123)
    b = run(s, prompt_ids, max_new_tokens=16, temperature=1.0, seed=123)
    c = run(s, prompt_ids, max_new_tokens=16, temperature=1.0, seed=124)
    greedy = run(s, prompt_ids, max_new_tokens=16)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    assert a.tokens != greedy.tokens


@pytest.mark.parametrize(
    "gen", [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.5}], ids=["top_k=1", "top_p=1e-6", "both"]
)
def test_degenerate_sampling_equals_greedy(engine: Engine, prompt_ids: list[int], gen: dict) -> None:
    s = no_eos(engine)
    greedy = run(s, prompt_ids, max_new_tokens=16)
    sampled = run(s, prompt_ids, max_new_tokens=16, temperature=1.5, seed=7, **gen)
    assert sampled.tokens == greedy.tokens


def test_engine_chat_vanilla(engine: Engine) -> None:
    out = engine.chat(PROMPT, gen=GenerationConfig(max_new_tokens=8))
    assert out.method == "vanilla" and out.result.new_tokens <= 8
    assert out.text == engine.tokenizer.decode(out.result.tokens)
    assert out.prompt_ids == engine.tokenizer.encode_chat(PROMPT)
    keys = set(out.to_json())
    assert {"text", "new_tokens", "seconds", "tokens_per_s", "method", "stop_reason"} <= keys


def test_sampler_follows_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    gen = GenerationConfig(temperature=0.7, seed=0)
    sampler = Sampler(gen)
    n = 4000
    counts = torch.bincount(torch.tensor([sampler(logits) for _ in range(n)]), minlength=4).float()
    expected = torch.softmax(logits / 0.7, -1)
    # 4 standard deviations of a binomial proportion at n=4000 is at most 0.032
    assert (counts / n - expected).abs().max() < 0.032


# --------------------------------------------------------------------------- stopping


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stopper_eos_cut_mid_chunk() -> None:
    s = Stopper(GenerationConfig(max_new_tokens=10), eos_ids=[99], decode=None, room=100)
    assert s.push([1, 2]) == 2
    assert s.push([3, 99, 4]) == 1
    assert s.done and s.reason == "eos" and s.tokens == [1, 2, 3]
    assert s.push([5]) == 0 and s.tokens == [1, 2, 3]


def test_stopper_stop_string_keeps_completing_token() -> None:
    s = Stopper(GenerationConfig(max_new_tokens=10, stop=["cd"]), eos_ids=[], decode=letters, room=100)
    assert s.push([0, 1, 2, 3, 4, 5]) == 4  # "abcd": the token completing "cd" is kept, the rest dropped
    assert s.reason == "stop_string" and s.tokens == [0, 1, 2, 3]
    assert trim_stop_text(letters(s.tokens), ["cd"]) == "ab"


def test_stopper_budget_and_context() -> None:
    s = Stopper(GenerationConfig(max_new_tokens=3), eos_ids=[], decode=None, room=100)
    assert s.push([1, 2, 3, 4]) == 3 and s.reason == "max_new_tokens"
    s = Stopper(GenerationConfig(max_new_tokens=10), eos_ids=[], decode=None, room=2)
    assert s.budget == 2
    assert s.push([1]) == 1 and not s.done
    assert s.push([2, 3]) == 1 and s.reason == "context" and s.tokens == [1, 2]
    # exactly fitting: max_new_tokens == room is a max_new_tokens stop
    s = Stopper(GenerationConfig(max_new_tokens=2), eos_ids=[], decode=None, room=2)
    s.push([1, 2])
    assert s.reason == "max_new_tokens"


def test_eos_cut_in_generation(engine: Engine, prompt_ids: list[int]) -> None:
    ref = run(no_eos(engine), prompt_ids, max_new_tokens=20).tokens
    eos = ref[5]
    first = ref.index(eos)
    res = run(Autoregressive(engine.model, eos_ids=[eos]), prompt_ids, max_new_tokens=20)
    assert res.stop_reason == "eos"
    assert res.tokens == ref[:first]


def test_stop_string_in_generation(engine: Engine, prompt_ids: list[int]) -> None:
    dec = engine.tokenizer.decode
    ref = run(no_eos(engine), prompt_ids, max_new_tokens=20).tokens
    stop = next(t for j in range(6, 20) if (t := dec(ref[j - 1 : j + 1])).strip())
    # output ends with the first token whose text completes the stop string
    end = next(i for i in range(20) if stop in dec(ref[: i + 1]))
    assert end < 19
    res = run(no_eos(engine), prompt_ids, max_new_tokens=20, stop=[stop])
    assert res.stop_reason == "stop_string"
    assert res.tokens == ref[: end + 1]
    text = dec(res.tokens)
    assert trim_stop_text(text, [stop]) == text[: text.index(stop)]


def test_engine_chat_trims_text_at_stop_string(engine: Engine) -> None:
    full = engine.chat(PROMPT, gen=GenerationConfig(max_new_tokens=20)).text
    stop = next(
        full[i : i + 2] for i in range(3, len(full) - 1) if full[i : i + 2].isascii() and full[i : i + 2].isalnum()
    )
    out = engine.chat(PROMPT, gen=GenerationConfig(max_new_tokens=20, stop=[stop]))
    assert out.result.stop_reason == "stop_string"
    assert out.text == full[: full.index(stop)]
    assert stop in engine.tokenizer.decode(out.result.tokens)


def test_context_limit_reason(tiny_model) -> None:
    e = Engine(model=tiny_model(arch="qwen2", max_position_embeddings=64), dtype="fp32", quiet=True)
    s = Autoregressive(e.model, eos_ids=[], decode=None)
    res = run(s, list(range(3, 63)), max_new_tokens=10)  # 60 prompt tokens, room for 4
    assert res.stop_reason == "context" and res.new_tokens == 4
    res = run(s, list(range(3, 66)), max_new_tokens=10)  # 63 prompt tokens: exactly one more fits
    assert res.stop_reason == "context" and res.new_tokens == 1
    res = run(s, list(range(3, 63)), max_new_tokens=4)
    assert res.stop_reason == "max_new_tokens" and res.new_tokens == 4


def test_stream_with_eos_and_budget(engine: Engine, prompt_ids: list[int]) -> None:
    """Streaming under every stop reason: the callback never sees a token that is not returned."""
    ref = run(no_eos(engine), prompt_ids, max_new_tokens=12).tokens
    for eos in ([ref[0]], [ref[7]], []):
        run(Autoregressive(engine.model, eos_ids=eos), prompt_ids, max_new_tokens=12)
    run(no_eos(engine), prompt_ids, max_new_tokens=1)


# --------------------------------------------------------------------------- sampling warp properties


@st.composite
def warp_cases(draw):
    v = draw(st.integers(min_value=1, max_value=40))
    # distinct logits at least 0.01 apart: no ties, even after dividing by the temperature
    cents = draw(st.lists(st.integers(min_value=-3000, max_value=3000), min_size=v, max_size=v, unique=True))
    temperature = draw(st.floats(min_value=0.05, max_value=5.0))
    top_k = draw(st.integers(min_value=0, max_value=v + 2))
    top_p = draw(st.one_of(st.just(1.0), st.floats(min_value=1e-4, max_value=1.0)))
    logits = torch.tensor(cents, dtype=torch.float32) / 100
    return logits, GenerationConfig(temperature=temperature, top_k=top_k, top_p=top_p)


@settings(max_examples=150, deadline=None, database=None)
@given(warp_cases())
def test_warp_probs_properties(case) -> None:
    logits, gen = case
    p = warp_probs(logits, gen.validate())
    assert p.shape == logits.shape
    assert torch.isfinite(p).all() and (p >= 0).all()
    assert math.isclose(float(p.sum()), 1.0, abs_tol=1e-5)
    support = p > 0
    assert support[int(logits.argmax())], "the most likely token is always kept"
    order = logits.argsort(descending=True)
    if gen.top_k:
        assert int(support.sum()) <= gen.top_k
        assert not support[order[gen.top_k :]].any(), "only the top_k most likely tokens may be kept"
    if gen.top_p == 1.0:
        # without nucleus truncation, the kept tokens keep their softmax(logits / T) odds
        base = torch.softmax((logits / gen.temperature).masked_fill(~support, float("-inf")), -1)
        # float32 rounds logits / T to ~6e-8 relative, so a probability may move by ~|z| * 1.2e-7
        # (seen in CI: logits 29.38/29.39 at T = 0.05 differed by 7e-6)
        z = float((logits / gen.temperature).abs().max())
        torch.testing.assert_close(p, base, atol=1e-6 + 2.4e-7 * z, rtol=1e-5)


def test_top_k_keeps_ties_at_the_kth_value() -> None:
    p = warp_probs(torch.tensor([1.0, 3.0, 1.0, 0.0, 1.0]), GenerationConfig(temperature=1.0, top_k=2))
    assert (p > 0).tolist() == [True, True, True, False, True]


def test_tiny_temperature_is_greedy_not_nan() -> None:
    logits = torch.tensor([0.5, 2.0, -1.0, 1.9])
    for t in (1e-30, 1e-40, 1e-45):
        gen = GenerationConfig(temperature=t, seed=0).validate()
        p = warp_probs(logits, gen)
        assert torch.isfinite(p).all() and p[1] == 1.0
        assert Sampler(gen)(logits) == 1


@settings(max_examples=60, deadline=None, database=None)
@given(
    st.lists(st.integers(min_value=-1000, max_value=1000), min_size=2, max_size=30, unique=True),
    st.floats(min_value=0.01, max_value=0.99),
)
def test_top_p_keeps_smallest_sufficient_prefix(cents, top_p) -> None:
    x = torch.tensor(cents, dtype=torch.float32) / 100
    gen = GenerationConfig(temperature=1.0, top_p=top_p).validate()
    p = warp_probs(x, gen)
    base = torch.softmax(x, -1)
    kept = p > 0
    mass = float(base[kept].sum())
    assert mass >= top_p - 1e-5, "kept mass must reach top_p"
    # every kept token is at least as likely as every dropped one
    if (~kept).any():
        assert float(base[kept].min()) >= float(base[~kept].max())
    # minimal: dropping the least likely kept token would fall short of top_p
    if kept.sum() > 1:
        assert mass - float(base[kept].min()) < top_p + 1e-5
    torch.testing.assert_close(p[kept], base[kept] / mass, atol=1e-6, rtol=1e-5)
