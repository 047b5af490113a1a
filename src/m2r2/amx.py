"""The C++ kernels (``csrc/``), built once per machine: the ``q4-amx`` / ``q4-avx512`` linears
(:class:`m2r2.kernels.AmxInt4Linear`, :class:`m2r2.kernels.AmxInt8Linear`), the row attention
(:func:`m2r2.model.row_kernel`), the bfloat16 RMSNorm (:class:`m2r2.model.RMSNorm`) and the greedy
argmax (:func:`m2r2.kernels.argmax_rows`).

Why C++: a verify pass runs a handful of rows through every layer, and torch's CPU 4-bit GEMM
de-quantizes the weights again for every 4 rows (v(8) = 1.96 on the bundled model). The kernel in
``csrc/q4_amx.cpp`` unpacks each block's 4-bit integers once per call and lets AMX multiply up to
16 rows at the cost of one (steps and minima are applied to the sums per group of 32 inputs; the
LM head runs the same way on its 8-bit blocks); a CPU with AVX512-BF16 but no AMX (AMD Zen 4/5)
sums the same unpacked integers with dot-product instructions (``q4-avx512``), reading and unpacking
each weight once for all rows. torch's own extension builder compiles them (about 30 s, once) into
``$M2R2_CACHE/ext/``, keyed by the source, the torch version and the compiler flags; a CPU without
AVX512-BF16, or a machine without a C++ compiler, simply does not get the kernels (``auto`` then
picks ``q4``), and says why once. Every CPU with AVX2 gets the ``q4-avx2`` linears too (``csrc_avx2/``,
a separate build with AVX2 flags only, its block loop built again for AVX512-VNNI and for AMX-INT8 tiles and
chosen at run time): integer dot products on inputs rounded to int8 per group of 32, as llama.cpp runs these
GGUF blocks, and a pass's decoder blocks in one C++ call; it is ``auto``'s choice wherever it builds (on a Zen 4
it decoded twice as fast as ``q4-avx512``, on a Sapphire Rapids class Xeon 2.3x as fast as ``q4-amx``: both of
those run a pass's blocks op by op).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from m2r2.machine import cpu_has
from m2r2.paths import cache_root

SOURCES = sorted(Path(__file__).with_name("csrc").glob("*.cpp"))  # one extension: q4_amx.cpp binds them all
HEADERS = sorted(Path(__file__).with_name("csrc").glob("*.h"))  # included by the sources: part of the build key
FLAGS = [
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512dq",
    "-mavx512vl",
    "-mavx512bf16",
    "-mfma",
    "-mamx-tile",
    "-mamx-bf16",
    "-fopenmp",
]
LDFLAGS = ["-fopenmp"]  # at::parallel_for is inline: without OpenMP here it would run on one thread
#: CPU flags every kernel here needs (``/proc/cpuinfo`` names); the AMX products also need :data:`AMX_FLAGS`.
CPU_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16")
AMX_FLAGS = ("amx_bf16", "amx_tile")
AVX2_SOURCES = sorted(Path(__file__).with_name("csrc_avx2").glob("*.cpp"))
AVX2_HEADERS = sorted(Path(__file__).with_name("csrc_avx2").glob("*.h"))
AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")
#: Set to 1 to keep the kernel off (a reference run, or a machine where building misbehaves).
DISABLE_ENV = "M2R2_NO_AMX"


@functools.cache
def extension() -> ModuleType | None:
    """The compiled kernel module, or None where this machine cannot build or run it."""
    if not all(cpu_has(f) for f in CPU_FLAGS):
        return None
    return _build("q4_amx", SOURCES, HEADERS, FLAGS)


@functools.cache
def avx2_extension() -> ModuleType | None:
    """The ``q4-avx2`` kernels (``csrc_avx2/``, built with AVX2 flags only, so that nothing in them needs
    AVX-512), or None where this machine cannot build or run them."""
    if not all(cpu_has(f) for f in AVX2_CPU_FLAGS):
        return None
    return _build("q4_avx2", AVX2_SOURCES, AVX2_HEADERS, AVX2_FLAGS)


@contextmanager
def decoding_bits() -> Iterator[None]:
    """Within: passes of any length get a decoding step's bits, as before a prompt's prefill took AMX-BF16 tiles
    (``csrc_avx2/prefill_amx.cpp``, bits of their own). Why: what trains or measures the fast stream over whole
    sequences in one pass (the training store, ``eval-align``) must see the states decoding steps and verify passes
    give, which seed the stream at inference. Only a build already loaded is switched: without one no pass runs the
    fused blocks, and none is built for this."""
    ext = avx2_extension() if avx2_extension.cache_info().currsize else None
    was = ext.set_bf16_prefill(False) if ext is not None else None
    try:
        yield
    finally:
        if was is not None:
            ext.set_bf16_prefill(was)


def _build(name: str, sources: list[Path], headers: list[Path], flags: list[str]) -> ModuleType | None:
    """Compile ``sources`` into ``$M2R2_CACHE/ext/<name>-<key>`` (once: the key covers the sources, the
    torch version and the flags) and load them; None where that fails or the CPU cannot run them."""
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    text = b"".join(src.read_bytes() for src in [*sources, *headers])
    key = hashlib.sha256(text + torch.__version__.encode() + " ".join(flags + LDFLAGS).encode()).hexdigest()[:12]
    build = cache_root() / "ext" / f"{name}-{key}"
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        _drop_stale_lock(build / "lock")
        if not any(build.glob("*.so")):
            print("m2r2: building the C++ kernels for this CPU (once, ~30 s)", file=sys.stderr)
        module = load(
            name=f"m2r2_{name}_{key}",
            sources=[str(src) for src in sources],
            extra_cflags=list(flags),  # copies: torch's builder appends its own flags to the lists it gets, and
            extra_ldflags=list(LDFLAGS),  # a grown LDFLAGS changed the next build's key (a needless rebuild)
            build_directory=str(build),
        )
    except Exception as e:  # no compiler, missing headers, a failed build: the stock kernels still run
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        warnings.warn(f"the C++ kernels are not available here ({type(e).__name__}: {first[:200]})", stacklevel=3)
        return None
    return module if module.usable() else None


#: a build holds its directory's lock for about a minute; one this old was left by a killed build
STALE_LOCK_S = 600


def _drop_stale_lock(lock: Path) -> None:
    """Remove a build lock left behind by a killed build: torch's builder would wait on it forever (and
    then load a module that was never built)."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        print(f"m2r2: removing a stale C++ build lock ({age / 60:.0f} minutes old): {lock}", file=sys.stderr)
        lock.unlink(missing_ok=True)


