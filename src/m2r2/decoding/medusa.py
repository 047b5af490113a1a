"""Method ``medusa``: Medusa-1 heads (Cai et al., 2024) on the frozen base model, drafting token trees
that the verifier of ``m2r2`` checks (:mod:`m2r2.decoding.tree`): a trained peer on M2R2's footing.

Head ``i`` (1..n) reads the final slow state ``h = h_N(t)`` of the last verified position and predicts
the token at ``t + i + 1`` (the base head predicts ``t + 1``): ``W . Norm(h + SiLU(A_i h + b_i))``, one
residual SiLU block per head, then the base model's final norm and LM head over the draft vocabulary
the seeded fast stream scores (:class:`~m2r2.multirate.seeded.DraftHead`). Sharing the frozen head
keeps a heads file at ``n d^2`` weights (2.7 MB for SmolLM2) instead of Medusa's n trainable copies
of a 49k-word head. ``A_i`` and ``b_i`` start at zero, so an untrained head is the base head.

Heads do not depend on the drafted path: one batched pass over all heads at the start of a round
gives every level's distribution, so a tree level costs next to nothing and the cost model charges
that pass once per round (:class:`~m2r2.decoding.tree.TreeCosts`). Heads are trained from a
training store by ``m2r2 train-medusa`` (:mod:`m2r2.training.seeded_train`) and kept as
``NAME.safetensors`` + ``NAME.json`` bound to the base model's fingerprint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m2r2 import weightfile
from m2r2.decoding import register
from m2r2.decoding.lookup import DEFAULT_LOOKUP
from m2r2.decoding.tree import Tree, TreeSpeculative, build_tree_speculative
from m2r2.errors import SettingsError, WeightsError
from m2r2.model import Transformer
from m2r2.multirate.io import weights_of, with_weights
from m2r2.multirate.seeded import DraftHead
from m2r2.paths import DEFAULT_MEDUSA

if TYPE_CHECKING:
    from m2r2.cache import KVCache
    from m2r2.decoding.base import Loaded

KIND = "medusa"
FORMAT = "m2r2-medusa-heads"
VERSION = 1
HEADS = weightfile.Kind(
    FORMAT,
    "Medusa head",
    "an m2r2 Medusa heads config",
    "`m2r2 train-medusa`",
    f"no Medusa heads for this base model: train them with `m2r2 train-medusa` (it writes {DEFAULT_MEDUSA}, "
    "read from there by default) or pass --option adapters=PATH",
)


@dataclass
class MedusaConfig:
    hidden_size: int
    heads: int = 4
    kind: str = KIND

    @classmethod
    def build(cls, hidden_size: int, heads: int = 4) -> MedusaConfig:
        if heads < 1:
            raise SettingsError(f"Medusa needs at least one head, got {heads}")
        return cls(hidden_size, heads)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MedusaConfig:
        try:
            return cls.build(int(d["hidden_size"]), int(d["heads"]))
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsError(f"bad Medusa heads config {d}: {e}") from e


class MedusaHeads(DraftHead, nn.Module):
    """The residual blocks of n Medusa heads for a frozen base model held by reference."""

    def __init__(self, base: Transformer, cfg: MedusaConfig) -> None:
        super().__init__()
        if cfg.hidden_size != base.cfg.hidden_size:
            raise SettingsError(f"Medusa heads of width {cfg.hidden_size}, the model's is {base.cfg.hidden_size}")
        self.cfg = cfg
        object.__setattr__(self, "base", base)
        self.blocks = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(cfg.heads))
        with torch.no_grad():
            for blk in self.blocks:
                blk.weight.zero_()
                blk.bias.zero_()
        self.draft_vocab: Tensor | None = None
        self.sub_head: nn.Module | None = None

    base: Transformer

    def state(self, h: Tensor, i: int) -> Tensor:
        """Head ``i``'s input to the draft head, ``h + SiLU(A_i h + b_i)`` (float32 math, ``h``'s dtype)."""
        x = h.float()
        return (x + F.silu(self.blocks[i](x))).to(h.dtype)

    def freeze(self) -> MedusaHeads:
        """Eval, no grad, and the draft head over the draft vocabulary with the base head's kernel."""
        self.eval().requires_grad_(False)
        self.build_draft_head()
        return self

    def train(self, mode: bool = True) -> MedusaHeads:
        if mode:
            self.sub_head = None
        return super().train(mode)


class MedusaDrafter:
    """Tree levels from Medusa heads: every head scored at a round's start in one pass over the draft
    vocabulary; the level under depth ``d`` reads head ``d + 1``, the same for every open node."""

    layers_per_level = 0

    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = self.module = heads
        self.max_levels = heads.cfg.heads

    def start(self, h_last: Tensor, cache: KVCache, verified: int) -> None:
        h = h_last.reshape(1, -1)
        self.sub = self.heads.vocab_logits(torch.cat([self.heads.state(h, i) for i in range(self.max_levels)]))

    def top(self, tree: Tree, frontier: list[int], k: int) -> tuple[Tensor, Tensor]:
        d = tree.depths[frontier[0]]
        return self.heads.top_of(self.sub[d : d + 1], k)

    def logits(self, tree: Tree, frontier: list[int]) -> Tensor:
        d = tree.depths[frontier[0]]
        return self.heads.widen(self.sub[d : d + 1])


def save_heads(
    path: Path, heads: MedusaHeads, fingerprint: str, dtype: torch.dtype = torch.bfloat16, **info: Any
) -> Path:
    """Write the heads (in ``dtype``) then the JSON sidecar; ``info`` lands in the JSON (training, validation)."""
    sd, dtype_name = weights_of(heads, dtype), str(dtype).removeprefix("torch.")
    return weightfile.save(path, sd, HEADS, fingerprint, VERSION, heads.cfg.to_dict(), dtype=dtype_name, **info)


def load_heads(path: Path, model: Transformer, fingerprint: str) -> MedusaHeads:
    """Medusa heads for ``model`` from a heads file, after the fingerprint and checksum checks."""
    sd, meta = weightfile.load(path, HEADS, fingerprint)
    return with_weights(MedusaHeads(model, MedusaConfig.from_dict(meta["config"])), sd, path)


def is_heads_file(path: Path) -> bool:
    """Whether ``path`` names Medusa heads (by its sidecar; any other file is someone else's to judge)."""
    return weightfile.is_kind(path, HEADS)


def heads_path(fingerprint: str, path: Path | None = None) -> Path:
    """``path``, else the heads shipped for this base model, else what ``m2r2 train-medusa`` writes by
    default; a one-line error when there are none."""
    return weightfile.given_or_shipped(path, HEADS, fingerprint, DEFAULT_MEDUSA)


@register("medusa", "baseline: Medusa-1 heads on the frozen model draft token trees, verified as m2r2's (lossless)")
def _medusa(
    engine: Loaded,
    adapters: str | None = None,
    adaptive: bool = True,
    cost_cache: bool = True,
    max_nodes: int = 8,
    max_depth: int = 5,
    width: int = 2,
    branch: int = 2,
    lookup: int = DEFAULT_LOOKUP,
    answers: str | None = None,
) -> TreeSpeculative:
    """The same tree verifier and settings as ``m2r2``; only the drafter differs."""
    path = heads_path(engine.fingerprint, Path(adapters) if adapters else None)
    heads = load_heads(path, engine.model, engine.fingerprint).to(engine.model.device).freeze()
    tree = (max_nodes, max_depth, width, branch, lookup)
    return build_tree_speculative("medusa", engine, MedusaDrafter(heads), adaptive, cost_cache, *tree, answers=answers)
