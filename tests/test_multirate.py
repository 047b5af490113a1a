"""The fast stream on tiny random models: equivalences, shared-cache attention, adapter files."""

from __future__ import annotations

import json

import pytest
import torch

from m2r2.config import ModelConfig
from m2r2.errors import SettingsError, WeightsError
from m2r2.model import Transformer
from m2r2.multirate.fast import FastConfig, FastStream, block_starts
from m2r2.multirate.io import load_adapters, save_adapters, sidecar, tensor_fingerprint


def tiny(seed: int = 0, layers: int = 6) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=layers)).eval()


def slow_pass(model: Transformer, tokens: torch.Tensor):
    cache = model.new_cache(tokens.shape[1] + 8, batch=tokens.shape[0])
    hidden: list[torch.Tensor] = []
    with torch.no_grad():
        model.run_layers(model.embed_tokens(tokens), cache, 0, hidden)
    return cache, hidden


def randomize(stream: FastStream, scale: float = 0.2) -> None:
    with torch.no_grad():
        for p in stream.parameters():
            p.add_(torch.randn_like(p) * scale)


def test_config_paths():
    assert FastConfig.build(30, rate=3).path == list(range(10))
    assert FastConfig.build(30, rate=3, path="strided").path == [2, 5, 8, 11, 14, 17, 20, 23, 26, 29]
    c = FastConfig.build(30, depth=10)
    assert (c.rate, c.target(10), c.exits) == (3, 30, [10])
    assert FastConfig.build(30, path=[0, 3, 7]).rate == 10
    with pytest.raises(SettingsError):
        FastConfig.build(6, path=[0, 9])
    with pytest.raises(SettingsError):
        FastConfig.build(6, rate=2, exits=[5])


