"""Medusa heads: lossless with m2r2's tree verifier on many tiny random models, exact sampling, heads
files bound to their base model, and store training that drafts what inference drafts, resumes bit for
bit and learns."""

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
from m2r2.decoding.medusa import MedusaConfig, MedusaDrafter, MedusaHeads, load_heads, save_heads
from m2r2.decoding.tree import Tree, TreeCosts, TreeSpeculative
from m2r2.errors import SettingsError, WeightsError


def medusa_heads(model, n: int, noise: float, seed: int, vocab: list[int] | None = None) -> MedusaHeads:
    """``n`` heads on ``model``; ``noise`` perturbs their (zero-initialised) residual blocks."""
    heads = MedusaHeads(model, MedusaConfig.build(model.cfg.hidden_size, n))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    if vocab is not None:
        heads.draft_vocab = torch.tensor(sorted(vocab))
    return heads


def strategy(model, heads: MedusaHeads, nodes=8, depth=5, width=2, branch=2, costs=None, eos=()) -> TreeSpeculative:
    return TreeSpeculative("medusa", model, MedusaDrafter(heads.freeze()), list(eos), None, nodes, depth, width, branch,
                           costs)  # fmt: skip


CASES = [
    # seed, heads, noise, max_nodes, width, branch, dtype, draft vocabulary
    (1, 1, 0.0, 1, 1, 1, torch.float32, False),
    (2, 4, 0.05, 4, 1, 1, torch.float32, True),
    (3, 3, 0.3, 8, 2, 2, torch.float32, False),
    (4, 4, 0.0, 12, 3, 2, torch.float32, True),
    (5, 2, 0.1, 6, 2, 3, torch.bfloat16, False),
    (6, 4, 0.5, 3, 1, 2, torch.bfloat16, True),
    (7, 5, 0.0, 16, 4, 4, torch.bfloat16, True),
    (8, 4, 0.02, 5, 2, 1, torch.float32, False),
]


@pytest.mark.parametrize(("seed", "n", "noise", "nodes", "width", "branch", "dtype", "vocab"), CASES)
def test_greedy_medusa_equals_plain_greedy(seed, n, noise, nodes, width, branch, dtype, vocab):
    rng = random.Random(seed)
    model = random_model(seed, dtype=dtype)
    heads = medusa_heads(model, n, noise, seed, rng.sample(range(64), 40) if vocab else None)
    strat = strategy(model, heads, nodes, rng.randint(1, 6), width, branch)
    for _ in range(3):
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 30))]
        gen = GenerationConfig(max_new_tokens=rng.randint(1, 60))
        ref = Autoregressive(model, []).generate(prompt, gen)
        out = strat.generate(prompt, gen)
        assert out.tokens == ref.tokens
        assert out.stop_reason == ref.stop_reason
        n_tok = len(prompt) + len(out.tokens) - 1
        assert strat.last_cache.length == n_tok  # the cache holds exactly the verified sequence
    assert out.stats["draft_layers_per_token"] == 0.0  # heads run no transformer layer


