"""EAGLE head: lossless with m2r2's tree verifier on many tiny random models and the bundled model,
exact sampling, its own KV cache holding the features of verified positions only, head files bound to
their base model, and store training that drafts what inference drafts, resumes bit for bit and learns."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tests.test_cli import assert_one_line_error, run_cli
from tests.test_speculative import _exact_marginal
from tests.test_speculative import tiny_model as random_model
from tests.test_tree import _conversations

from m2r2.decoding.autoregressive import Autoregressive
from m2r2.decoding.base import GenerationConfig
from m2r2.decoding.eagle import EagleConfig, EagleDrafter, EagleHead, load_head, save_head
from m2r2.decoding.tree import Tree, TreeCosts, TreeSpeculative
from m2r2.errors import WeightsError


def eagle_head(model, noise: float, seed: int, vocab: list[int] | None = None) -> EagleHead:
    """An EAGLE head on ``model`` (its layer a copy of the last one; ``noise`` perturbs every weight)."""
    head = EagleHead(model, EagleConfig.build(model.cfg.num_layers, model.cfg.hidden_size))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.layer.load_state_dict({k: v.float() for k, v in model.layers[-1].state_dict().items()})
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    if vocab is not None:
        head.draft_vocab = torch.tensor(sorted(vocab))
    return head


def strategy(model, head: EagleHead, nodes=8, depth=5, width=2, branch=2, costs=None, eos=()) -> TreeSpeculative:
    return TreeSpeculative("eagle", model, EagleDrafter(head.freeze()), list(eos), None, nodes, depth, width, branch,
                           costs)  # fmt: skip


def _memory_in_step(strat: TreeSpeculative) -> None:
    """The EAGLE cache holds every verified pair of the last generation, from its start."""
    mem = strat.drafter.memories[strat.last_cache]
    assert mem.lo == 0 and mem.end == strat.last_cache.length - 1


CASES = [
    # seed, noise, max_nodes, width, branch, dtype, draft vocabulary
    (1, 0.0, 1, 1, 1, torch.float32, False),
    (2, 0.05, 4, 1, 1, torch.float32, True),
    (3, 0.3, 8, 2, 2, torch.float32, False),
    (4, 0.0, 12, 3, 2, torch.float32, True),
    (5, 0.1, 6, 2, 3, torch.bfloat16, False),
    (6, 0.5, 3, 1, 2, torch.bfloat16, True),
    (7, 0.0, 16, 4, 4, torch.bfloat16, True),
]


@pytest.mark.parametrize(("seed", "noise", "nodes", "width", "branch", "dtype", "vocab"), CASES)
def test_greedy_eagle_equals_plain_greedy(seed, noise, nodes, width, branch, dtype, vocab):
    rng = random.Random(seed)
    model = random_model(seed, dtype=dtype)
    head = eagle_head(model, noise, seed, rng.sample(range(64), 40) if vocab else None)
    strat = strategy(model, head, nodes, rng.randint(1, 6), width, branch)
    for _ in range(3):
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 30))]
        gen = GenerationConfig(max_new_tokens=rng.randint(1, 60))
        ref = Autoregressive(model, []).generate(prompt, gen)
        out = strat.generate(prompt, gen)
        assert out.tokens == ref.tokens
        assert out.stop_reason == ref.stop_reason
        assert strat.last_cache.length == len(prompt) + len(out.tokens) - 1
        _memory_in_step(strat)


def test_eos_rounds_without_drafts_and_the_cost_model():
    """Rounds that do not draft still feed the cache; a gap (a sequence seen from the middle) only forgets."""
    model = random_model(11)
    head = eagle_head(model, 0.0, 11)
    prompt, gen = [3, 4, 5], GenerationConfig(max_new_tokens=30)
    ref_long = Autoregressive(model, []).generate(prompt, gen).tokens
    eos = [ref_long[7]]
    ref = Autoregressive(model, eos).generate(prompt, gen)
    out = strategy(model, head, eos=eos).generate(prompt, gen)
    assert out.tokens == ref.tokens and out.stop_reason == ref.stop_reason
    flat = TreeCosts(draft=[0.01] * 4, verify=[1.0] * 9)
    steep = TreeCosts(draft=[1.0] * 4, verify=[1.0 + 2.0 * k for k in range(9)])
    for costs in (flat, steep):
        strat = strategy(model, head, costs=costs)
        assert strat.generate(prompt, gen).tokens == ref_long
        _memory_in_step(strat)
    drafter = strat.drafter
    cache = strat.last_cache
    drafter.observe(cache, torch.zeros(2, model.cfg.hidden_size), [1, 2], cache.length + 5)  # a gap
    mem = drafter.memories[cache]
    assert mem.lo == mem.fed == cache.length + 5 and mem.end == cache.length + 7


def test_the_cache_holds_the_true_features_of_verified_positions_only():
    """After trees were drafted and partly rejected, the EAGLE cache's K/V are those the training form
    computes from the true features of the final sequence (tree nodes never stay in it)."""
    model = random_model(12)
    head = eagle_head(model, 0.2, 12)
    strat = strategy(model, head, 8, 4, 2, 2)
    prompt = [7, 8, 9, 1, 2]
    out = strat.generate(prompt, GenerationConfig(max_new_tokens=40))
    assert out.stats["verify_rows_per_pass"] > out.stats["mean_accepted"] > 1.0  # accepted and rejected nodes
    _assert_memory_is_true(strat, strat.last_cache, eagle_head(model, 0.2, 12), prompt + out.tokens)


def _assert_memory_is_true(strat: TreeSpeculative, cache, fresh: EagleHead, tokens: list[int]) -> None:
    """The EAGLE cache of ``cache``'s sequence ``tokens`` holds what the training form computes from the
    true features (``fresh``: an unfrozen copy of the head)."""
    model = strat.model
    seq = torch.tensor([tokens])
    n = seq.shape[1] - 1  # verified positions
    with torch.no_grad():
        hidden = model.run_layers(model.embed_tokens(seq[:, :n]), model.new_cache(n), 0)
        x = fresh.fuse(hidden, seq[:, 1 : n + 1])
        cos, sin = model.rope(0, n, x.dtype)
        _, k, v = fresh.layer.attn.qkv(fresh.layer.attn_norm(x), cos, sin)
    mem = strat.drafter.memories[cache]
    ck, cv = mem.cache.view(0, mem.fed)
    assert mem.lo == 0 and mem.fed >= n - 8
    torch.testing.assert_close(ck, k[:, :, : mem.fed], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cv, v[:, :, : mem.fed], atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_plain_steps_between_rounds_keep_the_memory_true():
    """The server interleaves tree rounds with batched one-token steps (``step_rows``): through
    ``prefilled`` and ``stepped`` the EAGLE cache still holds every verified position's true pair."""
    from m2r2.decoding.base import Sampler, begin

    model = random_model(13)
    strat = strategy(model, eagle_head(model, 0.2, 13), 8, 4, 2, 2)
    prompt, gen, hidden = [7, 8, 9, 1, 2], GenerationConfig(max_new_tokens=60), []
    _, stopper, cache, logits = begin(model, prompt, gen, [], None, hidden)
    state, sampler = strat.make_drafter(cache), Sampler(gen, model.device)
    state.h_last = hidden[0]
    strat.prefilled(state, cache, hidden[1], prompt)
    tok = sampler(logits[0, -1])
    seq = [*prompt, tok]
    for i in range(8):
        if i % 3 == 2:  # a plain step, as the server's batched decoding runs it
            h = model.step_rows([tok], [cache])
            strat.stepped(state, cache, tok, h[:1])
            emitted = [int(model.head(h[:1])[0, -1].argmax())]
        else:
            emitted, *_ = strat.round(state, cache, tok, stopper, 1.0, gen, sampler)
        seq += emitted
        tok = emitted[-1]
    assert state.passes == 6 and state.accepted > 0
    _assert_memory_is_true(strat, cache, eagle_head(model, 0.2, 13), seq)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 4, 0.9)])
