"""The fast residual stream over the shared KV cache.

Fast layer j (1-based) reuses base layer ``path[j-1]`` plus its accelerator adapters and is trained
so that its state ``f_j`` matches the slow state ``h_{min(N, R*j)}``. It keeps no cache of its own:
its queries attend to the *slow* keys/values of the base layer it uses for verified positions, and
to its own fast keys/values only inside the current (draft) block. :func:`shared_attention` is the
one attention function for both uses: inference passes the slow cache up to the verified length
plus the block's fast K/V (:meth:`FastStream.draft_step`), training passes the whole sequence's
slow K/V plus its fast K/V under the block-causal mask of :func:`block_mask`
(:meth:`FastStream.forward_train`). ``tests/test_multirate.py`` checks the two agree.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from m2r2.cache import KVCache
from m2r2.errors import InputError, SettingsError
from m2r2.kernels import dense_weight, linear_like, widen_logits
from m2r2.model import Block, Transformer, attend
from m2r2.multirate.adapters import LayerAdapters
from m2r2.multirate.arla import ARLA

PATHS = ("prefix", "strided")


@dataclass
class FastConfig:
    """Shape of a fast stream: which base layers it runs, its rate, adapter rank and exits."""

    num_base_layers: int
    rate: int
    path: list[int]  # 0-based base-layer index of fast layers 1..K
    rank: int = 16
    exits: list[int] = field(default_factory=list)  # 1-based fast layers trained with a KL head
    arla_dim: int = 64

    @classmethod
    def build(
        cls,
        num_layers: int,
        rate: int | None = None,
        depth: int | None = None,
        path: str | list[int] = "prefix",
        rank: int = 16,
        exits: list[int] | None = None,
        arla_dim: int = 64,
    ) -> FastConfig:
        """Fill in R or K from the other (``K = ceil(N/R)``), then the base-layer path."""
        n = num_layers
        if isinstance(path, list):
            layers = [int(i) for i in path]
            depth = len(layers)
            rate = rate or max(1, math.ceil(n / depth))
        else:
            if path not in PATHS:
                raise SettingsError(f"unknown fast path {path!r}; choose from {', '.join(PATHS)} or give layers")
            if rate is None and depth is None:
                rate = 3
            rate = rate or max(1, math.ceil(n / int(depth or 1)))
            depth = depth or math.ceil(n / rate)
            layers = list(range(depth)) if path == "prefix" else [min(n, rate * j) - 1 for j in range(1, depth + 1)]
        if not layers or any(not 0 <= i < n for i in layers):
            raise SettingsError(f"fast path {layers} must be non-empty base-layer indices in 0..{n - 1}")
        if rate < 1 or rank < 1:
            raise SettingsError("rate and rank must be >= 1")
        exits = sorted(set(exits or [len(layers)]))
        if any(not 1 <= j <= len(layers) for j in exits):
            raise SettingsError(f"exit layers {exits} must be in 1..{len(layers)}")
        return cls(n, int(rate), layers, int(rank), exits, int(arla_dim))

    @property
    def depth(self) -> int:
        return len(self.path)

    def target(self, j: int) -> int:
        """Slow layer (1-based; 0 = embedding) that fast layer ``j`` is aligned to."""
        return min(self.num_base_layers, self.rate * j)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FastConfig:
        try:
            return cls(
                int(d["num_base_layers"]),
                int(d["rate"]),
                [int(i) for i in d["path"]],
                int(d["rank"]),
                [int(j) for j in d["exits"]],
                int(d.get("arla_dim", 64)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SettingsError(f"bad fast-stream config {d}: {e}") from e


def block_starts(length: int, block_lengths: list[int]) -> Tensor:
    """Start position of the block each of ``length`` positions falls in (blocks tile the sequence)."""
    starts, pos = [], 0
    for w in block_lengths:
        starts += [pos] * min(w, length - pos)
        pos += w
        if pos >= length:
            break
    if pos < length:
        raise InputError("block lengths do not cover the sequence")
    return torch.tensor(starts)


def block_mask(starts: Tensor, slow_len: int | None = None) -> Tensor:
    """Boolean mask ``[T, S + T]`` over slow keys ``0..S-1`` then fast keys of the same ``T`` positions.

    Query t sees slow keys before its block's start and fast keys from that start up to t. With
    ``S = T`` this is the training mask over a whole sequence.
    """
    t = starts.shape[0]
    s = t if slow_len is None else slow_len
    q = torch.arange(t)[:, None]
    slow = torch.arange(s)[None, :] < starts[:, None]
    k = torch.arange(t)[None, :]
    fast = (k >= starts[:, None]) & (k <= q)
    return torch.cat([slow, fast], dim=1)


def draft_mask(verified_len: int, block_len: int, new: int, device: torch.device) -> Tensor:
    """Mask for the last ``new`` positions of a block of ``block_len`` starting at ``verified_len``."""
    fast = torch.arange(block_len)[None, :] <= torch.arange(block_len - new, block_len)[:, None]
    return torch.cat([torch.ones(new, verified_len, dtype=torch.bool), fast], dim=1).to(device)


def shared_attention(q: Tensor, k_slow: Tensor, v_slow: Tensor, k_fast: Tensor, v_fast: Tensor, mask: Tensor) -> Tensor:
    """The one attention of the fast stream: queries over slow K/V then fast K/V, under ``mask``."""
    return attend(q, torch.cat([k_slow, k_fast], dim=2), torch.cat([v_slow, v_fast], dim=2), mask)


def fast_layer(
    block: Block,
    f: Tensor,
    cos: Tensor,
    sin: Tensor,
    slow_kv: tuple[Tensor, Tensor],
    mask: Tensor,
    lora: Any,
    prev_kv: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """One fast layer: base ``block`` + adapter deltas, attending through :func:`shared_attention`.

    Returns the new state and the block's fast K/V so far (``prev_kv`` + this call's).
    """
    q, k, v = block.attn.qkv(block.attn_norm(f), cos, sin, lora)
    if prev_kv is not None:
        k, v = torch.cat([prev_kv[0], k], dim=2), torch.cat([prev_kv[1], v], dim=2)
    a = f + block.attn.out(shared_attention(q, slow_kv[0], slow_kv[1], k, v, mask), lora)
    return a + block.mlp(block.mlp_norm(a), lora, resid=a), (k, v)


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing every tensor and submodule, whose submodules can be replaced alone."""
    new = copy.copy(module)
    new._modules = dict(module._modules)  # copy.copy would share the dict, so a swap would hit the original
    new._parameters = dict(module._parameters)
    return new


