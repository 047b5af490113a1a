"""Training checkpoints: written atomically, refused when they do not belong to the run resuming them.

A checkpoint holds the trainable state (adapters + ARLA), the optimiser state and the step. Data
order, block lengths and router subsamples are pure functions of ``(seed, step)``, so nothing else
is needed for a resumed run to continue bit-for-bit.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from m2r2.errors import SettingsError, WeightsError
from m2r2.files import atomic_write

#: Settings that change the training trajectory; a resume must match them exactly.
TRAJECTORY_KEYS = (
    "seed",
    "batch",
    "max_len",
    "lr",
    "warmup",
    "gamma_max",
    "align_w",
    "kl_w",
    "arla_w",
    "arla_frac",
    "copy_w",
)
#: what a key added later meant in checkpoints written before it existed
TRAJECTORY_DEFAULTS = {"copy_w": 1.0}


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """``torch.save`` into a temporary sibling, then rename: a crash never leaves half a checkpoint."""
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_checkpoint(
    path: Path, fingerprint: str, fast_cfg: dict[str, Any], settings: dict[str, Any], data_hash: str | None = None
) -> dict[str, Any]:
    """Read ``path`` and check it was written for this base model, fast stream and trajectory."""
    if not path.is_file():
        raise SettingsError(f"--resume: no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        raise WeightsError(f"checkpoint {path} is truncated or corrupt: {e}") from e
    if not isinstance(state, dict) or "stream" not in state or "step" not in state:
        raise WeightsError(f"{path} is not an m2r2 training checkpoint")
    if state.get("fingerprint") != fingerprint:
        raise SettingsError(f"checkpoint {path} was trained on another base model; refusing to resume")
    if state.get("fast_config") != fast_cfg:
        raise SettingsError(
            f"checkpoint {path} has fast-stream config {state.get('fast_config')}, this run asks for {fast_cfg}"
        )
    if data_hash is not None and state.get("data_hash") not in (None, data_hash):
        raise SettingsError(f"checkpoint {path} was trained on other data; resume with the same --data and --max-len")
    theirs = state.get("settings", {})
    was = {k: theirs.get(k, TRAJECTORY_DEFAULTS.get(k)) for k in TRAJECTORY_KEYS}
    diff = [k for k in TRAJECTORY_KEYS if was[k] != settings.get(k, TRAJECTORY_DEFAULTS.get(k))]
    if diff:
        raise SettingsError(
            f"checkpoint {path} was written with different settings ({', '.join(diff)}); resume with the same ones"
        )
    return state
