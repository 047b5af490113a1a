"""Sparse MoE models: parity with transformers (Mixtral, Qwen2-MoE, OLMoE), MoEfication, expert sources.

Tolerances as in test_parity.py: fp32 logits of the tiny models agree to ``atol=1e-4`` (observed ~2e-6);
routing (top-k expert ids of every token in every sparse layer) and greedy tokens must be identical.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY_VOCAB, _randomize, build_tiny, copy_model
from m2r2.config import ModelConfig
from m2r2.decoding.autoregressive import Autoregressive
from m2r2.decoding.base import GenerationConfig
from m2r2.errors import SettingsError, UnsupportedModelError, WeightsError
from m2r2.loading import load_model
from m2r2.model import MLP, MoE, Transformer

ATOL = 1e-4
COMMON: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    rms_norm_eps=1e-6,
)

#: (id, model_type, config kwargs): every routing convention and layer layout we claim to run.
MOE_VARIANTS: list[tuple[str, str, dict[str, Any]]] = [
    ("mixtral", "mixtral", dict(intermediate_size=48, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)),
    (
        "mixtral-window-k3",
        "mixtral",
        dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=6, num_experts_per_tok=3, sliding_window=8),
    ),
    (
        "qwen2_moe-shared-dense-layer",
        "qwen2_moe",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
        ),
    ),
    (
        "qwen2_moe-norm-step2",
        "qwen2_moe",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=3,
            decoder_sparse_step=2,
            norm_topk_prob=True,
        ),
    ),
    ("olmoe", "olmoe", dict(intermediate_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)),
    (
        "olmoe-norm-clip",
        "olmoe",
        dict(
            intermediate_size=32,
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            clip_qkv=1.5,
        ),
    ),
]


def hf_moe_config(model_type: str, **kw: Any):
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig

    cls = {"mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "olmoe": OlmoeConfig}[model_type]
    return cls(**{**COMMON, **kw})


_BUILT: dict[str, Path] = {}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path):
    """``moe_dir(variant_id)`` -> a saved tiny random HF MoE model (per-expert keys, as save_pretrained writes)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    made: dict[str, Path] = {}

    def factory(name: str) -> Path:
        if name not in made:
            _, model_type, kw = next(v for v in MOE_VARIANTS if v[0] == name)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(hf_moe_config(model_type, **kw))
            _randomize(model, 0)
            out = tmp_path_factory.mktemp(f"tiny-{name}")
            model.save_pretrained(out)
            for f in tiny_tokenizer_dir.iterdir():
                shutil.copy(f, out / f.name)
            made[name] = out
        return made[name]

    return factory


def hf_model(d: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def ours(d: Path) -> Transformer:
    return load_model(d, torch.float32, kernel="plain").model


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def our_routing(model: Transformer, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Top-k ids ``[T, k]`` of each sparse layer, recorded through forward hooks."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        b.mlp.register_forward_pre_hook(
            lambda m, a: seen.__setitem__(m.layer, m.route(a[0].reshape(-1, a[0].shape[-1]))[0])
        )
        for b in model.layers
        if isinstance(b.mlp, MoE)
    ]
    with torch.inference_mode():
        logits = model(ids, model.new_cache(ids.shape[1]), 0)
    for h in hooks:
        h.remove()
    seen[-1] = logits
    return seen