#: Where each fused adapter group acts in a block: (submodule, linear layer).
_GROUP_SITES = {"qkv": ("attn", "wqkv"), "o": ("attn", "wo"), "gate_up": ("mlp", "w13"), "down": ("mlp", "w2")}


def merged_block(block: Block, adapters: LayerAdapters, scale: dict[str, Tensor] | None = None) -> Block:
    """Base ``block`` with the adapters' deltas folded into private copies of the adapted layers.

    Why: on a CPU the low-rank deltas cost about as much as the layers themselves (two skinny
    matmuls per projection group; measured 7.8 ms of a 16.6 ms 10-layer fast pass on the bundled
    model), while a folded layer costs exactly a base layer. The copies use the base layer's kernel
    (a q4 layer is re-quantized from ``W + B A``, so the fast stream is a slightly different
    approximation than in training; the slow stream, and so lossless verification, is untouched).
    Norms, the router and MoE experts stay shared with the base block. ``scale`` multiplies the
    output features of a group's folded weight (``{"o": g, ...}``: a grown seeded layer's gates).
    """
    new = _shallow(block)
    with torch.no_grad():
        for group in adapters.groups:
            owner, attr = _GROUP_SITES[group]
            sub = getattr(new, owner)
            if sub is getattr(block, owner):  # first group in this submodule: copy it once
                sub = _shallow(sub)
                setattr(new, owner, sub)
            lin = getattr(sub, attr)
            a, b = adapters.fused(group)
            w = dense_weight(lin)
            w = w + (b.float() @ a.float()).to(w.device)
            if scale is not None and group in scale:
                w = scale[group].float().to(w.device)[:, None] * w
            setattr(sub, attr, linear_like(lin, w))
    return new


@dataclass
class DraftBlock:
    """Fast K/V of the current draft block (per fast layer); dropped once the block is verified."""

    verified_len: int
    kv: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    length: int = 0


@dataclass
class DraftOut:
    logits: Tensor  # [B, n, V] float32 at the exit layer
    states: list[Tensor]  # f_0 .. f_K for the n new positions, each [B, n, d]
    block: DraftBlock


