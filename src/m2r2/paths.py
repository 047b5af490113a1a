"""Where m2r2 finds the data the project ships and keeps what its commands produce (one default each)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from m2r2.errors import InputError, SettingsError

#: Distilled answers: written by ``m2r2 distill-data``, read by ``train``, ``train-mod``, ``draft-vocab``, ``moefy``.
DEFAULT_ANSWERS = Path("runs/distill/answers.jsonl")
#: Medusa heads: written by ``m2r2 train-medusa``, read by method ``medusa`` when none ship for the model.
DEFAULT_MEDUSA = Path("runs/medusa/heads.safetensors")
#: EAGLE head: written by ``m2r2 train-eagle``, read by method ``eagle`` when none ships for the model.
DEFAULT_EAGLE = Path("runs/eagle/eagle.safetensors")
DEFAULT_DRAFT = Path("runs/draft/draft.safetensors")
#: Training prompts shared by the project (relative to the repository root).
DEFAULT_TRAIN_PROMPTS = Path("../shared/data/train/prompts.jsonl")


def cache_root() -> Path:
    """Where converted models, measured costs and compiled kernels live: ``$M2R2_CACHE`` or ``~/.cache/m2r2``."""
    return Path(os.environ.get("M2R2_CACHE") or Path.home() / ".cache" / "m2r2")


def shared_data(sub: str) -> Path | None:
    """``shared/data/<sub>``: from ``$M2R2_SHARED`` (the shared dir or the folder itself), else the
    first one found walking up from the working directory, then from the installed package."""
    env = os.environ.get("M2R2_SHARED")
    if env:
        for cand in (Path(env) / "data" / sub, Path(env) / sub, Path(env)):
            if cand.is_dir() and any(cand.glob("*.jsonl")):
                return cand
    for start in (Path.cwd().resolve(), Path(__file__).resolve().parent):
        for d in (start, *start.parents):
            cand = d / "shared" / "data" / sub
            if cand.is_dir():
                return cand
    return None


def shipped_conversations() -> Path | None:
    """The project's training conversations (``shared/data/train/conversations.jsonl``), if reachable."""
    train = shared_data("train")
    path = train / "conversations.jsonl" if train else None
    return path if path is not None and path.is_file() else None


def refuse_eval(path: Path) -> None:
    """Never let eval prompts into training data (the eval directory is refused by name)."""
    if "eval" in Path(path).resolve().parts:
        raise SettingsError(f"{path} is an eval set; training data must come from the train split")


def load_distilled(path: Path) -> list[dict[str, Any]]:
    """Records written by :func:`distill` (skipping a half-written last line)."""
    refuse_eval(path)
    recs = []
    for line in Path(path).read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if not recs:
        raise InputError(f"{path} holds no distilled answers; run `m2r2 distill-data` first")
    return recs
