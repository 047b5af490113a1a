"""Small weight files bound to one base model: ``NAME.safetensors`` + ``NAME.json`` (the sidecar).

The fast-stream adapters and the Mixture-of-Depths routers are both stored this way. The JSON
holds the config, the base model's fingerprint (hash of its weights) and the SHA-256 of the
weights file, so files trained for another model, and truncated or corrupt ones, are refused
with a one-line message instead of silently giving bad drafts or routes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from m2r2.errors import WeightsError
from m2r2.files import atomic_text, atomic_write
from m2r2.loading import file_hash


@dataclass(frozen=True)
class Kind:
    """One kind of bound weight file: its format tag, how messages name it, and what trains it."""

    format: str  # the sidecar's "format" (and the safetensors metadata's)
    name: str  # "adapter", "router"
    title: str  # "an m2r2 adapter config"
    trains: str  # the command that makes files for another model
    none_shipped: str  # the error when none ship for a model and no path is given


def weights_path(path: Path | str) -> Path:
    """The ``.safetensors`` file a user's ``NAME``, ``NAME.safetensors`` or ``NAME.json`` names.

    Why not ``with_suffix``: a model's name carries dots (``qwen2.5-coder-0.5b-answers``), which it would
    cut at the last one (writing ``qwen2.5-coder-0.safetensors``)."""
    p = Path(path)
    if p.suffix == ".safetensors":
        return p
    return p.with_name((p.name[: -len(".json")] if p.suffix == ".json" else p.name) + ".safetensors")


def sidecar(path: Path) -> Path:
    return weights_path(path).with_suffix(".json")


def save(
    path: Path, tensors: dict[str, Tensor], kind: Kind, fingerprint: str, version: int, config: dict, **info: Any
) -> Path:
    """Write the weights, then the sidecar (config, fingerprint, checksum, then ``info``), each atomically."""
    path = weights_path(path)
    atomic_write(path, lambda p: save_file(tensors, str(p), metadata={"format": kind.format}))
    meta = {"format": kind.format, "version": version, "config": config, "base_fingerprint": fingerprint}
    meta |= {"weights_sha256": file_hash(path), **info}
    atomic_text(sidecar(path), json.dumps(meta, indent=2) + "\n")
    return path


def read_meta(path: Path, kind: Kind) -> dict[str, Any]:
    side = sidecar(Path(path))
    try:
        meta = json.loads(side.read_text())
    except FileNotFoundError:
        raise WeightsError(
            f"{kind.name} config {side} is missing (an {kind.name} file is NAME.safetensors + NAME.json)"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise WeightsError(f"{kind.name} config {side} is unreadable or corrupt: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != kind.format:
        raise WeightsError(f"{side} is not {kind.title}")
    return meta


def is_kind(path: Path, kind: Kind) -> bool:
    """Whether ``path`` is a file of ``kind`` (by its sidecar; any other file is someone else's to judge)."""
    try:
        read_meta(path, kind)
    except WeightsError:
        return False
    return True


def load(path: Path, kind: Kind, fingerprint: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The tensors and sidecar of a bound file, after the fingerprint and checksum checks."""
    path = weights_path(path)
    meta = read_meta(path, kind)
    if meta.get("base_fingerprint") != fingerprint:
        raise WeightsError(
            f"{kind.name}s {path.name} were trained for another base model (fingerprint "
            f"{meta.get('base_fingerprint')}, this model is {fingerprint}); "
            f"train {kind.name}s for it with {kind.trains}"
        )
    if not path.is_file():
        raise WeightsError(f"{kind.name} weights {path} are missing")
    if file_hash(path) != meta.get("weights_sha256"):
        raise WeightsError(f"{kind.name} weights {path} are truncated or corrupt (checksum mismatch)")
    try:
        with safe_open(str(path), framework="pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise WeightsError(f"{kind.name} weights {path} are corrupt: {e}") from e
    return tensors, meta


def bundled(kind: Kind, fingerprint: str, accept: Callable[[dict[str, Any]], bool] | None = None) -> Path | None:
    """The file of this kind shipped in ``m2r2/adapters/`` for the base model with this fingerprint, if any
    (and whose JSON ``accept`` takes, when given)."""
    root = Path(str(resources.files("m2r2") / "adapters"))
    for side in sorted(root.glob("*.json")):
        try:
            meta = json.loads(side.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        ours = meta.get("format") == kind.format and meta.get("base_fingerprint") == fingerprint
        if ours and (accept is None or accept(meta)):
            return side.with_suffix(".safetensors")
    return None


def given_or_shipped(path: Path | None, kind: Kind, fingerprint: str, trained: Path | None = None) -> Path:
    """``path``, else the file shipped for this base model, else ``trained`` (where the training command
    writes by default, so ``m2r2 bench`` finds a fresh run) if it exists; a one-line error if none is."""
    path = path or bundled(kind, fingerprint) or (trained if trained is not None and trained.is_file() else None)
    if path is None:
        raise WeightsError(kind.none_shipped)
    return path