def test_eagle_speculative_sampling_reproduces_the_target_distribution(temperature, top_k, top_p):
    vocab = 6
    model = random_model(3, vocab=vocab, layers=3)
    with torch.no_grad():
        model.embed.weight.div_(32)  # flatter distributions: every token gets real mass
    head = eagle_head(model, 0.5, 3, vocab=[0, 2, 3, 5])
    strat = strategy(model, head, 3, 3, 2, 2)
    prompt, n = [1, 2], 3000
    outs = []
    for seed in range(n):
        gen = GenerationConfig(max_new_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        outs.append(strat.generate(prompt, gen).tokens)
    probe = GenerationConfig(max_new_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p)
    for step in (2, 3):
        expected = _exact_marginal(model, prompt, probe, step)
        counts = torch.zeros(vocab, dtype=torch.float64)
        for toks in outs:
            counts[toks[step - 1]] += 1
        keep = expected * n >= 5
        chi2 = float((((counts - expected * n) ** 2) / (expected * n))[keep].sum())
        assert chi2 < 20.6, (step, chi2, counts / n, expected)


def test_training_losses_score_what_inference_drafts():
    """Depth s + 1 at position t in training is the draft along the sequence's own tokens after verifying
    0..t - s; the agreement training reports is the one these drafts have with the full model."""
    from m2r2.training.eagle_train import eagle_losses
    from m2r2.training.seeded_train import pad_batch

    model = random_model(21, layers=3)
    rng = random.Random(0)
    prompt = [rng.randrange(64) for _ in range(20)]
    seq = prompt + Autoregressive(model, []).generate(prompt, GenerationConfig(20)).tokens
    tokens = torch.tensor([seq])
    with torch.no_grad():
        hidden = model.run_layers(model.embed_tokens(tokens), model.new_cache(len(seq)), 0)
    head = eagle_head(model, 0.3, 21, vocab=sorted(set(range(0, 64, 2)) | set(seq)))
    with torch.no_grad():
        trained = eagle_losses(head, pad_batch([{"tokens": tokens[0], "hidden": hidden[0]}], 0), 3)
    drafter = EagleDrafter(head.freeze())
    target = head.draft_top(hidden[0], 1)[0][:, 0]  # the full model's top-1 over the draft vocabulary
    hits: list[list[int]] = [[], [], []]
    for v in range(1, len(seq)):  # v positions verified; the root is x_v, drafts follow the sequence
        cache = model.new_cache(len(seq))
        drafter.observe(cache, hidden[0, : v - 1], seq[1:v], 0)
        drafter.start(hidden[:, v - 1 : v], cache, v)
        depth = min(3, len(seq) - v)
        tree = Tree(seq[v : v + depth], [-1, *range(depth - 1)], list(range(depth)), [1.0] * depth)
        for d in range(depth):
            top = int(drafter.top(tree, [d], 1)[0][0, 0])
            hits[d].append(int(top == int(target[v + d])))
    for d in range(3):
        assert trained["counts"][d] == len(hits[d])
        assert trained["agree"][d] == pytest.approx(sum(hits[d]) / len(hits[d]))
    assert 0 < sum(hits[0]) < len(hits[0])  # neither vacuous nor trivial


def test_head_file_round_trip_and_refusals(tmp_path):
    from m2r2.decoding.medusa import load_heads

    model = random_model(5)
    head = eagle_head(model, 0.1, 5, vocab=list(range(0, 64, 2)))
    path = save_head(tmp_path / "e.safetensors", head, "fp-1", torch.float32, note="x")
    back = load_head(path, model, "fp-1")
    assert back.cfg == head.cfg and torch.equal(back.draft_vocab, head.draft_vocab)
    for name, t in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], t)
    with pytest.raises(WeightsError, match=r"another base model.*train-eagle"):
        load_head(path, model, "fp-2")
    with pytest.raises(WeightsError, match="not an m2r2 Medusa heads config"):
        load_heads(path, model, "fp-1")  # an EAGLE head is no Medusa heads file
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(WeightsError, match="corrupt"):
        load_head(path, model, "fp-1")