def row_helpers() -> ModuleType | None:
    """The module with this CPU's per-row helpers (``rms_norm``, ``argmax_rows``, ``row_attention``,
    ``silu_mul``): the AVX2 build wherever it runs (every AVX-512 CPU too), else the AVX-512 one, else None
    (torch's own ops). Why the AVX2 build first: its fused decoder block (``q4-avx2``, the default kernel
    without AMX) shares these helpers so that a block run as one C++ call gives the per-op path's bits, and
    it applies only where they are the ones every per-op call reaches."""
    return avx2_extension() or extension()


def available() -> bool:
    """Whether the C++ kernels run on this machine (builds them on first call): ``q4-avx512``, the row
    attention, norm and argmax; ``q4-amx`` also needs :func:`amx_available`."""
    return extension() is not None


def amx_cpu() -> bool:
    """Whether the CPU reports AMX at all (no build): ``auto`` asks first, so a CPU without it never builds
    the AVX-512 extension only to learn that."""
    return all(cpu_has(f) for f in AMX_FLAGS)


@functools.cache
def amx_available() -> bool:
    """Whether the ``q4-amx`` kernel's AMX products run here too."""
    if not amx_cpu():  # before building: a CPU without AMX need not build this
        return False
    ext = extension()
    return ext is not None and bool(ext.amx_usable())
