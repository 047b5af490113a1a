"""Adapter files: ``NAME.safetensors`` (weights) + ``NAME.json`` (config, provenance, checks).

The JSON binds the adapters to one base model by its fingerprint (hash of the base weights) and
records the SHA-256 of the weights file, so adapters trained for another model, and truncated or
corrupt files, are refused with a clear message instead of silently producing bad drafts.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from m2r2.errors import WeightsError
from m2r2.loading import file_hash
from m2r2.model import Transformer
from m2r2.multirate.fast import FastConfig, FastStream
from m2r2.multirate.seeded import KIND as SEEDED
from m2r2.multirate.seeded import SeededConfig, SeededFastStream

FORMAT = "m2r2-adapters"
VERSION = 1
#: Optional tensor of an adapter file: the draft head's token ids (see ``FastStream.exit_logits``).
DRAFT_VOCAB = "draft_vocab"


def tensor_fingerprint(model: Transformer) -> str:
    """Fingerprint of a model without a weights directory (tests): hash of its float32 tensors."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def sidecar(path: Path) -> Path:
    return Path(path).with_suffix(".json")


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_adapters(
    path: Path,
    stream: FastStream | SeededFastStream,
    fingerprint: str,
    dtype: torch.dtype = torch.bfloat16,
    **info: Any,
) -> Path:
    """Write weights (in ``dtype``) then the JSON sidecar; ``info`` lands in the JSON (data, steps...)."""
    path = Path(path).with_suffix(".safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(dtype).contiguous() for k, v in stream.state_dict().items()}
    if stream.draft_vocab is not None:
        sd[DRAFT_VOCAB] = stream.draft_vocab.to(torch.int32).cpu().contiguous()
    _atomic_write(path, lambda p: save_file(sd, str(p), metadata={"format": FORMAT}))
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "config": stream.cfg.to_dict(),
        "base_fingerprint": fingerprint,
        "weights_sha256": file_hash(path),
        "dtype": str(dtype).removeprefix("torch."),
        **info,
    }
    _atomic_write(sidecar(path), lambda p: p.write_text(json.dumps(meta, indent=2) + "\n"))
    return path


def read_meta(path: Path) -> dict[str, Any]:
    side = sidecar(Path(path))
    try:
        meta = json.loads(side.read_text())
    except FileNotFoundError:
        raise WeightsError(f"adapter config {side} is missing (an adapter is NAME.safetensors + NAME.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise WeightsError(f"adapter config {side} is unreadable or corrupt: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise WeightsError(f"{side} is not an m2r2 adapter config")
    return meta


def adapter_kind(config: dict[str, Any]) -> str:
    """``seeded`` (:mod:`m2r2.multirate.seeded`) or ``prefix`` (the path fast stream of :mod:`~m2r2.multirate.fast`)."""
    return str(config.get("kind", "prefix"))


def stream_for(model: Transformer, config: dict[str, Any]) -> FastStream | SeededFastStream:
    if adapter_kind(config) == SEEDED:
        return SeededFastStream(model, SeededConfig.from_dict(config))
    return FastStream(model, FastConfig.from_dict(config))


def load_adapters(path: Path, model: Transformer, fingerprint: str) -> FastStream | SeededFastStream:
    """A :class:`FastStream` for ``model`` from an adapter file, after every check passes."""
    path = Path(path).with_suffix(".safetensors")
    meta = read_meta(path)
    if meta.get("base_fingerprint") != fingerprint:
        raise WeightsError(
            f"adapters {path.name} were trained for another base model (fingerprint "
            f"{meta.get('base_fingerprint')}, this model is {fingerprint}); train adapters for it with `m2r2 train`"
        )
    if not path.is_file():
        raise WeightsError(f"adapter weights {path} are missing")
    if file_hash(path) != meta.get("weights_sha256"):
        raise WeightsError(f"adapter weights {path} are truncated or corrupt (checksum mismatch)")
    stream = stream_for(model, meta["config"])
    try:
        with safe_open(str(path), framework="pt") as fh:
            sd = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise WeightsError(f"adapter weights {path} are corrupt: {e}") from e
    vocab = sd.pop(DRAFT_VOCAB, None)
    expected = stream.state_dict()
    if set(sd) != set(expected) or any(sd[k].shape != expected[k].shape for k in sd):
        raise WeightsError(f"adapter weights {path} do not match their config {meta['config']}")
    stream.load_state_dict({k: v.float() for k, v in sd.items()})
    if vocab is not None:
        stream.draft_vocab = check_vocab(vocab, model.cfg.vocab_size, path)
    return stream


def check_vocab(ids: torch.Tensor, vocab_size: int, where: object) -> torch.Tensor:
    """A draft vocabulary as sorted unique int64 ids inside the model's vocabulary, or a WeightsError."""
    ids = ids.long().flatten()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
        raise WeightsError(f"{where}: the draft vocabulary must be distinct token ids in 0..{vocab_size - 1}")
    return ids.sort().values


def bundled_adapters(fingerprint: str, kind: str | None = None) -> Path | None:
    """The adapters shipped in ``m2r2/adapters/`` for the base model with this fingerprint, if any
    (of ``kind`` when given: ``prefix`` or ``seeded``)."""
    root = Path(str(resources.files("m2r2") / "adapters"))
    for side in sorted(root.glob("*.json")):
        try:
            meta = json.loads(side.read_text())
            ours = meta.get("format") == FORMAT and meta.get("base_fingerprint") == fingerprint
            if ours and (kind is None or adapter_kind(meta.get("config", {})) == kind):
                return side.with_suffix(".safetensors")
        except (OSError, json.JSONDecodeError):
            continue
    return None


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