def test_the_eagle_method_loads_a_head_for_its_model_only(tmp_path, monkeypatch, capsys, tiny_model):
    from m2r2.engine import Engine

    monkeypatch.chdir(tmp_path)  # no runs/eagle/eagle.safetensors here
    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    with pytest.raises(WeightsError, match="no EAGLE head for this base model"):
        e.strategy("eagle")
    head = eagle_head(e.model, 0.02, 0)
    path = save_head(tmp_path / "runs" / "eagle" / "eagle.safetensors", head, e.fingerprint)
    gen = GenerationConfig(max_new_tokens=24)
    ref = e.generate_ids([5, 6, 7], "vanilla", gen)
    out = e.generate_ids([5, 6, 7], "eagle", gen, cost_cache=False)  # found at the default path
    assert out.tokens == ref.tokens and out.stats["verify_passes"] >= 1
    other = save_head(tmp_path / "other.safetensors", head, "another-model")
    rc, out_text, err = run_cli(capsys, "generate", "hi", "--model", str(tiny_model(0)), "--dtype", "fp32",
                                "--method", "eagle", "--option", f"adapters={other}")  # fmt: skip
    assert_one_line_error(rc, out_text, err, "trained for another base model")
    assert path.is_file()


def test_training_on_a_store_runs_resumes_bit_for_bit_and_learns(tmp_path, tiny_model):
    from m2r2.engine import Engine
    from m2r2.training.eagle_train import EagleTrainSettings, eagle_losses, train_eagle
    from m2r2.training.seeded_train import pad_batch
    from m2r2.training.store import StoreSettings, TrainStore, build_store

    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    data = tmp_path / "conv.jsonl"
    _conversations(data, 40)
    s = StoreSettings(data=str(data), max_len=48, batch=8, shard_sequences=16, kv_layers=1)
    build_store(e.model, e.fingerprint, e.tokenizer.encode_conversation, tmp_path / "store", s)
    store = TrainStore(tmp_path / "store", e.fingerprint)
    seqs = [q for i in range(len(store.shards)) for q in store.sequences(store.load_shard(i, kv=False))]
    probe = pad_batch(seqs[4:20], 0)
    vocab = torch.arange(0, 300, 3)

    def settings(out: str, **kw) -> EagleTrainSettings:
        kw = {"steps": 12, "batch": 4, "holdout": 4, "chain": 2, "lr": 1e-2, "warmup": 2, "ckpt_minutes": 0.0} | kw
        return EagleTrainSettings(store=tmp_path / "store", out=tmp_path / out, **kw)

    whole = train_eagle(e.model, e.fingerprint, settings("whole"), vocab)

    class Killed(Exception):
        pass

    def kill_at_5(d: dict) -> None:
        if d["step"] == 5:
            raise Killed

    with pytest.raises(Killed):
        train_eagle(e.model, e.fingerprint, settings("split"), vocab, kill_at_5)
    resumed = train_eagle(e.model, e.fingerprint, settings("split", resume=True), vocab)
    for name, t in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], t), name
    meta = json.loads((tmp_path / "whole" / "eagle.json").read_text())
    assert meta["train"]["steps_done"] == 12 and len(meta["validation"]["agree_per_step"]) == 4
    loaded = load_head(tmp_path / "whole" / "eagle.safetensors", e.model, e.fingerprint)
    assert torch.equal(loaded.draft_vocab, vocab)
    fresh = EagleHead(e.model, loaded.cfg).copy_base()
    fresh.draft_vocab = vocab
    with torch.no_grad():
        before, after = eagle_losses(fresh, probe, 1), eagle_losses(loaded, probe, 1)
    assert float(after["feat"]) < float(before["feat"]) - 0.01, (float(before["feat"]), float(after["feat"]))
    half = train_eagle(e.model, e.fingerprint, settings("bf16", steps=2, bf16=True), vocab)  # autocast runs
    assert all(p.dtype == torch.float32 and p.isfinite().all() for p in half.parameters())