class FastStream(nn.Module):
    """Adapters + ARLA for a base model that stays frozen and outside this module's parameters.

    The base model is held by reference (not registered), so ``state_dict``, ``.to(dtype)``,
    optimisers and DDP only ever see the adapters and the router.
    """

    def __init__(self, base: Transformer, cfg: FastConfig) -> None:
        super().__init__()
        if cfg.num_base_layers != base.cfg.num_layers:
            raise SettingsError(
                f"fast stream built for {cfg.num_base_layers} base layers, the model has {base.cfg.num_layers}"
            )
        self.cfg = cfg
        object.__setattr__(self, "base", base)
        self.adapters = nn.ModuleList(LayerAdapters(base.cfg, cfg.rank, layer) for layer in cfg.path)
        self.arla = ARLA(base.cfg.hidden_size, cfg.depth, cfg.arla_dim)
        #: False runs the path's base layers without adapter deltas: plain early exit (the ablation),
        #: without paying for deltas that are zero.
        self.use_adapters = True
        #: Fast layers with the adapters folded in (:meth:`freeze` with ``merge``); a plain list, so
        #: they stay out of ``state_dict`` and of the optimiser.
        self.merged: list[Block] | None = None
        #: Token ids the draft head scores (sorted; None = the whole vocabulary); see :meth:`freeze`.
        self.draft_vocab: Tensor | None = None
        self.sub_head: nn.Module | None = None

    base: Transformer

    def freeze(self, merge: bool = False) -> FastStream:
        """Inference mode: eval, no grad, fused adapter weights precomputed in the base dtype.

        ``merge`` also folds the adapters into private copies of the fast layers
        (:func:`merged_block`): about half the cost of a fast pass on a CPU, at the memory of
        ``depth`` extra layers. The parameters themselves stay float32 (ARLA runs in float32).
        """
        self.eval().requires_grad_(False)
        for a in self.adapters:
            a.freeze(self.base.dtype)
        self.merged, self.sub_head = None, None
        if merge and self.use_adapters:
            pairs = zip(self.cfg.path, self.adapters, strict=True)
            self.merged = [merged_block(self.base.layers[i], a) for i, a in pairs]
        if merge and self.draft_vocab is not None:
            head = self.base.lm_head
            ids = self.draft_vocab.to(self.base.device)
            with torch.no_grad():  # not registered as a submodule: it stays out of state_dict, like ``merged``
                object.__setattr__(self, "sub_head", linear_like(head, dense_weight(head)[ids]))
        return self

    def train(self, mode: bool = True) -> FastStream:
        if mode:
            self.merged, self.sub_head = None, None  # parameters may change: folded copies would go stale
        return super().train(mode)

    def layer(self, j: int) -> tuple[Block, Any]:
        """Block and adapter deltas to run fast layer ``j`` (0-based) with at inference."""
        if self.merged is not None:
            return self.merged[j], None
        return self.base.layers[self.cfg.path[j]], self.adapters[j].lora() if self.use_adapters else None

    def forward_train(self, h0: Tensor, slow_k: Tensor, slow_v: Tensor, starts: Tensor) -> list[Tensor]:
        """Fast states ``[f_0 .. f_K]`` over whole sequences at positions ``0..T-1``.

        ``h0``: embeddings ``[B, T, d]``; ``slow_k``/``slow_v``: the slow K/V of all base layers
        (``cache.k``/``cache.v``, ``[N, B, kv_heads, >=T, D]``) from a slow pass over the same tokens;
        ``starts``: block start of each position (:func:`block_starts`).
        """
        t = h0.shape[1]
        cos, sin = self.base.rope(0, t, h0.dtype)
        mask = block_mask(starts).to(h0.device)
        states = [h0]
        for j, layer in enumerate(self.cfg.path):
            kv = (slow_k[layer, :, :, :t], slow_v[layer, :, :, :t])
            blk, lora = self.layer(j)  # the folded copies once frozen with ``merge`` (evaluation only)
            f, _ = fast_layer(blk, states[j], cos, sin, kv, mask, lora)
            states.append(f)
        return states

    def exit_logits(self, f: Tensor) -> Tensor:
        """``W . Norm(f)`` in float32.

        With a draft vocabulary (set before ``freeze(merge=True)``), only its rows of ``W`` are
        computed and every other token gets ``-inf``: the bundled model's 49k-word head costs as
        much as ~5 of its layers, and a draft can only be accepted where the fast stream is right,
        which is mostly on frequent tokens (BENCHMARKS.md has the measured coverage). Drafts stay
        a proper distribution (zero outside the vocabulary), so speculative sampling stays exact.
        """
        if self.sub_head is None or self.draft_vocab is None:
            return self.base.head(f)
        return widen_logits(self.sub_head(self.base.norm(f)).float(), self.draft_vocab, self.base.cfg.vocab_size)

    def draft_step(
        self,
        tokens: Tensor,
        cache: KVCache,
        verified_len: int,
        block: DraftBlock | None = None,
        exit_layer: int | None = None,
    ) -> DraftOut:
        """Run ``tokens`` (``[B, n]``, the next positions of the draft block) through the fast stream.

        Reads the slow cache up to ``verified_len`` and never writes it. Pass the returned block
        back to extend the same draft by one or more tokens at a cost of n positions; start a new
        block (``block=None``) after each verification.
        """
        block = block or DraftBlock(verified_len)
        if block.verified_len != verified_len:
            raise InputError("a draft block belongs to one verified length; start a new block after verifying")
        n = tokens.shape[1]
        pos = verified_len + block.length
        if pos + n > cache.max_len or verified_len > cache.length:
            raise InputError(f"draft of {pos + n} positions exceeds the cache ({cache.max_len}) or its length")
        base = self.base
        cos, sin = base.rope(pos, n, base.dtype)
        mask = draft_mask(verified_len, block.length + n, n, base.device)
        states = [base.embed_tokens(tokens)]
        new_kv = []
        for j, layer in enumerate(self.cfg.path):
            prev = block.kv[j] if block.kv else None
            blk, lora = self.layer(j)
            f, kv = fast_layer(blk, states[j], cos, sin, cache.view(layer, verified_len), mask, lora, prev)
            states.append(f)
            new_kv.append(kv)
        out = DraftBlock(verified_len, new_kv, block.length + n)
        return DraftOut(self.exit_logits(states[exit_layer or self.cfg.depth]), states, out)

    def exit_probability(self, states: list[Tensor], j: int) -> Tensor:
        """ARLA's probability that the exit at fast layer ``j`` agrees with the full model."""
        return torch.sigmoid(self.arla(states, j))
