"""Mixture-of-Depths baseline (method ``mod``): exactness at threshold 0, K/V masking, training, files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from m2r2.config import ModelConfig
from m2r2.decoding.autoregressive import Autoregressive
from m2r2.decoding.base import GenerationConfig
from m2r2.decoding.mixture_of_depths import MixtureOfDepths, check_threshold
from m2r2.errors import SettingsError, WeightsError
from m2r2.model import Transformer
from m2r2.multirate.io import tensor_fingerprint
from m2r2.training.loop import collate, make_sequences
from m2r2.training.mixture_of_depths import (
    MoDLoss,
    MoDSettings,
    RouterConfig,
    Routers,
    load_routers,
    routable_mask,
    routed_forward,
    save_routers,
    train_mod,
)

CFG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_layers": 6, "num_heads": 4, "head_dim": 8}
PROMPT = [5, 9, 17, 3, 41, 8, 22]


def tiny(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(ModelConfig(**CFG)).eval().requires_grad_(False)
    with torch.no_grad():  # larger block outputs than the default init: skipping a block matters
        for blk in m.layers:
            blk.mlp.w2.weight.mul_(4)
            blk.attn.wo.weight.mul_(4)
    return m


def hard_routers(seed: int = 0, scale: float = 400.0) -> Routers:
    """Random routers with huge logits: every gate is exactly 0 or 1 in float32, by token and block."""
    g = torch.Generator().manual_seed(seed)
    r = Routers(RouterConfig.build(CFG["num_layers"], CFG["hidden_size"]))
    with torch.no_grad():
        r.weight.copy_(scale * torch.randn(r.weight.shape, generator=g))
        r.bias.zero_()
    return r.requires_grad_(False)


def test_threshold_zero_reproduces_vanilla_and_skipping_changes_output():
    model = tiny()
    gen = GenerationConfig(max_new_tokens=40)
    ref = Autoregressive(model, eos_ids=[]).generate(PROMPT, gen)
    skip_all = hard_routers()
    with torch.no_grad():
        skip_all.weight.zero_()
        skip_all.bias.fill_(-50.0)  # every router says skip
    out = MixtureOfDepths(model, skip_all, 0.0, eos_ids=[]).generate(PROMPT, gen)
    assert out.tokens == ref.tokens
    assert out.stats["layers_per_token"] == CFG["num_layers"]
    lossy = MixtureOfDepths(model, skip_all, 0.5, eos_ids=[]).generate(PROMPT, gen)
    # only the always-on first and last blocks run for generated tokens; the first token is the prefill's
    assert lossy.stats["layers_per_token"] == pytest.approx((6 + 2 * 39) / 40)
    assert lossy.tokens != ref.tokens


def test_skipped_tokens_write_no_kv_and_are_masked_like_training():
    """Decoding one token at a time equals the soft-routed training forward with 0/1 gates."""
    model = tiny(1)
    routers = hard_routers(1)
    dec = MixtureOfDepths(model, routers, 0.5, eos_ids=[])
    feed = [30, 2, 11, 57, 4, 19, 23, 8, 44, 1, 36, 12]
    cache = model.new_cache(64)
    valid = torch.ones(CFG["num_layers"], 64, dtype=torch.bool)
    step_logits, ran = [], []
    with torch.no_grad():
        model(torch.tensor([PROMPT]), cache, 0)
        for tok in feed:
            logits, n = dec.step(tok, cache, valid)
            step_logits.append(logits[0, -1])
            ran.append(n)
    n0 = len(PROMPT)
    skipped = ~valid[:, n0 : n0 + len(feed)]
    # a real mix of skips and runs, never in the always-on blocks
    assert 0 < int(skipped.sum()) < skipped.numel() - 2 * len(feed)
    assert not skipped[0].any() and not skipped[-1].any()
    assert ran == [CFG["num_layers"] - int(c) for c in skipped.sum(0)]
    # skipped (token, block) pairs left their cache slots untouched (zeros); run pairs wrote K/V
    k = cache.k[:, 0, :, n0 : n0 + len(feed)].abs().sum((1, 3))  # [layers, tokens]
    assert (k[skipped] == 0).all() and (k[~skipped] > 0).all()
    # the training forward with exact 0/1 gates: x unchanged where g = 0, keys masked by log g = -inf-ish
    tokens = torch.tensor([PROMPT + feed])
    routable = torch.zeros_like(tokens, dtype=torch.bool)
    routable[0, n0:] = True
    with torch.no_grad():
        h, gates = routed_forward(model, routers, tokens, routable)
        ref = model.head(h)[0, n0:]
    assert torch.equal(gates[0, n0:].T == 0, skipped[1:-1])
    torch.testing.assert_close(torch.stack(step_logits), ref, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # the straight-through training forward makes the same hard decisions
        h_st, _ = routed_forward(model, routers, tokens, routable, hard=True)
    torch.testing.assert_close(model.head(h_st)[0, n0:], ref, atol=1e-5, rtol=1e-5)
    # not vacuous: attending to the skipped slots (zeros) instead of masking them changes the logits
    cache2, valid2, unmasked = model.new_cache(64), torch.ones_like(valid), []
    with torch.no_grad():
        model(torch.tensor([PROMPT]), cache2, 0)
        for tok in feed:
            unmasked.append(dec.step(tok, cache2, valid2)[0][0, -1])
            valid2.fill_(True)  # forget the skips
    assert not torch.allclose(torch.stack(unmasked), ref, atol=1e-3)


def records(n: int = 16, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "id": str(i),
            "source": "x",
            "prompt_ids": torch.randint(1, 64, (5,), generator=g).tolist(),
            "answer_ids": torch.randint(1, 64, (20,), generator=g).tolist(),
        }
        for i in range(n)
    ]


def settings(out: Path, **kw) -> MoDSettings:
    d = {"out": out, "steps": 6, "batch": 4, "max_len": 32, "lr": 5e-2, "warmup": 1, "lam": 1.0, "ckpt_minutes": 1e9}
    d.update(kw)
    return MoDSettings(**d)


def test_training_learns_to_skip_and_resume_is_bit_for_bit(tmp_path):
    model = tiny(2)
    recs = records()
    fp = tensor_fingerprint(model)
    full = train_mod(model, recs, settings(tmp_path / "a", steps=30), fp)
    train_mod(model, recs, settings(tmp_path / "b", steps=15), fp)
    resumed = train_mod(model, recs, settings(tmp_path / "b", steps=30, resume=True), fp)
    assert resumed["steps_this_run"] == 15
    for k, v in full["routers"].state_dict().items():
        assert torch.equal(resumed["routers"].state_dict()[k], v), k
    # the compute penalty pulls the gates down from their initial ~0.95
    seqs = make_sequences(recs, 32)
    tokens, mask = collate(seqs)
    with torch.no_grad():
        _, before = MoDLoss(Routers(RouterConfig.build(6, 32)), model, 1.0)(
            tokens, mask, routable_mask(seqs, tokens.shape[1])
        )
        _, last = MoDLoss(full["routers"], model, 1.0)(tokens, mask, routable_mask(seqs, tokens.shape[1]))
    assert last["gate"] < before["gate"] - 0.05, (before, last)
    # the router file loads back into an identical decoder
    loaded = load_routers(tmp_path / "a" / "routers.safetensors", model, fp)
    assert torch.equal(loaded.weight, full["routers"].weight)
    meta = json.loads((tmp_path / "a" / "routers.json").read_text())
    assert meta["steps"] == 30 and meta["config"]["always_on"] == [0, 5]
    with pytest.raises(SettingsError, match="different settings"):
        train_mod(model, recs, settings(tmp_path / "b", steps=31, resume=True, lr=0.1), fp)
    with pytest.raises(SettingsError, match="written with"):
        train_mod(model, recs, settings(tmp_path / "b", steps=31, resume=True, lam=0.5), fp)


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, math.inf, "high", True, None])
def test_bad_threshold_is_refused(bad):
    with pytest.raises(SettingsError, match="threshold"):
        check_threshold(bad)


def test_router_files_are_bound_to_their_model(tmp_path):
    model = tiny(3)
    r = Routers(RouterConfig.build(6, 32))
    path = save_routers(tmp_path / "r.safetensors", r, tensor_fingerprint(model))
    with pytest.raises(WeightsError, match="another base model"):
        load_routers(path, tiny(4), tensor_fingerprint(tiny(4)))
    path.write_bytes(path.read_bytes()[:-8] + b"\xff" * 8)
    with pytest.raises(WeightsError, match="corrupt"):
        load_routers(path, model, tensor_fingerprint(model))
    with pytest.raises(WeightsError, match="missing"):
        load_routers(tmp_path / "none.safetensors", model, tensor_fingerprint(model))
    with pytest.raises(SettingsError, match="always-on"):
        RouterConfig.build(6, 32, [7])


def test_engine_refuses_bad_options_and_missing_routers(tiny_model):
    from m2r2.engine import Engine

    e = Engine(model=tiny_model(), dtype="fp32", quiet=True)
    with pytest.raises(SettingsError, match="threshold"):
        e.strategy("mod", threshold=2.0)
    with pytest.raises(WeightsError, match="no Mixture-of-Depths routers"):
        e.strategy("mod", threshold=0.5)


def test_shipped_routers_do_not_shadow_shipped_adapters():
    from importlib import resources

    from m2r2.decoding.mixture_of_depths import bundled_routers
    from m2r2.multirate.io import bundled_adapters

    root = Path(str(resources.files("m2r2") / "adapters"))
    if not (root / "smollm2-135m-mod.json").is_file():
        pytest.skip("no shipped routers")
    fp = json.loads((root / "smollm2-135m.json").read_text())["base_fingerprint"]
    assert bundled_adapters(fp) == root / "smollm2-135m.safetensors"
    assert bundled_routers(fp) == root / "smollm2-135m-mod.safetensors"


def test_real_model_threshold_zero_is_vanilla_and_routers_skip(real_engine_bf16):
    e = real_engine_bf16
    prompt = e.tokenizer.encode_chat([{"role": "user", "content": "Give me three tips for better sleep."}])
    gen = GenerationConfig(max_new_tokens=24)
    ref = e.strategy("vanilla").generate(prompt, gen)
    assert e.strategy("mod", threshold=0.0).generate(prompt, gen).tokens == ref.tokens
    out = e.strategy("mod").generate(prompt, gen)
    assert out.stats["layers_per_token"] < e.model.cfg.num_layers
