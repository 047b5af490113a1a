"""Preallocated KV cache with multi-token append and rollback.

One tensor per K and V for all layers, ``[layers, batch, kv_heads, max_len, head_dim]``, allocated
once per generation. Appending k tokens is a slice copy; rolling back after a rejected draft is
just lowering ``length`` (stale entries past it are never read and are overwritten by the next
append), which is what makes speculative decoding cheap.
"""

from __future__ import annotations

import torch

from m2r2.config import ModelConfig
from m2r2.errors import InputError


class KVCache:
    """Keys and values of every verified position, for every layer."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_len: int,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_len <= 0:
            raise InputError(f"KV cache length must be positive, got {max_len}")
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[batch, kv_heads, T, head_dim]``) at positions ``pos .. pos+T-1``."""
        end = pos + k.shape[2]
        if end > self.max_len:
            raise InputError(f"KV cache overflow: position {end} > capacity {self.max_len}")
        self.k[layer, :, :, pos:end] = k
        self.v[layer, :, :, pos:end] = v

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0 .. end-1`` at ``layer`` (views, no copy)."""
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def truncate(self, length: int) -> None:
        """Roll back to ``length`` verified positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def keep(self, slots: list[int], dst: int) -> None:
        """Move the entries at cache ``slots`` (ascending) to ``dst, dst+1, ...``; length = dst + n.

        Tree and lookahead verification write every candidate's K/V side by side; the accepted
        path is then compacted to follow the verified prefix without recomputing anything.
        """
        n = len(slots)
        if slots != list(range(dst, dst + n)):
            idx = torch.tensor(slots, device=self.k.device)
            self.k[:, :, :, dst : dst + n] = self.k.index_select(3, idx)
            self.v[:, :, :, dst : dst + n] = self.v.index_select(3, idx)
        self.length = dst + n