@pytest.mark.parametrize("name", [v[0] for v in MOE_VARIANTS])
def test_logits_and_routing_match_transformers(moe_dir, name: str) -> None:
    d = moe_dir(name)
    ids = tokens(40)
    hf = hf_model(d)
    with torch.inference_mode():
        ref = hf(ids, output_router_logits=True)
    m = ours(d)
    got = our_routing(m, ids)
    sparse = [i for i in range(m.cfg.num_layers) if m.cfg.is_sparse(i)]
    assert ref.logits.abs().max() > 1.0, "degenerate reference logits"
    torch.testing.assert_close(got[-1], ref.logits, atol=ATOL, rtol=0)
    # transformers records router logits of the sparse layers only, in layer order
    assert len(ref.router_logits) == len(sparse) == len(got) - 1
    k = m.cfg.num_experts_per_tok
    for layer, rl in zip(sparse, ref.router_logits, strict=True):
        ref_ids = torch.topk(torch.softmax(rl.float(), -1), k, dim=-1).indices
        assert torch.equal(got[layer], ref_ids), f"layer {layer} routes differently"
        assert len(torch.unique(ref_ids)) > k, "every token picks the same experts: routing test would be vacuous"


@pytest.mark.parametrize("name", ["mixtral-window-k3", "qwen2_moe-shared-dense-layer", "olmoe-norm-clip"])
def test_greedy_generation_matches_transformers(moe_dir, name: str) -> None:
    d = moe_dir(name)
    prompt = tokens(12, seed=1)
    n = 20
    hf = hf_model(d)
    hf.generation_config.eos_token_id = None
    ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False, pad_token_id=0)
    ref = ref[0, prompt.shape[1] :].tolist()
    got = Autoregressive(ours(d), eos_ids=[]).generate(prompt[0].tolist(), GenerationConfig(max_new_tokens=n))
    assert got.tokens == ref
    assert len(set(ref)) >= 3, "degenerate generation"


def test_config_fields_per_architecture(moe_dir) -> None:
    q = ModelConfig.from_json(moe_dir("qwen2_moe-shared-dense-layer") / "config.json")
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size) == (6, 2, 32)
    assert q.router_weights == "softmax_topk" and q.shared_expert_intermediate_size == 48
    assert [q.is_sparse(i) for i in range(3)] == [True, False, True] and q.attention_bias
    q2 = ModelConfig.from_json(moe_dir("qwen2_moe-norm-step2") / "config.json")
    assert q2.sparse_layers == [1, 3] and q2.router_weights == "softmax_topk_renorm"
    mx = ModelConfig.from_json(moe_dir("mixtral") / "config.json")
    assert mx.router_weights == "softmax_topk_renorm" and mx.sparse_layers is None and not mx.qk_norm
    ol = ModelConfig.from_json(moe_dir("olmoe-norm-clip") / "config.json")
    assert ol.qk_norm and ol.clip_qkv == 1.5 and ol.router_weights == "softmax_topk_renorm"
    m = ours(moe_dir("qwen2_moe-shared-dense-layer"))
    assert isinstance(m.layers[1].mlp, MLP) and isinstance(m.layers[0].mlp, MoE) and m.layers[0].mlp.layer == 0
    assert m.layers[2].mlp.layer == 2


def test_dense_model_has_no_experts(tiny_model) -> None:
    m = ours(tiny_model(arch="llama"))
    assert not m.cfg.is_moe and not any(m.cfg.is_sparse(i) for i in range(m.cfg.num_layers))
    assert all(type(b.mlp) is MLP and b.attn.q_norm is None for b in m.layers)
    assert not any("router" in k or "q_norm" in k for k in m.state_dict())


def test_fused_v5_expert_keys_load_identically(moe_dir, tmp_path: Path) -> None:
    """Checkpoints with fused ``experts.gate_up_proj [E, 2F, d]`` / ``down_proj`` load like per-expert ones."""
    src = moe_dir("qwen2_moe-shared-dense-layer")
    d = copy_model(src, tmp_path / "fused")
    sd = load_file(d / "model.safetensors")
    for i in (0, 2):
        p = f"model.layers.{i}.mlp.experts."
        gu = [torch.cat([sd.pop(f"{p}{j}.gate_proj.weight"), sd.pop(f"{p}{j}.up_proj.weight")]) for j in range(6)]
        sd[p + "gate_up_proj"] = torch.stack(gu)
        sd[p + "down_proj"] = torch.stack([sd.pop(f"{p}{j}.down_proj.weight") for j in range(6)])
    save_file(sd, d / "model.safetensors")
    ids = tokens(24)
    a, b = ours(src), ours(d)
    with torch.inference_mode():
        assert torch.equal(a(ids, a.new_cache(24), 0), b(ids, b.new_cache(24), 0))


