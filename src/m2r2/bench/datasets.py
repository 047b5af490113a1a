"""Prompt sets for the benchmark: the shared eval JSONL files by name, any JSONL path, or ``builtin``.

Schema (one JSON object a line): ``{"id": str, "source": str, "category": str|null, "turns": [str, ...]}``.
The eval sets live outside the package (``shared/data/eval``), so they are looked up from
``$M2R2_SHARED``, then upwards from the working directory and from this file. A small built-in
set ships with the package so the benchmark still runs where that directory is absent.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from m2r2.errors import InputError, SettingsError, UnknownNameError
from m2r2.paths import shared_data

#: The eval sets of ``shared/data/eval`` (see its README).
SHARED_SETS = ("mt_bench", "koala", "self_instruct", "wizardlm", "vicuna", "spec_bench")
BUILTIN = "builtin"
BUILTIN_PATH = Path(__file__).resolve().parent.parent / "data" / "builtin.jsonl"


class DatasetError(InputError):
    """A prompt file is missing, unreadable or does not follow the schema."""


@dataclass(frozen=True)
class Prompt:
    id: str
    source: str
    category: str | None
    turns: tuple[str, ...]


@dataclass(frozen=True)
class Dataset:
    """Prompts plus where they came from (``name`` says so when the builtin set stood in)."""

    name: str
    path: Path
    prompts: list[Prompt]


def shared_eval_dir() -> Path | None:
    """``shared/data/eval`` (see :func:`m2r2.paths.shared_data`)."""
    return shared_data("eval")


def dataset_names() -> list[str]:
    return [*SHARED_SETS, BUILTIN]


def _looks_like_path(spec: str) -> bool:
    return spec.endswith((".jsonl", ".json")) or os.sep in spec or "/" in spec


def read_jsonl(path: Path) -> list[Prompt]:
    """Parse and check a prompt file; errors name the file and line so a bad row is easy to fix."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DatasetError(f"no such prompt file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"cannot read prompt file {path}: {e}") from None
    prompts: list[Prompt] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        turns = obj.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise DatasetError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        if not isinstance(obj.get("id"), str | int):
            raise DatasetError(f"{where}: 'id' must be a string")
        category = obj.get("category")
        prompts.append(
            Prompt(
                id=str(obj["id"]),
                source=str(obj.get("source") or path.stem),
                category=None if category is None else str(category),
                turns=tuple(turns),
            )
        )
    if not prompts:
        raise DatasetError(f"{path} holds no prompts")
    return prompts


def load_dataset(spec: str, limit: int | None = None) -> Dataset:
    """Prompts of a named set or a JSONL file; ``limit`` (None or 0 = all) keeps the first ones.

    A shared set asked for by name falls back to ``builtin`` (with a warning) when no
    ``shared/data/eval`` can be found, so a fresh install can still run the benchmark.
    """
    if limit is not None and limit < 0:
        raise SettingsError(f"limit must be >= 0 (0 = all), got {limit}")
    if spec == BUILTIN:
        name, path = BUILTIN, BUILTIN_PATH
    elif spec in SHARED_SETS:
        root = shared_eval_dir()
        if root is None:
            print(f"m2r2: shared/data/eval not found (set M2R2_SHARED); using {BUILTIN!r} for {spec}", file=sys.stderr)
            name, path = f"{BUILTIN} (for {spec})", BUILTIN_PATH
        else:
            name, path = spec, root / f"{spec}.jsonl"
    elif _looks_like_path(spec) or Path(spec).is_file():
        name, path = Path(spec).stem, Path(spec)
    else:
        raise UnknownNameError(
            f"unknown dataset {spec!r}; choose from {', '.join(dataset_names())}, or give a JSONL path"
        )
    prompts = read_jsonl(path)
    return Dataset(name=name, path=path, prompts=prompts[:limit] if limit else prompts)
