"""The packed weights of a model's C++ kernels gathered into one buffer on 2 MB pages.

Why: a one-token step streams every 4- and 8-bit weight from memory once (~90 MB on SmolLM2-135M: far more than
the L3 cache), split over ~120 linear layers of 0.2-0.9 MB, each its own allocation on 4 KB pages. A TLB entry on a
2 MB page covers 512 of those, so the stream's page walks all but vanish: on a 2-vCPU Zen 4 a one-token step's layers
took 2.50 ms instead of 2.89 and its 8-bit head 0.67 instead of 0.74, with the same bits (experiments/huge_pages_ab.py,
BENCHMARKS.md, "Twenty-eighth round"). Linux gives an anonymous buffer huge pages where ``madvise(MADV_HUGEPAGE)``
asks for them (transparent huge pages in ``always`` or ``madvise`` mode, the common defaults); elsewhere the buffer
is one allocation on ordinary pages, and the bits are the same either way (the bytes are copied, not changed).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line


def _aligned_bytes(nbytes: int) -> tuple[torch.Tensor, int, bool]:
    """A byte buffer with ``nbytes`` from a 2 MB boundary on, that offset, and whether huge pages were advised for
    them. The buffer is its own anonymous mapping, so no page of it has been touched yet (memory from the heap may
    have been, and a page already faulted in stays 4 KB): the copies then fault in 2 MB pages. The tensor keeps
    the mapping alive."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # Windows: one allocation on ordinary pages
        return torch.empty(nbytes, dtype=torch.uint8), 0, False
    # private: a shared anonymous mapping is shmem, whose huge pages follow another switch (shmem_enabled)
    area = mmap.mmap(-1, nbytes + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(area, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    try:
        area.madvise(mmap.MADV_HUGEPAGE, start, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
    except (AttributeError, OSError):  # not Linux, or transparent huge pages off
        return buffer, start, False
    return buffer, start, True


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
