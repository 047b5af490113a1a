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
    assert store.get((2, 3, 4)) == (6, 170 / 255)  # 2 of 3 followers, in 8 bits
    assert store.get((3, 4)) == (6, 102 / 255)  # 2 of 5
    assert store.get((1, 2, 3, 4)) is None  # seen once: below min_count
    assert len(store.grams[4]) == 0
    assert AnswerStore.build(answers, min_count=1).get((1, 2, 3, 4)) == (5, 128 / 255)  # 5 or 6: a tie
    # the longest n-gram ending the context decides; proposals chain on their own tokens
    assert store.propose([0, 2, 3, 4], 3) == ([6], [170 / 255])  # (3, 4, 6) never seen twice: the chain stops
    assert store.propose([7, 3], 2) == ([4, 6], [1.0, 102 / 255])  # (7, 3) -> 4, then (3, 4) -> 6
    assert store.get((7, 3, 4)) == (8, 1.0)
    assert store.propose([5, 7, 3], 2) == ([4, 8], [1.0, 1.0])
    assert store.propose([5, 7, 3], 1) == ([4], [1.0])
    assert store.propose([42, 43], 4) == ([], []) and store.propose([], 4) == ([], [])
    with pytest.raises(SettingsError, match="min_count"):
        AnswerStore.build(answers, min_count=0)