def test_untrained_fast_stream_equals_slow_stream():
    model = tiny()
    stream = FastStream(model, FastConfig.build(6, rate=2, depth=3))
    tokens = torch.randint(0, 97, (2, 11))
    cache, hidden = slow_pass(model, tokens)
    with torch.no_grad():
        states = stream.forward_train(model.embed_tokens(tokens), cache.k, cache.v, block_starts(11, [3, 1, 4, 3]))
        logits = stream.exit_logits(states[-1])
    # zero B: fast layer j is base layer j, its fast K/V equal the slow ones, so f_j == h_j
    torch.testing.assert_close(states[0], model.embed_tokens(tokens))
    for j in range(1, 4):
        torch.testing.assert_close(states[j], hidden[j - 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, model.head(hidden[2]), atol=1e-4, rtol=1e-4)
    # ...and changing the adapters does change the fast stream (the test above can fail)
    randomize(stream)
    with torch.no_grad():
        s2 = stream.forward_train(model.embed_tokens(tokens), cache.k, cache.v, block_starts(11, [11]))
    assert not torch.allclose(s2[-1], states[-1], atol=1e-3)


@pytest.mark.parametrize("path", ["prefix", "strided"])
def test_shared_kv_inference_equals_training_mask(path):
    model = tiny(1)
    stream = FastStream(model, FastConfig.build(6, rate=2, path=path, rank=4))
    randomize(stream)
    tokens = torch.randint(0, 97, (2, 13))
    blocks = [2, 4, 1, 3, 3]
    starts = block_starts(13, blocks)
    cache, _ = slow_pass(model, tokens)
    with torch.no_grad():
        train_states = stream.forward_train(model.embed_tokens(tokens), cache.k, cache.v, starts)
        train_logits = stream.exit_logits(train_states[-1])
    pos = 0
    for w in blocks:
        # inference: a slow cache holding only the verified prefix (stale junk beyond it)
        c = model.new_cache(16, batch=2)
        c.k.normal_()
        c.v.normal_()
        with torch.no_grad():
            if pos:
                model(tokens[:, :pos], c, 0)
            full = stream.draft_step(tokens[:, pos : pos + w], c, pos)
            # the same block drafted one token at a time, extending the block's fast K/V
            blk, outs = None, []
            for i in range(w):
                o = stream.draft_step(tokens[:, pos + i : pos + i + 1], c, pos, blk)
                blk = o.block
                outs.append(o.logits)
        assert c.length == pos, "draft_step must not write the slow cache"
        torch.testing.assert_close(full.logits, train_logits[:, pos : pos + w], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.cat(outs, 1), full.logits, atol=1e-4, rtol=1e-4)
        for a, b in zip(full.states, train_states, strict=True):
            torch.testing.assert_close(a, b[:, pos : pos + w], atol=1e-4, rtol=1e-4)
        pos += w
    # a different block partition gives different fast states (the mask matters)
    with torch.no_grad():
        other = stream.forward_train(model.embed_tokens(tokens), cache.k, cache.v, block_starts(13, [13]))
    assert not torch.allclose(other[-1], train_states[-1], atol=1e-3)


def test_adapters_change_nothing_in_slow_stream():
    model = tiny(2)
    tokens = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        before = model(tokens, model.new_cache(9), 0)
    stream = FastStream(model, FastConfig.build(6, rate=2, rank=4))
    randomize(stream)
    cache = model.new_cache(12)
    with torch.no_grad():
        model(tokens[:, :5], cache, 0)
        stream.draft_step(tokens[:, 5:], cache, 5)
        after = model(tokens, model.new_cache(9), 0)
    assert torch.equal(before, after)
    assert all(not n.startswith("base") for n in stream.state_dict())


def test_adapter_file_roundtrip_and_refusals(tmp_path):
    model = tiny(3)
    fp = tensor_fingerprint(model)
    stream = FastStream(model, FastConfig.build(6, rate=3, rank=4))
    randomize(stream)
    path = save_adapters(tmp_path / "a.safetensors", stream, fp, dtype=torch.float32, steps=7)
    meta = json.loads(sidecar(path).read_text())
    assert meta["config"]["rank"] == 4 and meta["steps"] == 7 and meta["base_fingerprint"] == fp
    loaded = load_adapters(path, model, fp)
    for k, v in stream.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    # another base model
    other = tiny(4)
    with pytest.raises(WeightsError, match="another base model"):
        load_adapters(path, other, tensor_fingerprint(other))
    # truncated weights
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="truncated or corrupt"):
        load_adapters(path, model, fp)
    # corrupt sidecar, missing sidecar
    path.write_bytes(data)
    sidecar(path).write_text("{not json")
    with pytest.raises(WeightsError, match="corrupt"):
        load_adapters(path, model, fp)
    sidecar(path).unlink()
    with pytest.raises(WeightsError, match="missing"):
        load_adapters(path, model, fp)


def test_bf16_inference_model_runs_adapters():
    model = tiny(5).to(torch.bfloat16)
    stream = FastStream(model, FastConfig.build(6, rate=2, rank=4))
    randomize(stream)
    stream.freeze()
    cache = model.new_cache(10)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 4)), cache, 0)
        out = stream.draft_step(torch.randint(0, 97, (1, 2)), cache, 4)
        p = stream.exit_probability(out.states, 3)
    assert out.logits.shape == (1, 2, 97) and out.logits.dtype == torch.float32
    assert p.shape == (1, 2) and bool(((p > 0) & (p < 1)).all())