def test_missing_or_corrupt_expert_weights_are_weights_errors(moe_dir, tmp_path: Path) -> None:
    src = moe_dir("olmoe")
    missing = copy_model(src, tmp_path / "missing")
    sd = load_file(missing / "model.safetensors")
    del sd["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(sd, missing / "model.safetensors")
    with pytest.raises(WeightsError, match=r"experts\.5\.up_proj"):
        ours(missing)
    shape = copy_model(src, tmp_path / "shape")
    sd = load_file(shape / "model.safetensors")
    sd["model.layers.0.mlp.experts.3.down_proj.weight"] = torch.zeros(64, 31)
    save_file(sd, shape / "model.safetensors")
    with pytest.raises((WeightsError, RuntimeError)):
        ours(shape)
    trunc = copy_model(src, tmp_path / "trunc")
    f = trunc / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(WeightsError, match="corrupt or truncated"):
        ours(trunc)


class RecordingSource:
    """An expert source that serves resident copies, optionally withholding some experts."""

    def __init__(self, model: Transformer, withhold: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.weights = {
            b.mlp.layer: (b.mlp.w13.clone(), b.mlp.w2.clone()) for b in model.layers if isinstance(b.mlp, MoE)
        }
        self.withhold = withhold
        self.calls: list[tuple[int, list[int], tuple[int, ...] | None]] = []

    def fetch(self, layer: int, ids: list[int], resid):
        self.calls.append((layer, ids, None if resid is None else tuple(resid.shape)))
        w13, w2 = self.weights[layer]
        return {e: (w13[e], w2[e]) for e in ids if e not in self.withhold}


def test_expert_source_full_and_subset(moe_dir) -> None:
    """A source returning everything gives bit-identical logits; withheld experts' terms are dropped."""
    m = ours(moe_dir("mixtral"))
    ids = tokens(16)
    with torch.inference_mode():
        ref = m(ids, m.new_cache(16), 0)
        src = RecordingSource(m)
        for b in m.layers:
            b.mlp.source = src
            b.mlp.w13.data = torch.empty(0)  # offloaded: resident tensors must not be read
            b.mlp.w2.data = torch.empty(0)
        assert torch.equal(m(ids, m.new_cache(16), 0), ref)
        assert [c[0] for c in src.calls] == [0, 1]
        assert all(c[1] == sorted(set(c[1])) and c[2] == (1, 16, 64) for c in src.calls)

        # subset: the MoE output must equal the sum over the provided experts only
        moe = m.layers[0].mlp
        x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(3))
        route_ids, weights = moe.route(x.reshape(5, 64))
        drop = int(route_ids[0, 0])
        moe.source = RecordingSource(m, withhold={drop})
        moe.source.weights = src.weights
        got = moe(x)
        w13, w2 = src.weights[0]
        want = torch.zeros(5, 64)
        for r in range(5):
            for slot, e in enumerate(route_ids[r].tolist()):
                if e != drop:
                    g, u = (x[0, r] @ w13[e].T).chunk(2)
                    want[r] += weights[r, slot] * (torch.nn.functional.silu(g) * u) @ w2[e].T
        torch.testing.assert_close(got[0], want, atol=1e-5, rtol=0)
        moe.source = src
        assert (moe(x) - got).abs().max() > 1e-3  # the dropped expert mattered
        assert moe.source.calls[-1][2] is None  # called without resid


def test_attention_only_adapters_on_moe_blocks(moe_dir) -> None:
    """Fast-stream adapters on sparse layers adapt q/k/v/o only; the fast stream reaches the expert source."""
    from m2r2.multirate.fast import FastConfig, FastStream

    m = ours(moe_dir("qwen2_moe-shared-dense-layer"))
    fs = FastStream(m, FastConfig.build(3, rate=2, rank=4))
    assert fs.adapters[0].groups == ("qkv", "o")  # layer 0 sparse
    assert fs.adapters[1].groups == ("qkv", "o", "gate_up", "down")  # layer 1 dense (mlp_only_layers)
    assert "gate" not in fs.adapters[0].A and "gate" in fs.adapters[1].A
    fs.freeze()
    src = RecordingSource(m)
    m.layers[0].mlp.source = src
    cache = m.new_cache(32)
    ids = tokens(10)
    with torch.inference_mode():
        m(ids, cache, 0)
        src.calls.clear()
        out = fs.draft_step(ids[:, -1:], cache, 10)
    assert out.logits.shape == (1, 1, TINY_VOCAB)
    assert src.calls and src.calls[0][0] == 0 and src.calls[0][2] == (1, 1, 64)


# --------------------------------------------------------------------------- MoEfication


def _sequences(n: int = 8, length: int = 40) -> list[list[int]]:
    g = random.Random(0)
    return [[g.randrange(TINY_VOCAB) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    return build_tiny(tmp_path_factory.mktemp("dense"), seed=0, tokenizer_dir=tiny_tokenizer_dir, arch="llama")


@pytest.mark.parametrize("shared", [0, 16])
def test_moefy_all_experts_reproduce_dense_and_sparse_differs(dense_dir: Path, tmp_path: Path, shared: int) -> None:
    """Experts (+ the always-on shared expert) partition the FFN's 112 neurons, so top-k = E is the dense model."""
    from m2r2.moe.moefy import MoefySettings, moefy

    s = MoefySettings(experts=4, top_k=4, shared=shared, tokens_per_layer=256, router_steps=50)
    stats = moefy(dense_dir, tmp_path / "moe", _sequences(), s)
    assert stats["oracle_err"] < 1e-5  # all experts = the dense FFN
    fe = (112 - shared) // 4
    cfg = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert cfg["model_type"] == "m2r2_moe" and cfg["router_weights"] == "ones" and cfg["moe_intermediate_size"] == fe
    dense, moe = ours(dense_dir), ours(tmp_path / "moe")
    assert all(isinstance(b.mlp, MoE) and b.mlp.w13.shape == (4, 2 * fe, 64) for b in moe.layers)
    assert all((b.mlp.shared is not None) == bool(shared) and b.mlp.shared_gate is None for b in moe.layers)
    ids = tokens(30)
    with torch.inference_mode():
        ref = dense(ids, dense.new_cache(30), 0)
        torch.testing.assert_close(moe(ids, moe.new_cache(30), 0), ref, atol=ATOL, rtol=0)
        for b in moe.layers:
            b.mlp.top_k = 2
        assert (moe(ids, moe.new_cache(30), 0) - ref).abs().max() > 1e-2
    # experts and shared expert partition the neurons: every dense gate row appears exactly once
    gate = dense.layers[0].mlp.w13.weight[:112]
    mlp = moe.layers[0].mlp
    parts = [mlp.w13[:, :fe].reshape(-1, 64)] + ([mlp.shared.w13.weight[:shared]] if shared else [])
    got = torch.cat(parts)
    assert torch.equal(got[torch.argsort(got[:, 0])], gate[torch.argsort(gate[:, 0])])


def test_moefy_default_is_cached_and_loads_in_engine_and_cli(dense_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from m2r2.cli import main
    from m2r2.engine import Engine
    from m2r2.moe.moefy import moefy_default

    monkeypatch.setenv("M2R2_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": s[:10], "answer_ids": s[10:]}) + "\n" for s in _sequences()))
    path = moefy_default(experts=4, top_k=2, shared=0, data=data, model=dense_dir)
    assert path.parent == tmp_path / "cache" / "models" and "-e4-k2-" in path.name
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert moefy_default(experts=4, top_k=2, shared=0, data=data, model=dense_dir) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert (path / "tokenizer.json").is_file()
    eng = Engine(model=path, dtype="fp32", quiet=True)
    assert eng.model.cfg.num_experts == 4 and eng.model.cfg.num_experts_per_tok == 2
    ids = eng.tokenizer.encode_chat([{"role": "user", "content": "hello there"}])
    assert eng.generate_ids(ids, gen=GenerationConfig(max_new_tokens=4)).new_tokens >= 1
    out = tmp_path / "cli-moe"
    args = ["moefy", "--model", str(dense_dir), "--data", str(data), "--experts", "4", "--top-k", "4"]
    rc = main([*args, "--shared", "16", "--out", str(out)])
    assert rc == 0 and json.loads((out / "config.json").read_text())["shared_expert_intermediate_size"] == 16
    bad = ["moefy", "--model", str(dense_dir), "--data", str(data), "--shared", "0", "--experts", "5"]
    assert main(bad) == 2  # 112 % 5 != 0


def test_moefy_refuses_bad_settings(dense_dir: Path, tmp_path: Path) -> None:
    from m2r2.moe.moefy import MoefySettings, moefy

    with pytest.raises(SettingsError):
        moefy(dense_dir, tmp_path / "x", _sequences(), MoefySettings(experts=4, top_k=5))
    with pytest.raises(SettingsError):
        moefy(dense_dir, tmp_path / "x", _sequences(), MoefySettings(method="nope"))
    with pytest.raises(UnsupportedModelError):
        ModelConfig(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8)


def test_bf16_rows_bit_identical_to_one_token_steps(moe_dir) -> None:
    """A k-row verify pass gives every row the bits of a one-token step (lossless speculative decoding):
    routing and expert sums are per row, and bf16 matmuls here do not depend on the row count."""
    from m2r2.errors import SettingsError as KernelError

    d = moe_dir("qwen2_moe-shared-dense-layer")
    try:
        m = load_model(d, torch.bfloat16, kernel="mkldnn").model
    except KernelError:
        pytest.skip("oneDNN bf16 kernels are not available here")
    ids = tokens(14, seed=5)
    with torch.inference_mode():
        c1 = m.new_cache(32)
        m(ids[:, :8], c1, 0)
        steps = torch.cat([m(ids[:, i : i + 1], c1, i) for i in range(8, 14)], dim=1)
        c2 = m.new_cache(32)
        m(ids[:, :8], c2, 0)
        block = m(ids[:, 8:14], c2, 8)
    assert torch.equal(steps, block)


def test_moefication_reads_conversations_in_the_chat_template(dense_dir: Path, tmp_path: Path) -> None:
    """``{"messages": [...]}`` records (the shipped conversations MoEfication falls back to) become the token ids of
    the whole conversation in the model's chat template, cut at ``max_len``; transformers 5 returns a BatchEncoding
    there, whose iteration gave its keys (``m2r2 bench --suite moe`` failed on a fresh cache before this)."""
    from m2r2.moe.moefy import read_sequences
    from m2r2.tokenizer import ChatTokenizer

    msgs = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi, what can I do?"}]
    data = tmp_path / "conversations.jsonl"
    data.write_text(json.dumps({"messages": msgs, "source": "test"}) + "\n" + json.dumps({"messages": msgs[:1]}) + "\n")
    tok = ChatTokenizer(dense_dir)
    whole, first = tok.encode_conversation(msgs), tok.encode_conversation(msgs[:1])
    assert all(type(i) is int for i in whole) and first == whole[: len(first)] and len(whole) > len(first) > 4
    assert read_sequences(data, 5, 10**6, dense_dir) == [whole, first]
    assert read_sequences(data, 1, 4, dense_dir) == [whole[:4]]