def test_train_eagle_writes_where_the_method_reads_and_eval_align_reports_depths(tmp_path, capsys, tiny_model):
    from m2r2.cli import build_parser
    from m2r2.engine import Engine
    from m2r2.paths import DEFAULT_EAGLE

    assert Path(build_parser().parse_args(["train-eagle"]).out) / "eagle.safetensors" == DEFAULT_EAGLE
    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    head = save_head(tmp_path / "e.safetensors", eagle_head(e.model, 0.1, 0), e.fingerprint)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [f"write {i} words"]}) + "\n" for i in range(3)))
    rc, out, err = run_cli(capsys, "eval-align", "--model", str(tiny_model(0)), "--dataset", str(prompts),
                           "--max-new-tokens", "12", "--adapters", str(head))  # fmt: skip
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["kind"] == "eagle" and len(rep["agree_per_draft_position"]) == 4


@pytest.mark.slow
def test_real_model_eagle_is_lossless_in_fp32_and_bf16(real_engine, real_engine_bf16, tmp_path):
    """On the bundled model, an untrained head (the last layer's copy) drafts trees that verify to exactly
    vanilla's tokens, in the fp32 reference mode and in bf16 with 4-bit kernels (the shipping path: a
    head file read into the quantised model), and with the shipped head."""
    from m2r2.tokenizer import messages_for

    e = real_engine
    head = EagleHead(e.model, EagleConfig.build(e.model.cfg.num_layers, e.model.cfg.hidden_size)).copy_base()
    path = save_head(tmp_path / "e.safetensors", head, e.fingerprint)
    gen = GenerationConfig(max_new_tokens=24)
    for engine in (e, real_engine_bf16):
        ids = engine.tokenizer.encode_chat(messages_for("Write a short poem about the sea."))
        ref = engine.generate_ids(ids, "vanilla", gen).tokens
        out = engine.generate_ids(ids, "eagle", gen, adapters=str(path), adaptive=False)
        assert out.tokens == ref
        assert out.stats["verify_passes"] < len(ref)  # some drafts were accepted
    shipped = real_engine_bf16.generate_ids(ids, "eagle", gen, adaptive=False)  # the head in m2r2/adapters/
    assert shipped.tokens == ref and shipped.stats["verify_passes"] < len(ref)
