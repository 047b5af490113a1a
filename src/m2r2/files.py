"""Files and folders that are whole or absent: written into a temporary sibling, then renamed.

One helper for every writer in m2r2 (model cache, adapters, routers, checkpoints, cost caches,
expert stores), so a crash or Ctrl-C never leaves half a file under the real name, and the
temporaries a killed process leaves behind (named after its pid) can be recognised and removed.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from m2r2.errors import SettingsError

_TMP_PID = re.compile(r"\.tmp-(\d+)")


def atomic_write(path: Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_text(path: Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``target``; on success it replaces ``target`` whole."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target.parent)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{os.getpid()}-"))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(folder: Path) -> None:
    """Remove temporaries in ``folder`` left by processes that no longer run (a killed conversion)."""
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return
    for p in entries:
        m = _TMP_PID.search(p.name)
        if m is None or _alive(int(m.group(1))):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def check_writable(folder: Path, what: str) -> None:
    """Raise a one-line SettingsError unless ``folder`` exists as a writable folder or can be created
    as one (checked before long work, and without creating anything)."""
    path = Path(folder).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise SettingsError(f"{what} {folder} is not a writable folder ({existing} is a file)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SettingsError(f"{what} {folder} is not a writable folder (no write permission on {existing})")
