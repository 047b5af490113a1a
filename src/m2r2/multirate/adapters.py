"""Accelerator adapters: low-rank deltas on the seven projections of a fast layer.

Each projection (q, k, v, o, gate, up, down) gets its own pair ``B @ A`` (rank r, B zero-initialised
so an untrained fast stream equals the slow one). The model's blocks take deltas per *fused*
projection (q|k|v and gate|up), so :meth:`LayerAdapters.lora` presents the pairs in that form:
one matmul by the stacked A's and one by the block-diagonal B's per fused projection, which keeps
the inference cost at two small matmuls per projection group.

On a sparse MoE block only attention (q, k, v, o) is adapted: a delta on the FFN would have to be
either one delta for all experts (changing what the router's choice means) or one per expert (E times
the parameters); and the MoE prefetch use needs the fast stream to run the *same* experts as the slow
stream, so that whatever it routes to is worth loading.
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
#: The fused groups adapted on a sparse MoE block.
ATTENTION_GROUPS = ("qkv", "o")


def projection_shapes(
    cfg: ModelConfig, layer: int | None = None, attention_only: bool = False
) -> dict[str, tuple[int, int]]:
    """``(in, out)`` features of each adapted projection of base block ``layer`` (attention only when sparse
    or asked: a seeded stream's attention-only layers run no FFN)."""
    d, q, kv, m = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, m), "up": (d, m), "down": (m, d)}
    if attention_only or (layer is not None and cfg.is_sparse(layer)):
        return {p: shapes[p] for g in ATTENTION_GROUPS for p in FUSED[g]}
    return shapes


class LayerAdapters(nn.Module):
    """The low-rank pairs of one fast layer; ``A`` random (scaled by 1/sqrt(in)), ``B`` zero.

    ``layer`` is the base block it adapts (needed for MoE models, whose sparse blocks get attention
    adapters only); None means a dense block.
    """

    def __init__(self, cfg: ModelConfig, rank: int, layer: int | None = None, attention_only: bool = False) -> None:
        super().__init__()
        self.rank = rank
        shapes = projection_shapes(cfg, layer, attention_only)
        self.groups = tuple(g for g, names in FUSED.items() if all(n in shapes for n in names))
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
            self._frozen = {g: tuple(t.detach().to(dtype) for t in self.fused(g)) for g in self.groups}  # type: ignore[misc]

    def train(self, mode: bool = True) -> LayerAdapters:
        self._frozen = None
        return super().train(mode)

    def lora(self) -> dict[str, Callable[[Tensor], Tensor]]:
        """Deltas in the fused form ``m2r2.model`` blocks accept (``{"qkv", "o", "gate_up", "down"}``)."""
        out: dict[str, Callable[[Tensor], Tensor]] = {}
        for g in self.groups:
            a, b = self._frozen[g] if self._frozen is not None else self.fused(g)
            out[g] = lambda x, a=a, b=b: F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype))
        return out
