"""The answer store (n-grams of the model's own answers as a source of tree nodes): what it keeps and
proposes, its file's checks, and that trees drafting from it stay plain greedy."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tests.test_speculative import tiny_model
from tests.test_tree import seeded_stream

from m2r2.decoding.answer_store import AnswerStore, answer_store_for, load_answer_store, save_answer_store
from m2r2.decoding.autoregressive import Autoregressive
from m2r2.decoding.base import GenerationConfig
from m2r2.decoding.tree import TreeSpeculative
from m2r2.errors import InputError, SettingsError, WeightsError


def test_it_keeps_each_ngrams_most_frequent_follower_and_its_share_and_proposes_from_the_longest_match():
    answers = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [9, 2, 3, 4, 6], [7, 3, 4, 8], [7, 3, 4, 8], [7, 7]]
    store = AnswerStore.build(answers, min_count=2)
    # (2, 3, 4) was followed by 5 once and 6 twice; (3, 4) by 5, 6, 6, 8, 8: a tie, the smaller id wins
    assert store.tables[3][(2, 3, 4)] == (6, 170 / 255)  # 2 of 3 followers, in 8 bits
    assert store.tables[2][(3, 4)] == (6, 102 / 255)  # 2 of 5
    assert (1, 2, 3, 4) not in store.tables[4]  # seen once: below min_count
    assert store.tables[4] == {}
    assert AnswerStore.build(answers, min_count=1).tables[4][(1, 2, 3, 4)] == (5, 128 / 255)  # 5 or 6: a tie
    # the longest n-gram ending the context decides; proposals chain on their own tokens
    assert store.propose([0, 2, 3, 4], 3) == ([6], [170 / 255])  # (3, 4, 6) never seen twice: the chain stops
    assert store.propose([7, 3], 2) == ([4, 6], [1.0, 102 / 255])  # (7, 3) -> 4, then (3, 4) -> 6
    assert store.tables[3][(7, 3, 4)] == (8, 1.0)
    assert store.propose([5, 7, 3], 2) == ([4, 8], [1.0, 1.0])
    assert store.propose([5, 7, 3], 1) == ([4], [1.0])
    assert store.propose([42, 43], 4) == ([], []) and store.propose([], 4) == ([], [])
    with pytest.raises(SettingsError, match="min_count"):
        AnswerStore.build(answers, min_count=0)


def test_the_file_round_trips_and_refuses_another_model_or_a_damaged_file(tmp_path):
    store = AnswerStore.build([[1, 2, 3, 4, 5, 6]] * 2 + [[2, 3, 9]] * 3)
    path = save_answer_store(tmp_path / "a.safetensors", store, "fp-a", answers=5)
    back = load_answer_store(path, "fp-a")
    assert back.tables == store.tables and len(back) == len(store) > 0
    assert json.loads(path.with_suffix(".json").read_text())["answers"] == 5
    for ids, dtype in (
        ([40000, 65535, 3] * 3, torch.int16),
        ([70000, 1] * 3, torch.int32),
    ):  # 16-bit ids: half the file
        wide = AnswerStore.build([ids], min_count=1)
        assert wide.to_tensors()["grams2"].dtype == dtype
        assert load_answer_store(save_answer_store(tmp_path / "w", wide, "fp-a"), "fp-a").tables == wide.tables
    with pytest.raises(WeightsError, match="another base model"):
        load_answer_store(path, "fp-b")
    with pytest.raises(InputError, match="no follower shares"):  # a store built before shares were kept
        AnswerStore.from_tensors({k: t for k, t in store.to_tensors().items() if not k.startswith("share")})
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(WeightsError, match="corrupt"):
        load_answer_store(path, "fp-a")
    assert answer_store_for("fp-a", "none") is None
    with pytest.raises(WeightsError, match="missing"):  # a mistyped answers=FILE is an error, not silently off
        answer_store_for("fp-a", str(tmp_path / "nope.safetensors"))
    assert answer_store_for("no-such-model", None) is None  # nothing ships for it: off


def test_trees_that_draft_from_the_answer_store_stay_plain_greedy_and_accept_its_copies():
    """The store is built from the model's own greedy answers to other prompts, so its n-grams recur in
    this prompt's answer: copies are accepted, fewer passes run, and the tokens stay plain greedy."""
    model = tiny_model(21)
    rng = random.Random(0)
    gen = GenerationConfig(max_new_tokens=60)
    own = [Autoregressive(model, []).generate([rng.randrange(64) for _ in range(6)], gen).tokens for _ in range(30)]
    store = AnswerStore.build(own)
    fast = seeded_stream(model, 1, 3.0, 21, fold=True)  # a useless drafter: copies are what can be accepted
    for _ in range(4):
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 12))]
        ref = Autoregressive(model, []).generate(prompt, gen)
        plain = TreeSpeculative("m2r2", model, fast, [], None, 8, 4, 2, 2, lookup=6).generate(prompt, gen)
        strat = TreeSpeculative("m2r2", model, fast, [], None, 8, 4, 2, 2, lookup=6, answers=store)
        out = strat.generate(prompt, gen)
        assert out.tokens == plain.tokens == ref.tokens and out.stop_reason == ref.stop_reason
        assert out.stats["copied_accepted_per_token"] > plain.stats["copied_accepted_per_token"]
        assert out.stats["verify_passes"] < plain.stats["verify_passes"]
    sampled = GenerationConfig(max_new_tokens=30, temperature=0.8, seed=1)
    out = TreeSpeculative("m2r2", model, fast, [], None, 8, 4, 2, 2, lookup=6, answers=store).generate([3], sampled)
    assert out.stats["copied_accepted_per_token"] == 0.0  # sampling never copies