def test_eos_inside_an_accepted_path_and_the_cost_model():
    model = random_model(11)
    heads = medusa_heads(model, 4, 0.0, 11)
    prompt, gen = [3, 4, 5], GenerationConfig(max_new_tokens=30)
    ref_long = Autoregressive(model, []).generate(prompt, gen).tokens
    eos = [ref_long[7]]
    ref = Autoregressive(model, eos).generate(prompt, gen)
    out = strategy(model, heads, eos=eos).generate(prompt, gen)
    assert out.tokens == ref.tokens and out.stop_reason == ref.stop_reason
    # a heavy per-round start with flat verification still pays; steep verification never does
    flat = TreeCosts(draft=[1e-6] * 4, verify=[1.0] * 9, start=0.05)
    steep = TreeCosts(draft=[1e-6] * 4, verify=[1.0 + 2.0 * k for k in range(9)], start=0.5)
    cheap, dear = strategy(model, heads, costs=flat), strategy(model, heads, costs=steep)
    cheap.online_costs = dear.online_costs = False  # these costs are not seconds: no wall-clock correction
    cheap, dear = cheap.generate(prompt, gen), dear.generate(prompt, gen)
    assert cheap.tokens == ref_long and dear.tokens == ref_long
    assert cheap.stats["verify_rows_per_pass"] > 2.0 and cheap.stats["draft_start_cost"] == pytest.approx(0.05)
    assert dear.stats["verify_rows_per_pass"] == 1.0


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 4, 0.9)])
def test_medusa_speculative_sampling_reproduces_the_target_distribution(temperature, top_k, top_p):
    vocab = 6
    model = random_model(3, vocab=vocab, layers=3)
    with torch.no_grad():
        model.embed.weight.div_(32)  # flatter distributions: every token gets real mass
    heads = medusa_heads(model, 3, 1.0, 3, vocab=[0, 2, 3, 5])
    strat = strategy(model, heads, 3, 3, 2, 2)
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
    """Head i's top-1 at position t in training is the draft at depth i+1 after verifying 0..t; the
    agreement training reports is the one these drafts have with the full model."""
    from m2r2.training.seeded_train import medusa_losses, pad_batch

    model = random_model(21, layers=3)
    rng = random.Random(0)
    prompt = [rng.randrange(64) for _ in range(30)]
    seq = prompt + Autoregressive(model, []).generate(prompt, GenerationConfig(20)).tokens
    tokens = torch.tensor([seq])
    with torch.no_grad():
        hidden = model.run_layers(model.embed_tokens(tokens), model.new_cache(len(seq)), 0)
    heads = medusa_heads(model, 3, 0.01, 21, vocab=sorted(set(range(0, 64, 2)) | set(seq)))
    row = {"tokens": tokens[0], "hidden": hidden[0]}
    with torch.no_grad():
        trained = medusa_losses(heads, pad_batch([row], 0))
    drafter = MedusaDrafter(heads.freeze())
    target = heads.draft_top(hidden[0], 1)[0][:, 0]  # the full model's top-1 over the draft vocabulary
    for i in range(3):
        hits = []
        for t in range(len(seq) - i - 1):
            drafter.start(hidden[:, t : t + 1], None, t + 1)
            node = Tree([0] * (i + 1), [-1] * (i + 1), list(range(i + 1)), [1.0] * (i + 1))
            hits.append(int(drafter.top(node, [i], 1)[0][0, 0]) == int(target[t + i + 1]))
        assert trained["counts"][i] == len(hits)
        assert trained["agree"][i] == pytest.approx(sum(hits) / len(hits))
        assert 0 < sum(hits) < len(hits)  # neither vacuous nor trivial


def test_heads_file_round_trip_and_refusals(tmp_path):
    from m2r2.multirate.io import load_adapters

    model = random_model(5)
    heads = medusa_heads(model, 3, 0.1, 5, vocab=list(range(0, 64, 2)))
    path = save_heads(tmp_path / "h.safetensors", heads, "fp-1", torch.float32, note="x")
    back = load_heads(path, model, "fp-1")
    assert back.cfg == heads.cfg and torch.equal(back.draft_vocab, heads.draft_vocab)
    for name, t in heads.state_dict().items():
        assert torch.equal(back.state_dict()[name], t)
    with pytest.raises(WeightsError, match=r"another base model.*train-medusa"):
        load_heads(path, model, "fp-2")
    with pytest.raises(WeightsError, match="not an m2r2 adapter config"):
        load_adapters(path, model, "fp-1")  # heads are not adapters, nor the reverse
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(WeightsError, match="corrupt"):
        load_heads(path, model, "fp-1")
    with pytest.raises(SettingsError):
        MedusaConfig.build(64, heads=0)


def test_the_medusa_method_loads_heads_for_its_model_only(tmp_path, monkeypatch, capsys, tiny_model):
    from m2r2.engine import Engine

    monkeypatch.chdir(tmp_path)  # no runs/medusa/heads.safetensors here
    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    with pytest.raises(WeightsError, match="no Medusa heads for this base model"):
        e.strategy("medusa")
    heads = medusa_heads(e.model, 4, 0.02, 0)
    path = save_heads(tmp_path / "runs" / "medusa" / "heads.safetensors", heads, e.fingerprint)
    gen = GenerationConfig(max_new_tokens=24)
    ref = e.generate_ids([5, 6, 7], "vanilla", gen)
    out = e.generate_ids([5, 6, 7], "medusa", gen, cost_cache=False)  # found at the default path
    assert out.tokens == ref.tokens and out.stats["verify_passes"] >= 1
    other = save_heads(tmp_path / "other.safetensors", heads, "another-model")
    rc, out_text, err = run_cli(capsys, "generate", "hi", "--model", str(tiny_model(0)), "--dtype", "fp32",
                                "--method", "medusa", "--option", f"adapters={other}")  # fmt: skip
    assert_one_line_error(rc, out_text, err, "trained for another base model")
    assert path.is_file()


