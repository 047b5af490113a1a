"""Adapter files: ``NAME.safetensors`` (weights) + ``NAME.json`` (config, provenance, checks).

Bound to one base model as every :mod:`m2r2.weightfile` is, so adapters trained for another
model, and truncated or corrupt files, are refused instead of silently producing bad drafts.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from m2r2 import weightfile
from m2r2.errors import WeightsError
from m2r2.loading import file_hash  # noqa: F401 (re-exported: tests checksum adapter files)
from m2r2.model import Transformer
from m2r2.multirate.fast import FastConfig, FastStream
from m2r2.multirate.seeded import KIND as SEEDED
from m2r2.multirate.seeded import SeededConfig, SeededFastStream
from m2r2.weightfile import sidecar  # noqa: F401 (re-exported)

FORMAT = "m2r2-adapters"
VERSION = 1
ADAPTERS = weightfile.Kind(
    FORMAT,
    "adapter",
    "an m2r2 adapter config",
    "`m2r2 train`",
    "no adapters ship for this base model; train some with `m2r2 train` and pass --adapters PATH",
)
#: Optional tensor of an adapter file: the draft head's token ids (see ``FastStream.exit_logits``).
DRAFT_VOCAB = "draft_vocab"
M = TypeVar("M", bound=nn.Module)


def tensor_fingerprint(model: Transformer) -> str:
    """Fingerprint of a model without a weights directory (tests): hash of its float32 tensors."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def weights_of(stream: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A drafter's tensors as a file holds them: its state in ``dtype`` and its draft vocabulary, if any."""
    sd = {k: v.detach().to(dtype).contiguous() for k, v in stream.state_dict().items()}
    if stream.draft_vocab is not None:
        sd[DRAFT_VOCAB] = stream.draft_vocab.to(torch.int32).cpu().contiguous()
    return sd


def with_weights(stream: M, sd: dict[str, torch.Tensor], path: Path) -> M:
    """``stream`` holding the tensors ``sd`` read from ``path`` (draft vocabulary included), if they fit its config."""
    vocab = sd.pop(DRAFT_VOCAB, None)
    expected = stream.state_dict()
    if set(sd) != set(expected) or any(sd[k].shape != expected[k].shape for k in sd):
        raise WeightsError(f"weights {path} do not match their config {stream.cfg.to_dict()}")
    stream.load_state_dict({k: v.float() for k, v in sd.items()})
    if vocab is not None:
        stream.draft_vocab = check_vocab(vocab, stream.base.cfg.vocab_size, path)
    return stream


def save_adapters(
    path: Path,
    stream: FastStream | SeededFastStream,
    fingerprint: str,
    dtype: torch.dtype = torch.bfloat16,
    **info: Any,
) -> Path:
    """Write weights (in ``dtype``) then the JSON sidecar; ``info`` lands in the JSON (data, steps...)."""
    sd = weights_of(stream, dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    return weightfile.save(path, sd, ADAPTERS, fingerprint, VERSION, stream.cfg.to_dict(), dtype=dtype_name, **info)


def read_meta(path: Path) -> dict[str, Any]:
    return weightfile.read_meta(path, ADAPTERS)


def adapter_kind(config: dict[str, Any]) -> str:
    """``seeded`` (:mod:`m2r2.multirate.seeded`) or ``prefix`` (the path fast stream of :mod:`~m2r2.multirate.fast`)."""
    return str(config.get("kind", "prefix"))


def stream_for(model: Transformer, config: dict[str, Any]) -> FastStream | SeededFastStream:
    if adapter_kind(config) == SEEDED:
        return SeededFastStream(model, SeededConfig.from_dict(config))
    return FastStream(model, FastConfig.from_dict(config))


def load_adapters(path: Path, model: Transformer, fingerprint: str) -> FastStream | SeededFastStream:
    """A :class:`FastStream` for ``model`` from an adapter file, after every check passes."""
    sd, meta = weightfile.load(path, ADAPTERS, fingerprint)
    return with_weights(stream_for(model, meta["config"]), sd, path)


def read_draft_vocab(path: Path, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary stored in an adapter file (None if it has none), checksum checked, for *any* base
    model with the file's tokenizer: token ids belong to the tokenizer, not to the weights, so Qwen2.5-Coder-1.5B
    trains on the 0.5B's (built from the 0.5B's own answers) instead of scoring all 151,936 tokens."""
    path = weightfile.weights_path(path)
    sd, _ = weightfile.load(path, ADAPTERS, read_meta(path).get("base_fingerprint", ""))
    return check_vocab(sd[DRAFT_VOCAB], vocab_size, path) if DRAFT_VOCAB in sd else None


def check_vocab(ids: torch.Tensor, vocab_size: int, where: object) -> torch.Tensor:
    """A draft vocabulary as sorted unique int64 ids inside the model's vocabulary, or a WeightsError."""
    ids = ids.long().flatten()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
        raise WeightsError(f"{where}: the draft vocabulary must be distinct token ids in 0..{vocab_size - 1}")
    return ids.sort().values


def bundled_adapters(fingerprint: str, kind: str | None = "prefix") -> Path | None:
    """The adapters shipped in ``m2r2/adapters/`` for the base model with this fingerprint, if any
    (of ``kind``: ``prefix``, the default, or ``seeded``; None = either)."""
    return weightfile.bundled(
        ADAPTERS, fingerprint, lambda meta: kind is None or adapter_kind(meta.get("config", {})) == kind
    )


def load_default(
    model: Transformer, fingerprint: str, path: Path | None = None, kind: str | None = "prefix"
) -> FastStream | SeededFastStream:
    """Adapters from ``path``, else the shipped ones (of ``kind``) for this base model; a clear error if none."""
    path = path or bundled_adapters(fingerprint, kind)
    if path is None:
        raise WeightsError(
            "no adapters ship for this base model; train some with `m2r2 train` and pass --adapters PATH"
        )
    return load_adapters(path, model, fingerprint)
