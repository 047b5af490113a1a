"""What the machine offers: device, CPU name, usable cores and the thread count torch runs with.

The lowest layer next to :mod:`m2r2.config`: strategies, the engine and the benchmark all read
these, so they live here rather than in the engine that sits above the strategies.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch

from m2r2.errors import SettingsError


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_name() -> str:
    """The CPU's model name and its widest vector arithmetic (for results files and machine-specific
    caches): a VM often reports only "AMD EPYC", which names a Zen 3 with AVX2 and a Zen 5 with
    AVX512-BF16 alike, and the kernels (and so every timing) differ between the two."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    isa = next((label for flag, label in _VECTOR_ISAS if cpu_has(flag)), "")
    return f"{name} ({isa})" if isa else name


#: ``/proc/cpuinfo`` flags naming the vector arithmetic the kernels use, widest first
_VECTOR_ISAS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def cpu_has(flag: str) -> bool:
    """Whether the CPU reports ``flag`` in ``/proc/cpuinfo`` (e.g. ``amx_bf16``); False where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and flag in line.split() for line in text.splitlines())


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_threads(threads: int | None) -> None:
    """Set torch's CPU threads, capped at the available cores: more threads than cores only
    make them wait on each other (``--threads 999`` ran ~20x slower)."""
    if threads is None:
        return
    if threads < 1:
        raise SettingsError(f"threads must be >= 1, got {threads}")
    cores = available_cores()
    if threads > cores:
        print(f"m2r2: warning: --threads {threads} capped at the {cores} available cores", file=sys.stderr)
        threads = cores
    torch.set_num_threads(threads)
