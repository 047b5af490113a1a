"""Accelerator adapters: low-rank deltas on the seven projections of a fast layer.

Each projection (q, k, v, o, gate, up, down) gets its own pair ``B @ A`` (rank r, B zero-initialised
so an untrained fast stream equals the slow one). The model's blocks take deltas per *fused*
projection (q|k|v and gate|up), so :meth:`LayerAdapters.lora` presents the pairs in that form:
one matmul by the stacked A's and one by the block-diagonal B's per fused projection, which keeps
the inference cost at two small matmuls per projection group.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m2r2.config import ModelConfig

#: Projection names in file order; the fused groups are q|k|v and gate|up.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(in, out)`` features of each projection of a base block."""
    d, q, kv, m = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, m), "up": (d, m), "down": (m, d)}


class LayerAdapters(nn.Module):
    """The low-rank pairs of one fast layer; ``A`` random (scaled by 1/sqrt(in)), ``B`` zero."""

    def __init__(self, cfg: ModelConfig, rank: int) -> None:
        super().__init__()
        self.rank = rank
        shapes = projection_shapes(cfg)
        self.A = nn.ParameterDict(
            {p: nn.Parameter(torch.randn(rank, i) / math.sqrt(i)) for p, (i, _) in shapes.items()}
        )
        self.B = nn.ParameterDict({p: nn.Parameter(torch.zeros(o, rank)) for p, (_, o) in shapes.items()})
        self._frozen: dict[str, tuple[Tensor, Tensor]] | None = None

    def fused(self, group: str) -> tuple[Tensor, Tensor]:
        """Stacked A (``[n*r, in]``) and block-diagonal B (``[sum out, n*r]``) of a fused group."""
        names = FUSED[group]
        if len(names) == 1:
            return self.A[names[0]], self.B[names[0]]
        return torch.cat([self.A[n] for n in names]), torch.block_diag(*(self.B[n] for n in names))

    def freeze(self, dtype: torch.dtype) -> None:
        """Precompute the fused weights in ``dtype`` for inference (again after changing parameters)."""
        with torch.no_grad():
            self._frozen = {g: tuple(t.detach().to(dtype) for t in self.fused(g)) for g in FUSED}  # type: ignore[misc]

    def train(self, mode: bool = True) -> LayerAdapters:
        self._frozen = None
        return super().train(mode)

    def lora(self) -> dict[str, Callable[[Tensor], Tensor]]:
        """Deltas in the fused form ``m2r2.model`` blocks accept (``{"qkv", "o", "gate_up", "down"}``)."""
        out: dict[str, Callable[[Tensor], Tensor]] = {}
        for g in FUSED:
            a, b = self._frozen[g] if self._frozen is not None else self.fused(g)
            out[g] = lambda x, a=a, b=b: F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype))
        return out
