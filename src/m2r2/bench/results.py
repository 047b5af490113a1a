"""What every benchmark suite shares: its settings, the stamp on its results, and how they are saved.

The harness and each suite import this module (never each other's runners), so the imports
run one way: ``cli -> harness -> suites -> results``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from m2r2.files import atomic_text, check_writable
from m2r2.machine import cpu_name

if TYPE_CHECKING:
    from m2r2.engine import Engine


@dataclass
class BenchSettings:
    dataset: str | None  # None: the suite's own datasets (``mt_bench`` for a plain run)
    methods: list[str]
    limit: int | None
    max_new_tokens: int
    out_dir: Path
    warmup: int = 1
    suite: str | None = None
    # --suite moe only (None = the suite's defaults): bandwidth labels, cache fractions, policies, adapters
    bandwidths: list[str] | None = None
    cache_fractions: list[float] | None = None
    policies: list[str] | None = None
    adapters: Path | None = None
    full: bool = False  # --suite dynamic: the full sweep instead of the default few-minute one
    fresh_turns: bool = False  # prefill every turn's whole history (no cache carried between turns)
    command: str | None = None  # what reproduces the run (the CLI passes its argv)
    #: per-method options (``--option METHOD:KEY=VALUE``), e.g. the adapters of an equal-budget run
    options: dict[str, dict[str, Any]] = field(default_factory=dict)


def git_commit() -> str:
    """The checked-out commit of the m2r2 source (``-dirty`` with uncommitted changes), or ``unknown``."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10).stdout

    try:
        commit = git("rev-parse", "--short=12", "HEAD").strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit + ("-dirty" if dirty else "")) if commit else "unknown"


#: environment switches that choose the code paths a run times (the same tokens, other timings): a run stamps those
#: set into its command, so that it reruns on the same paths
PATH_SWITCHES = ("M2R2_NO_GREEDY_PASS", "M2R2_NO_FUSED", "M2R2_NO_AMX")


def stamp(command: str | None = None) -> dict[str, str]:
    """The commit a run measured and the command that reruns it (``command``: the CLI's argv; by default this
    process's), with the path switches set before it."""
    command = command or shlex.join(["m2r2", *sys.argv[1:]])
    switches = [f"{k}={shlex.quote(os.environ[k])}" for k in PATH_SWITCHES if os.environ.get(k)]
    return {"commit": git_commit(), "command": " ".join([*switches, command])}


def environment(engine: Engine, settings: BenchSettings | None = None) -> dict[str, Any]:
    """What a reader needs to judge timings and rerun them (hardware, precision, threads, versions,
    commit, command); in every results.json."""
    import transformers

    return {
        "dtype": engine.dtype_name,
        "kernel": engine.kernel,
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "cpu": cpu_name(),
        "device": str(engine.device),
        "model": engine.model_dir.name,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **stamp(settings.command if settings else None),
    }


def check_out_dir(settings: BenchSettings) -> Path:
    """The output folder, checked writable before any work (a bad --out used to fail after the run)."""
    out = Path(settings.out_dir)
    check_writable(out, "--out")
    return out


def save_results(out: Path, results: dict[str, Any], complete: bool) -> None:
    """``results.json`` in ``out``, atomically; saved as a suite goes (``complete`` false) so an
    interrupted run keeps what it measured."""
    atomic_text(Path(out) / "results.json", json.dumps({**results, "complete": complete}, indent=1, ensure_ascii=False))
