"""The packed weights of a model's C++ kernels gathered into one buffer on 2 MB pages.

Why: a one-token step streams every 4- and 8-bit weight from memory once (~90 MB on SmolLM2-135M: far more than
the L3 cache), split over ~120 linear layers of 0.2-0.9 MB, each its own allocation on 4 KB pages. A TLB entry on a
2 MB page covers 512 of those, so the stream's page walks all but vanish: on a 2-vCPU Zen 4 a one-token step's layers
took 2.50 ms instead of 2.89 and its 8-bit head 0.67 instead of 0.74, with the same bits (experiments/huge_pages_ab.py,
BENCHMARKS.md, "Twenty-eighth round"). Linux gives an anonymous
buffer huge pages where ``madvise(MADV_HUGEPAGE)`` asks for them (transparent huge pages in ``always`` or
``madvise`` mode, the common defaults); elsewhere the buffer is one allocation on ordinary pages, and the bits are
the same either way (the bytes are copied, not changed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Iterable

import torch
from torch import nn

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
ALIGN = 64  # each tensor starts on a cache line


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def advise_huge_pages(address: int, length: int) -> bool:
    """Ask Linux to back ``[address, address + length)`` (2 MB aligned) with huge pages; whether it accepted."""
    libc = _libc()
    if libc is None or length <= 0:
        return False
    return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0


def _aligned_bytes(nbytes: int) -> tuple[torch.Tensor, int, bool]:
    """An untouched byte buffer with ``nbytes`` from a 2 MB boundary on, that offset, and whether huge pages were
    advised for them (before anything touches them: the first touches then fault in 2 MB pages)."""
    buffer = torch.empty(nbytes + 2 * HUGE_PAGE, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    return buffer, start, advise_huge_pages(buffer.data_ptr() + start, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)


def gather(modules: Iterable[nn.Module], names: tuple[str, ...] = ("qbytes", "scales")) -> bool:
    """Copy the tensors ``names`` of each module (CPU, contiguous), in the order given, into one buffer aligned to
    2 MB and advised onto huge pages, and point the modules at views of it. Give the modules in the order a pass
    reads them: the stream then runs from one end of the buffer to the other. Returns whether huge pages were
    advised. The views keep the buffer alive; the old tensors are freed once nothing else holds them."""
    parts = [(m, n, getattr(m, n)) for m in modules for n in names]
    if not parts:
        return False
    if any(t.device.type != "cpu" or not t.is_contiguous() for _, _, t in parts):
        raise ValueError("gather: contiguous CPU tensors only")
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for _, _, t in parts]
    buffer, offset, huge = _aligned_bytes(sum(sizes))
    for (module, name, t), size in zip(parts, sizes, strict=True):
        nbytes = t.numel() * t.element_size()
        view = buffer[offset : offset + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        setattr(module, name, view)
        offset += size
    return huge