def test_training_on_a_store_runs_resumes_bit_for_bit_and_learns(tmp_path, tiny_model):
    from m2r2.engine import Engine
    from m2r2.training.seeded_train import MedusaTrainSettings, medusa_losses, pad_batch, train_medusa
    from m2r2.training.store import StoreSettings, TrainStore, build_store

    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    data = tmp_path / "conv.jsonl"
    _conversations(data, 40)
    s = StoreSettings(data=str(data), max_len=48, batch=8, shard_sequences=16, kv_layers=1)
    build_store(e.model, e.fingerprint, e.tokenizer.encode_conversation, tmp_path / "store", s)
    store = TrainStore(tmp_path / "store", e.fingerprint)
    assert "k" not in store.load_shard(0, kv=False)
    seqs = [q for i in range(len(store.shards)) for q in store.sequences(store.load_shard(i, kv=False))]
    probe = pad_batch(seqs[4:20], 0)
    vocab = torch.arange(0, 300, 3)

    def settings(out: str, **kw) -> MedusaTrainSettings:
        kw = {"steps": 12, "batch": 4, "holdout": 4, "heads": 3, "lr": 2e-2, "warmup": 2, "ckpt_minutes": 0.0} | kw
        return MedusaTrainSettings(store=tmp_path / "store", out=tmp_path / out, **kw)

    whole = train_medusa(e.model, e.fingerprint, settings("whole"), vocab)

    class Killed(Exception):
        pass

    def kill_at_5(d: dict) -> None:
        if d["step"] == 5:
            raise Killed

    with pytest.raises(Killed):
        train_medusa(e.model, e.fingerprint, settings("split"), vocab, kill_at_5)
    resumed = train_medusa(e.model, e.fingerprint, settings("split", resume=True), vocab)
    for name, t in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], t), name
    meta = json.loads((tmp_path / "whole" / "heads.json").read_text())
    assert meta["train"]["steps_done"] == 12 and len(meta["validation"]["agree_per_step"]) == 3
    loaded = load_heads(tmp_path / "whole" / "heads.safetensors", e.model, e.fingerprint)
    assert torch.equal(loaded.draft_vocab, vocab)
    fresh = MedusaHeads(e.model, MedusaConfig.build(e.model.cfg.hidden_size, 3))
    fresh.draft_vocab = vocab
    with torch.no_grad():
        before, after = medusa_losses(fresh, probe)["ce"], medusa_losses(loaded, probe)["ce"]
    assert float(after) < float(before) - 0.1, (float(before), float(after))  # random targets: high entropy
    with pytest.raises(SettingsError, match="was written with different settings"):
        train_medusa(e.model, e.fingerprint, settings("split", resume=True, seed=1), vocab)
    half = train_medusa(e.model, e.fingerprint, settings("bf16", steps=2, bf16=True), vocab)  # autocast runs
    assert all(p.dtype == torch.float32 and p.isfinite().all() for p in half.parameters())


def test_train_medusa_writes_where_the_method_reads_and_eval_align_reports_heads(tmp_path, capsys, tiny_model):
    from m2r2.cli import build_parser
    from m2r2.engine import Engine
    from m2r2.paths import DEFAULT_MEDUSA

    assert Path(build_parser().parse_args(["train-medusa"]).out) / "heads.safetensors" == DEFAULT_MEDUSA
    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    heads = save_heads(tmp_path / "h.safetensors", medusa_heads(e.model, 2, 0.1, 0), e.fingerprint)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [f"write {i} words"]}) + "\n" for i in range(3)))
    rc, out, err = run_cli(capsys, "eval-align", "--model", str(tiny_model(0)), "--dataset", str(prompts),
                           "--max-new-tokens", "12", "--adapters", str(heads))  # fmt: skip
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["kind"] == "medusa" and len(rep["agree_per_draft_position"]) == 2
