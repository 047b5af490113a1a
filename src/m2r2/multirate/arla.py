"""ARLA: the exit router, a tiny attention over the fast stream's velocity.

Our reading of the paper's router: at fast layer j the query comes from the current state ``f_j``
and attends over the layer-to-layer updates ``delta_i = f_i - f_{i-1}`` (i <= j). A stream whose
updates have settled (small, aligned deltas) has usually reached its answer; the router learns
that pattern and outputs the logit of ``P(top-1 of the exit at j equals the full model's)``.
Inputs are RMS-normalised (the raw residual grows with depth) plus the log relative size of each
update, which carries the "speed" that normalisation removes. It costs ~0.1M parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ARLA(nn.Module):
    def __init__(self, d_model: int, depth: int, dim: int = 64) -> None:
        super().__init__()
        self.dim = dim
        self.q = nn.Linear(d_model, dim)
        self.k = nn.Linear(d_model + 1, dim)
        self.v = nn.Linear(d_model + 1, dim)
        self.layer_emb = nn.Embedding(depth + 1, dim)
        self.out = nn.Sequential(nn.Linear(2 * dim + 1, dim), nn.GELU(), nn.Linear(dim, 1))

    def forward(self, states: list[Tensor], j: int) -> Tensor:
        """Exit logit at fast layer ``j`` from states ``[f_0 .. f_j, ...]`` (each ``[..., d]``)."""
        f = torch.stack([s.float() for s in states[: j + 1]], dim=-2)  # [..., j+1, d]
        delta = f[..., 1:, :] - f[..., :-1, :]
        eps = 1e-6
        speed = (delta.norm(dim=-1) / (f[..., 1:, :].norm(dim=-1) + eps) + eps).log()[..., None]
        dn = F.rms_norm(delta, (delta.shape[-1],), eps=eps)
        emb = self.layer_emb.weight
        keys = self.k(torch.cat([dn, speed], -1)) + emb[1 : j + 1]
        vals = self.v(torch.cat([dn, speed], -1)) + emb[1 : j + 1]
        query = self.q(F.rms_norm(f[..., -1, :], (f.shape[-1],), eps=eps)) + emb[j]
        att = torch.softmax((keys @ query[..., None]).squeeze(-1) / math.sqrt(self.dim), dim=-1)
        ctx = (att[..., None] * vals).sum(-2)
        return self.out(torch.cat([ctx, query, speed[..., -1, :]], -1)).squeeze(-1)