def test_the_file_round_trips_and_refuses_another_model_or_a_damaged_file(tmp_path):
    store = AnswerStore.build([[1, 2, 3, 4, 5, 6]] * 2 + [[2, 3, 9]] * 3)
    path = save_answer_store(tmp_path / "a.safetensors", store, "fp-a", answers=5)
    back = load_answer_store(path, "fp-a")
    assert back.entries() == store.entries() and len(back) == len(store) > 0
    assert json.loads(path.with_suffix(".json").read_text())["answers"] == 5
    for ids, dtype in (
        ([40000, 65535, 3] * 3, torch.int16),
        ([70000, 1] * 3, torch.int32),
    ):  # 16-bit ids: half the file
        wide = AnswerStore.build([ids], min_count=1)
        assert wide.to_tensors()["grams2"].dtype == dtype
        assert load_answer_store(save_answer_store(tmp_path / "w", wide, "fp-a"), "fp-a").entries() == wide.entries()
    dotted = save_answer_store(tmp_path / "qwen2.5-coder-0.5b-answers", store, "fp-a")  # a name with dots keeps them
    assert dotted.name == "qwen2.5-coder-0.5b-answers.safetensors" and dotted.with_suffix(".json").is_file()
    for name in ("qwen2.5-coder-0.5b-answers", "qwen2.5-coder-0.5b-answers.json", dotted.name):
        assert load_answer_store(tmp_path / name, "fp-a").entries() == store.entries()
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
    assert report["shares"] == "counted"  # under 20 own answers: too few to hold any out by default
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "messages": []}\n')
    assert main(["answer-store", "--data", str(bad), "--out", str(out), "--model", "/nonexistent"]) != 0
    assert "no answer_ids" in capsys.readouterr().err  # about the data, not the (missing) model
    missing = str(tmp_path / "missing.jsonl")
    assert main(["answer-store", "--data", missing, "--out", str(out), "--model", "/nonexistent"]) != 0
    err = capsys.readouterr().err.strip()
    assert "cannot read answers" in err and len(err.splitlines()) == 1
    for n in ("1", "5"):  # every 1st answer held out, or more than there are: refused before the model loads
        assert main(["answer-store", "--data", str(data), "--calibrate", n, "--out", str(out), "--model", "/x"]) != 0
        assert "--calibrate" in capsys.readouterr().err
    assert main(["answer-store", "--data", str(data), "--calibrate", "2", "--out", str(out), "--model", model_dir]) == 0
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["config"]["shares"] == "calibrated" and side["calibration"]["held_out_answers"] == 2
    capsys.readouterr()
    many = tmp_path / "many.jsonl"  # 20 answers or more: calibrated on every 10th by default
    many.write_text("".join(json.dumps(r | {"id": f"{r['id']}-{k}"}) + "\n" for r in rows for k in range(5)))
    assert main(["answer-store", "--data", str(many), "--out", str(out), "--model", model_dir]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["shares"] == "calibrated on every 10th answer"
    assert json.loads(out.with_suffix(".json").read_text())["calibration"]["held_out_answers"] == 2


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


def test_lookups_match_a_plain_count_and_wide_ids_that_share_a_key_stay_apart():
    """The packed-key tables answer what a plain count of the answers says, for every n-gram seen and
    for unseen ones; ids beyond 16 bits wrap the key, and rows that share it are told apart."""
    rng = random.Random(3)
    answers = [[rng.randrange(12) for _ in range(rng.randint(3, 40))] for _ in range(60)]
    store = AnswerStore.build(answers, min_count=2)
    followers: dict[tuple[int, ...], dict[int, int]] = {}
    for a in answers:
        for n in (2, 3, 4):
            for i in range(len(a) - n):
                f = followers.setdefault(tuple(a[i : i + n]), {})
                f[a[i + n]] = f.get(a[i + n], 0) + 1
    kept = 0
    for gram, f in followers.items():
        best = min(f, key=lambda t: (-f[t], t))
        want = (best, round(f[best] / sum(f.values()) * 255) / 255) if f[best] >= 2 else None
        assert store.get(gram) == want
        kept += want is not None
    assert kept == len(store) > 100
    assert store.get((99, 98)) is None and store.get((1,)) is None
    # (1, 0) and (0, 65536) pack to the same 16-bit-a-token key
    wide = AnswerStore.build([[1, 0, 7]] * 2 + [[0, 65536, 8]] * 2, min_count=2)
    assert wide.get((1, 0)) == (7, 1.0) and wide.get((0, 65536)) == (8, 1.0) and wide.get((2, 0)) is None
    assert wide.propose([5, 0, 65536], 2) == ([8], [1.0])


def test_a_store_laid_over_another_keeps_its_followers_and_takes_the_others_new_ngrams():
    own = AnswerStore.build([[1, 2, 3, 4]] * 2)
    corpus = AnswerStore.build([[1, 2, 9, 9]] * 3 + [[5, 6, 7]] * 2)
    both = own.over(corpus)
    assert both.get((1, 2)) == (3, 1.0)  # own phrasing decides where it has any
    assert both.get((5, 6)) == (7, 1.0) and both.get((2, 9)) == (9, 1.0)  # the corpus fills the rest
    assert len(both) == len(set(own.entries()) | set(corpus.entries()))
    assert both.propose([0, 5, 6], 3) == ([7], [1.0]) and both.propose([0, 1, 2], 3) == ([3, 4], [1.0, 1.0])


def test_the_command_counts_a_corpus_and_lays_a_store_over_it(tmp_path, tiny_model, capsys):
    from m2r2.cli import main

    model_dir = str(tiny_model(0))
    data = tmp_path / "answers.jsonl"
    data.write_text(json.dumps({"id": "0", "prompt_ids": [1], "answer_ids": [5, 6, 7, 8] * 2}) + "\n")
    conv = tmp_path / "conversations.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a b c d a b c d"}]
    conv.write_text(json.dumps({"id": "c", "messages": turns}) + "\n")
    first = tmp_path / "own.safetensors"
    assert main(["answer-store", "--data", str(data), "--out", str(first), "--model", model_dir]) == 0
    capsys.readouterr()
    out = tmp_path / "both.safetensors"
    args = ["answer-store", "--data", str(data), "--corpus", str(conv), "--over", str(first), "--out", str(out)]
    assert main([*args, "--model", model_dir]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    own = load_answer_store(first, json.loads(first.with_suffix(".json").read_text())["base_fingerprint"])
    assert report["responses"] == 1 and report["response_tokens"] > 0 and report["entries"] > len(own)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    assert main(["answer-store", "--data", str(data), "--corpus", str(bad), "--out", str(out), "--model", "/x"]) != 0
    assert "not a conversation" in capsys.readouterr().err  # about the corpus, before any model loads
    bad.write_text(json.dumps({"id": "u", "messages": turns[:1]}) + "\n")
    assert main(["answer-store", "--data", str(data), "--corpus", str(bad), "--out", str(out), "--model", "/x"]) != 0
    assert "no assistant turns" in capsys.readouterr().err
    assert main(["answer-store", "--data", str(data), "--over", str(tmp_path / "no"), "--out", str(out)]) != 0
    assert "no such answer store" in capsys.readouterr().err
    assert main(["answer-store", "--data", "--out", str(out), "--model", "/x"]) != 0
    assert "nothing to count" in capsys.readouterr().err
    only = tmp_path / "corpus-only.safetensors"  # a model with no own answers yet: the corpus alone
    assert main(["answer-store", "--corpus", str(conv), "--out", str(only), "--model", model_dir]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["answers"] == 0


def test_calibrated_shares_are_held_out_hit_rates_and_a_rare_ngrams_share_says_less():
    # counted: (1, 2) followed by 3 in 60 answers; 30 bigrams (100 + k, 200 + k) each followed by 300 + k in two.
    # Held out (every 10th answer): (1, 2) is still followed by 3, but the rare bigrams' followers only half the time
    fit = [[1, 2, 3, 4]] * 60 + [[100 + k, 200 + k, 300 + k] for k in range(30) for _ in range(2)]
    held = [[1, 2, 3, 4]] * 4 + [[100 + k, 200 + k, 300 + k if k % 2 else 999] for k in range(10)]
    fits, helds = iter(fit), iter(held)
    answers = [next(helds) if i % 10 == 0 else next(fits) for i in range(len(fit) + len(held))]
    plain = AnswerStore.build(answers)
    store, seen = AnswerStore.build_calibrated(answers, every=10)
    assert store.calibrated and not plain.calibrated
    # held out: (1, 2) -> 3 and (1, 2, 3) -> 4 four times, all right; a rare bigram's follower ten times, five right
    assert (seen["held_out_answers"], seen["predicted"], seen["hits"]) == (14, 18, 13)
    assert sum(c["tries"] for c in seen["cells"]) == 18
    assert store.entries().keys() == plain.entries().keys()  # the same n-grams and followers: only the shares change
    assert all(store.entries()[g][0] == plain.entries()[g][0] for g in plain.entries())
    assert store.get((1, 2)) == plain.get((1, 2)) == (3, 1.0)
    # a bigram counted twice (none of the held-out ones): 1.0 by its count, (5 + 10 * 1.0) / (10 + 10) held out
    assert plain.get((115, 215)) == (315, 1.0) and store.get((115, 215)) == (315, round(0.75 * 255) / 255)
    with pytest.raises(SettingsError, match="every"):
        AnswerStore.build_calibrated(answers[:5], every=10)


def test_a_calibrated_store_round_trips_and_starts_a_sequences_calibration_at_one(tmp_path):
    model = tiny_model(21)
    gen = GenerationConfig(max_new_tokens=40)
    rng = random.Random(1)
    answers = [Autoregressive(model, []).generate([rng.randrange(64) for _ in range(6)], gen).tokens for _ in range(30)]
    store, _ = AnswerStore.build_calibrated(answers, every=5)
    path = save_answer_store(tmp_path / "c", store, "fp-a")
    back = load_answer_store(path, "fp-a")
    assert back.calibrated and back.entries() == store.entries()
    counted = save_answer_store(tmp_path / "p", AnswerStore.build(answers), "fp-a")
    assert not load_answer_store(counted, "fp-a").calibrated
    assert store.over(AnswerStore.build(answers)).calibrated is False
    fast = seeded_stream(model, 1, 3.0, 21, fold=True)
    spec = TreeSpeculative("t", model, fast, [], None, 8, 4, 2, 2, lookup=6, answers=back)
    state = spec.make_drafter(model.new_cache(16))
    assert (state.answer_calib, state.answer_deeper) == (1.0, 1.0)
    for _ in range(3):  # its chains priced by other numbers, the tokens stay plain greedy
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 12))]
        assert spec.generate(prompt, gen).tokens == Autoregressive(model, []).generate(prompt, gen).tokens
    spec.answers = AnswerStore.build(answers)
    assert spec.make_drafter(model.new_cache(16)).answer_calib < 1.0
