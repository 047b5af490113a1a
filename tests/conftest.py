"""Shared fixtures: tiny random HF models of every supported architecture, and the real bundled model.

Tiny models are built from transformers configs with random weights (nothing is downloaded) and
saved with ``save_pretrained``, so every test goes through the same loading path as a real
checkpoint. Each carries a small byte-level BPE tokenizer with a ChatML template, so ``Engine`` and
the CLI can run on them too.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
EVAL_DIR = REPO_ROOT.parent / "shared" / "data" / "eval"

#: Tokens the tiny tokenizer reserves; ``<|im_end|>`` is its EOS.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 300
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!",
    "How can I improve my time management skills? Write a short poem about the sea.",
    "Explain the difference between Python and JavaScript in three sentences.",
    "user assistant system: one two three four five six seven eight nine ten",
]

ARCHS = ("llama", "mistral", "qwen2")


def _build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_TEXT, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    hf.chat_template = CHATML
    hf.save_pretrained(out_dir)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) logits (HF's init gives near-zero logits, which makes parity checks vacuous)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def hf_config(
    arch: str = "llama",
    rope: dict[str, Any] | None = None,
    tie: bool = False,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    max_position_embeddings: int = 256,
    vocab_size: int = TINY_VOCAB,
    hidden_size: int = 64,
    layers: int = 2,
    **extra: Any,
):
    """A transformers config for a tiny model of ``arch`` (llama, mistral or qwen2)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size - 16,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rms_norm_eps=1e-6,
    )
    if head_dim is not None:
        common["head_dim"] = head_dim
    if rope is not None:
        common["rope_scaling"] = dict(rope)
    common.update(extra)
    if arch == "llama":
        if sliding_window is not None:
            raise ValueError("llama has no sliding window")
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(sliding_window=sliding_window, **common)
    if arch == "qwen2":
        if sliding_window is not None:
            raise ValueError("use mistral for sliding-window tests")
        return Qwen2Config(**common)
    raise ValueError(f"unknown arch {arch!r}")


def build_tiny(out_dir: Path, seed: int = 0, tokenizer_dir: Path | None = None, **kwargs: Any) -> Path:
    """Write a tiny random HF model (config.json + model.safetensors [+ tokenizer]) to ``out_dir``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg = hf_config(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    _randomize(model, seed)
    model.save_pretrained(out_dir)
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, out_dir / f.name)
    return out_dir


TinyFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny-tokenizer")
    _build_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> TinyFactory:
    """``tiny_model(arch="llama", rope=None, tie=False, num_heads=4, num_kv_heads=2, head_dim=None,
    sliding_window=None, max_position_embeddings=256, seed=0, ...)`` -> model directory.

    Directories are cached per argument set for the session: treat them as read-only (copy one
    with :func:`copy_model` before damaging it).
    """
    made: dict[str, Path] = {}

    def factory(seed: int = 0, **kwargs: Any) -> Path:
        key = json.dumps({"seed": seed, **kwargs}, sort_keys=True)
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{kwargs.get('arch', 'llama')}")
            made[key] = build_tiny(out, seed=seed, tokenizer_dir=tiny_tokenizer_dir, **kwargs)
        return made[key]

    return factory


def skip_unless_kernel(model: torch.nn.Module, kernel: str) -> None:
    """Skip the test where ``kernel`` cannot run ``model`` on this machine (no oneDNN bf16, no 4-bit op,
    no AMX (q4-amx), AVX512-BF16 (q4-avx512), AVX2 (q4-avx2) or C++ compiler, or layer widths the kernel
    does not take)."""
    from m2r2.kernels import mkldnn_usable, q4_amx_usable, q4_avx2_usable, q4_avx512_usable, q4_usable

    usable = {
        "plain": lambda m: True,
        "mkldnn": mkldnn_usable,
        "q4": q4_usable,
        "q4-amx": q4_amx_usable,
        "q4-avx512": q4_avx512_usable,
        "q4-avx2": q4_avx2_usable,
    }[kernel]
    if not usable(model):
        pytest.skip(f"the {kernel} kernel cannot run this model here")


def copy_model(src: Path, dst: Path) -> Path:
    """A private copy of a model directory that a test may damage."""
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, **changes: Any) -> None:
    """Rewrite keys of ``config.json`` in place (``None`` deletes the key)."""
    path = model_dir / "config.json"
    d = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d))


# --------------------------------------------------------------------------- real model


@pytest.fixture(scope="session")
def real_engine():
    """The bundled SmolLM2-135M-Instruct in fp32 reference mode (skips if it is not installed)."""
    from m2r2.engine import Engine
    from m2r2.errors import WeightsError

    try:
        return Engine(dtype="fp32", quiet=True)
    except WeightsError as e:  # the bundled package is missing
        pytest.skip(f"bundled model unavailable: {e}")


@pytest.fixture(scope="session")
def real_engine_bf16():
    """The bundled model in the default precision (bf16, default kernels: q4 on CPU); skips if not installed."""
    from m2r2.engine import Engine
    from m2r2.errors import WeightsError

    try:
        return Engine(dtype="bf16", quiet=True)
    except WeightsError as e:
        pytest.skip(f"bundled model unavailable: {e}")


@pytest.fixture(scope="session")
def eval_dir() -> Path:
    """``../shared/data/eval`` beside the checkout (skips when a fresh clone has none)."""
    if not EVAL_DIR.is_dir() or not any(EVAL_DIR.glob("*.jsonl")):
        pytest.skip(f"shared eval data not found at {EVAL_DIR}")
    return EVAL_DIR


def read_prompts(eval_dir: Path, per_dataset: int, spread: bool = False) -> list[tuple[str, str]]:
    """``(dataset/id, first turn)`` for ``per_dataset`` prompts of each eval file.

    The first ones, or with ``spread`` ones evenly spaced through the file (covering its categories).
    """
    out: list[tuple[str, str]] = []
    for f in sorted(eval_dir.glob("*.jsonl")):
        with open(f) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        step = max(1, len(rows) // per_dataset) if spread else 1
        for row in rows[::step][:per_dataset]:
            out.append((f"{f.stem}/{row['id']}", row["turns"][0]))
    return out


def pytest_configure(config: pytest.Config) -> None:
    # On a small shared machine, several torch threads per process oversubscribe the cores and
    # every matmul waits on spinning OpenMP workers (measured: 35x slower matvecs at 2 threads
    # next to other busy processes). One thread is robust; M2R2_TEST_THREADS overrides it.
    torch.set_num_threads(int(os.environ.get("M2R2_TEST_THREADS", "1")))