def test_align_report_untrained_equals_plain_early_exit():
    from m2r2.training.evaluate import align_report, expected_speedup

    model = tiny(6)
    stream = FastStream(model, FastConfig.build(6, rate=2, rank=4))
    g = torch.Generator().manual_seed(0)
    recs = [
        {
            "prompt_ids": torch.randint(0, 97, (5,), generator=g).tolist(),
            "answer_ids": torch.randint(0, 97, (9,), generator=g).tolist(),
        }
        for _ in range(5)
    ]
    rep = align_report(stream, recs, block=3, batch=2)
    assert rep["positions"] == 5 * 9 and [r["layer"] for r in rep["layers"]] == [1, 2, 3]
    for r in rep["layers"]:
        assert r["agree_fast"] == pytest.approx(r["agree_plain"]) and r["cos_fast"] == pytest.approx(r["cos_plain"])
    assert rep["layers"][-1]["target_layer"] == 6 and rep["layers"][-1]["cos_fast"] < 0.999
    randomize(stream, 0.5)
    assert align_report(stream, recs)["layers"][-1]["agree_fast"] != rep["layers"][-1]["agree_fast"]
    assert expected_speedup(0.0, 0.5) == (1.0, 0)
    speed, gamma = expected_speedup(0.8, 0.1)
    assert speed > 2.4 and gamma >= 4


def test_no_shipped_adapters_for_unknown_model_is_a_clear_error():
    from m2r2.multirate.io import load_default

    model = tiny(7)
    with pytest.raises(WeightsError, match="no adapters ship"):
        load_default(model, tensor_fingerprint(model))


@pytest.mark.slow
def test_shipped_adapters_load_by_default_on_bundled_model():
    from m2r2.loading import load_model, resolve_model
    from m2r2.multirate.io import bundled_adapters, load_default

    lm = load_model(resolve_model(quiet=True), torch.bfloat16)
    path = bundled_adapters(lm.fingerprint)
    assert path is not None and path.stat().st_size < 4_000_000, "the shipped adapters must stay small"
    stream = load_default(lm.model, lm.fingerprint).freeze()
    cache = lm.model.new_cache(16)
    tokens = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646]])
    with torch.no_grad():
        lm.model(tokens[:, :6], cache, 0)
        out = stream.draft_step(tokens[:, 6:], cache, 6)
    assert out.logits.shape == (1, 2, lm.model.cfg.vocab_size) and bool(out.logits.isfinite().all())
    assert any(float(p.abs().max()) > 0 for n, p in stream.named_parameters() if ".B." in n), "B must be trained"


@pytest.mark.parametrize("kernel", ["plain", "mkldnn", "q4", "q4-amx", "q4-avx512", "q4-avx2"])
def test_merged_fast_layers_match_low_rank_deltas_and_leave_base_alone(kernel):
    from conftest import skip_unless_kernel
    from m2r2.kernels import use_kernels

    torch.manual_seed(8)  # widths that fit every kernel (q4 wants multiples of 32)
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=2)
    model = Transformer(cfg).eval()
    if kernel != "plain":
        model = model.to(torch.bfloat16)
        skip_unless_kernel(model, kernel)
        use_kernels(model, kernel)
    stream = FastStream(model, FastConfig.build(6, rate=2, rank=4))
    randomize(stream, 0.3)
    tokens = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        before = model(tokens, model.new_cache(12), 0)
        cache = model.new_cache(12)
        model(tokens[:, :8], cache, 0)
        lora = stream.freeze().draft_step(tokens[:, 8:], cache, 8)
        assert stream.freeze(merge=True).merged is not None and len(stream.merged) == 3
        merged = stream.draft_step(tokens[:, 8:], cache, 8)
        after = model(tokens, model.new_cache(12), 0)
        plain = FastStream(model, stream.cfg)
        plain.use_adapters = False
        base_states = plain.freeze().draft_step(tokens[:, 8:], cache, 8).states
    if not kernel.startswith("q4"):  # folding changes the kernel, not the function: equal up to rounding
        # bf16: folding rounds W + BA once, the delta path rounds W and BA x apart; through 3 layers of
        # states up to ~20 (bf16 step 0.125) that measured up to 4 steps apart on a CPU without native
        # bf16 instructions (0.1 held on an AMX CPU), so the absolute bound scales with the state size
        for a, b in zip(lora.states, merged.states, strict=True):
            atol = 1e-4 if kernel == "plain" else max(0.1, 0.025 * float(a.float().abs().max()))
            torch.testing.assert_close(b.float(), a.float(), atol=atol, rtol=1e-4 if kernel == "plain" else 0.1)
    # q4 re-quantizes W + BA (lossy on random weights), still far closer to the adapted stream than the base
    err = (merged.states[-1] - lora.states[-1]).float().norm()
    assert err < 0.5 * (base_states[-1] - lora.states[-1]).float().norm()
    # the slow stream (the base model) is bit-for-bit untouched by folding
    assert torch.equal(before, after)
    assert all(not n.startswith(("base", "merged")) for n in stream.state_dict())
    stream.train()
    assert stream.merged is None, "training must drop folded copies (they would go stale)"