def test_the_command_builds_a_store_and_refuses_bad_input_before_loading_a_model(tmp_path, tiny_model, capsys):
    from m2r2.cli import main

    model_dir = str(tiny_model(0))
    data = tmp_path / "answers.jsonl"
    rows = [{"id": str(i), "prompt_ids": [1, 2], "answer_ids": [5, 6, 7, 8, 9] * 3} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "store.safetensors"
    assert main(["answer-store", "--data", str(data), "--out", str(out), "--model", model_dir]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["answers"] == 4 and report["entries"] > 0 and out.is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "messages": []}\n')
    assert main(["answer-store", "--data", str(bad), "--out", str(out), "--model", "/nonexistent"]) != 0
    assert "no answer_ids" in capsys.readouterr().err  # about the data, not the (missing) model
    missing = str(tmp_path / "missing.jsonl")
    assert main(["answer-store", "--data", missing, "--out", str(out), "--model", "/nonexistent"]) != 0
    err = capsys.readouterr().err.strip()
    assert "cannot read answers" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_real_model_ships_an_answer_store_whose_copies_keep_the_output_vanilla(real_engine_bf16):
    """The bundled model's shipped store is on by default for the tree methods: on a list-style answer
    (the phrasing the store holds) its copies are accepted, and the tokens are vanilla's bit for bit."""
    from m2r2.tokenizer import messages_for

    e = real_engine_bf16
    assert answer_store_for(e.fingerprint, None) is not None
    gen = GenerationConfig(max_new_tokens=64)
    ids = e.tokenizer.encode_chat(messages_for("Give me three tips for staying healthy."))
    ref = e.generate_ids(ids, "vanilla", gen).tokens
    on = e.generate_ids(ids, "m2r2", gen)
    off = e.generate_ids(ids, "m2r2", gen, answers="none")
    assert on.tokens == off.tokens == ref
    assert e.strategy("m2r2").answers is not None and e.strategy("m2r2", answers="none").answers is None
    assert on.stats["copied_accepted_per_token"] > off.stats["copied_accepted_per_token"]