def test_merged_forward_train_is_the_inference_form():
    model = tiny(9)
    stream = FastStream(model, FastConfig.build(6, rate=2, rank=4))
    randomize(stream)
    tokens = torch.randint(0, 97, (2, 10))
    cache, _ = slow_pass(model, tokens)
    starts = block_starts(10, [10])
    with torch.no_grad():
        ref = stream.freeze().forward_train(model.embed_tokens(tokens), cache.k, cache.v, starts)
        got = stream.freeze(merge=True).forward_train(model.embed_tokens(tokens), cache.k, cache.v, starts)
    torch.testing.assert_close(got[-1], ref[-1], atol=1e-4, rtol=1e-4)


def test_draft_vocabulary_head_scores_only_its_tokens_and_roundtrips(tmp_path):
    model = tiny(10)
    fp = tensor_fingerprint(model)
    stream = FastStream(model, FastConfig.build(6, rate=2, rank=4))
    randomize(stream)
    ids = [3, 5, 8, 13, 21, 34, 55, 89]
    stream.draft_vocab = torch.tensor(ids)
    f = torch.randn(2, 3, 48)
    with torch.no_grad():
        full = stream.freeze().exit_logits(f)  # no folding: the whole head, vocabulary ignored
        sub = stream.freeze(merge=True).exit_logits(f)
    assert torch.equal(full, model.head(f))
    torch.testing.assert_close(sub[..., ids], full[..., ids], atol=1e-5, rtol=1e-5)
    outside = torch.ones(97, dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isneginf(sub[..., outside]).all())
    # saved with the adapters, and checked on load
    path = save_adapters(tmp_path / "v.safetensors", stream, fp, dtype=torch.float32)
    assert load_adapters(path, model, fp).draft_vocab.tolist() == ids
    from safetensors.torch import load_file, save_file

    from m2r2.multirate.io import DRAFT_VOCAB, file_hash

    sd = load_file(str(path))
    sd[DRAFT_VOCAB] = torch.tensor([3, 3, 500], dtype=torch.int32)
    save_file(sd, str(path))
    meta = json.loads(sidecar(path).read_text())
    meta["weights_sha256"] = file_hash(path)
    sidecar(path).write_text(json.dumps(meta))
    with pytest.raises(WeightsError, match="draft vocabulary"):
        load_adapters(path, model, fp)


def test_draft_vocabulary_choice():
    from collections import Counter

    from m2r2.training.vocab import coverage, draft_vocabulary

    answers = Counter({5: 10, 7: 10, 9: 3, 11: 1})
    prompts = Counter({40: 100, 9: 1})
    ids = draft_vocabulary(answers, prompts, 4, 50, keep=[2])
    # 2 kept (EOS); then by score: 5 and 7 (0.42 each), 40 (0.5 * 0.99), then 9 (0.125 + 0.005)
    assert ids.tolist() == [2, 5, 7, 40]
    assert draft_vocabulary(answers, Counter(), 3, 50).tolist() == [5, 7, 9]  # ties by smaller id
    assert coverage(ids, [5, 5, 9, 2]) == 0.75
    with pytest.raises(SettingsError):
        draft_vocabulary(answers, prompts, 0, 50, keep=[2])
    from m2r2.errors import InputError

    with pytest.raises(InputError):
        draft_vocabulary(Counter(), prompts, 4, 50)
