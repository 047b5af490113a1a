"""The seeded fast stream: a few deep base layers with accelerator adapters, started from the slow
stream's final state.

Why (measured, docs/TRAINING.md): the prefix fast stream (base layers 1..10 + adapters) must rebuild
from the embedding everything the slow stream computes in 30 layers; after an hour of CPU training
it agreed with the full model on 0.29 of tokens at 0.41 of a step's cost. The verify pass has
already computed the slow stream's *final* residual ``h_N(t)`` of the last verified position; the
next token's state differs from it mostly by what the next token adds. So the fast stream is seeded
with ``f_0 = Fuse([h_N(t), E(x_{t+1})])`` and then runs base layers ``N-K..N-1`` (default: the last
one) with their accelerator adapters, its target being ``h_N(t+1)``: the fast residual covers the
whole depth in K layers (rate ``N/K``).

The M2R2 parts stay: the slow stream is frozen; each fast layer is a base layer plus low-rank
accelerator adapters (folded at inference); it keeps no KV cache of its own but attends the slow
cache of *its own base layer* (deep sharing: the verified context the full model built) for
verified positions, and fast K/V only inside the current draft (a chain or a tree); ARLA reads the
fast stream's velocity. Draft ``i+1`` is seeded from the fast state of draft ``i``, as at training
(:func:`chained_attention` trains on exactly these draft chains).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import m2r2.model
from m2r2 import amx
from m2r2.cache import KVCache
from m2r2.errors import SettingsError
from m2r2.kernels import dense_weight, linear_like, place_on_huge_pages, widen_logits
from m2r2.model import AVX2_OPS, Block, Transformer, attend
from m2r2.multirate.adapters import LayerAdapters
from m2r2.multirate.arla import ARLA
from m2r2.multirate.fast import merged_block

KIND = "seeded"
#: A grown layer's output gates are ``GATE_SCALE * p`` with ``p`` starting at 0. Why the scale: AdamW
#: moves a parameter by about ``lr`` a step whatever its size, so an unscaled gate would need ~1/lr
#: steps to open; scaled, it opens within tens of steps when the loss asks for the layer.
GATE_SCALE = 10.0


@dataclass
class SeededConfig:
    """Shape of a seeded fast stream: the base layers it runs (the last ``depth`` by default), rank, and
    which of them were *grown* onto a shallower trained stream (outputs gated: :meth:`SeededFastStream.adopt`)."""

    num_base_layers: int
    layers: list[int]
    rank: int = 32
    arla_dim: int = 64
    kind: str = KIND
    gated: list[int] = field(default_factory=list)
    #: fast layers that run attention (over the slow cache of their base layer) but no FFN
    attention_only: list[int] = field(default_factory=list)
    #: base layers (0-based) whose output residual at the last verified position joins the seed (the
    #: slow stream's low/mid-level features, as EAGLE-3 fuses them); none: the seed reads ``h_N`` alone
    taps: list[int] = field(default_factory=list)
    #: base layers (0-based, below the fast layers) whose output residual *at the drafted token's own position*
    #: joins the seed: the base model's first layers run on each draft node exactly as the verify pass will run
    #: them (the slow cache, the node's ancestors), so the fast stream reads the new token in its context as the
    #: model's early layers see it, not by its embedding alone
    token_taps: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, sub in (("gated", self.gated), ("attention-only", self.attention_only)):
            if not set(sub) <= set(self.layers):
                raise SettingsError(f"{name} layers {sub} are not among the fast layers {self.layers}")
        if not all(0 <= i < self.num_base_layers for i in self.taps):
            raise SettingsError(f"taps must be base layers 0..{self.num_base_layers - 1}, got {self.taps}")
        if not all(0 <= i < min(self.layers) for i in self.token_taps):
            raise SettingsError(
                f"token taps must be base layers below the fast ones (0..{min(self.layers) - 1}), got {self.token_taps}"
            )

    @property
    def seed_parts(self) -> int:
        """How many ``d``-wide inputs the fuse reads: the previous state, the token's embedding, the taps."""
        return 2 + len(self.taps) + len(self.token_taps)

    @classmethod
    def build(
        cls,
        num_layers: int,
        depth: int = 1,
        rank: int = 32,
        arla_dim: int = 64,
        gated: list[int] | None = None,
        attention_only: list[int] | None = None,
        taps: list[int] | None = None,
        token_taps: list[int] | None = None,
    ) -> SeededConfig:
        if not 1 <= depth <= num_layers:
            raise SettingsError(f"seeded fast stream depth must be in 1..{num_layers}, got {depth}")
        if rank < 1:
            raise SettingsError(f"adapter rank must be >= 1, got {rank}")
        layers = list(range(num_layers - depth, num_layers))
        return cls(
            num_layers,
            layers,
            rank,
            arla_dim,
            gated=sorted(gated or []),
            attention_only=sorted(attention_only or []),
            taps=sorted(taps or []),
            token_taps=sorted(token_taps or []),
        )

    @property
    def depth(self) -> int:
        return len(self.layers)

    @property
    def rate(self) -> int:
        return math.ceil(self.num_base_layers / self.depth)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("gated", "attention_only", "taps", "token_taps"):  # files of plain streams keep their earlier form
            if not d[key]:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SeededConfig:
        try:
            layers = [int(i) for i in d["layers"]]
            gated, attn, taps, tok = (
                [int(i) for i in d.get(key, [])] for key in ("gated", "attention_only", "taps", "token_taps")
            )
            return cls(
                int(d["num_base_layers"]),
                layers,
                int(d["rank"]),
                int(d["arla_dim"]),
                gated=gated,
                attention_only=attn,
                taps=taps,
                token_taps=tok,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SettingsError(f"bad seeded fast-stream config {d}: {e}") from e


def chained_attention(q: Tensor, slow: tuple[Tensor, Tensor], fast: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Training attention of draft step ``s = len(fast)`` over whole sequences, for every position at once.

    Query at position p stands for the s-th draft of a block whose last verified position is
    ``p - s``: it sees slow keys ``0..p-s`` and the fast keys that drafts 1..s of that block wrote,
    i.e. step j's fast key at position ``p - s + j`` (a diagonal of step j's keys). ``q``:
    ``[B, H, T, D]``; ``slow``/``fast[j]``: K and V ``[B, KVH, T, D]``. Rows with no slow key left
    (p < s) still see their own fast key; they are masked out of the loss by the caller.
    """
    h, t, d = q.shape[1:]
    g = h // slow[0].shape[1]
    s = len(fast)
    scale = 1.0 / math.sqrt(d)
    ks, vs = slow[0].repeat_interleave(g, 1), slow[1].repeat_interleave(g, 1)
    scores = (q @ ks.transpose(-1, -2)) * scale  # [B, H, T, T]
    pos = torch.arange(t, device=q.device)
    scores = scores.masked_fill(~(pos[None, :] <= pos[:, None] - s), float("-inf"))
    extra_s, extra_v = [], []
    for j, (k, v) in enumerate(fast, start=1):
        shift = s - j  # step j's key for this block sits ``shift`` positions before the query
        k = F.pad(k, (0, 0, shift, 0))[:, :, :t].repeat_interleave(g, 1)
        v = F.pad(v, (0, 0, shift, 0))[:, :, :t].repeat_interleave(g, 1)
        e = (q * k).sum(-1, keepdim=True) * scale
        extra_s.append(e.masked_fill((pos < shift)[None, None, :, None], float("-inf")))
        extra_v.append(v)
    p = torch.softmax(torch.cat([scores, *extra_s], dim=-1), dim=-1)
    out = p[..., :t] @ vs
    for j, v in enumerate(extra_v):
        out = out + p[..., t + j : t + j + 1] * v
    return out


class TreeLimits(NamedTuple):
    """How far a greedy draft tree grows (``TreeSpeculative.draft``'s rules): at most ``depth`` levels, each opening
    its ``width`` most probable new nodes and giving each open node ``branch`` children; it stops once it holds
    ``max_total`` drafted nodes, or (``level_cost`` > 0) once ``calib`` times its best open node's path probability is
    below ``level_cost``."""

    depth: int
    width: int
    branch: int
    max_total: int
    calib: float = 1.0
    level_cost: float = 0.0


class DraftHead:
    """The frozen base model's final norm and LM head, scored over a draft vocabulary: how every drafter
    that reads the base head (the seeded fast stream, Medusa heads) turns a state into draft tokens.

    Why: the head is read at every draft step and costs as much as several layers of a small model;
    scoring only the draft vocabulary's rows (``m2r2 draft-vocab``) cuts that in proportion, and
    every other token gets -inf, so a draft is still a proper distribution and speculative sampling
    stays exact. ``sub_head`` is the inference form: those rows with the base head's kernel.
    """

    base: Transformer
    draft_vocab: Tensor | None
    sub_head: nn.Module | None

    def head_weight(self, full: bool = False) -> Tensor:
        """Rows of the LM head the draft scores (the draft vocabulary, else all; ``full``: all), float32."""
        w = self.base.lm_head.weight if isinstance(self.base.lm_head, nn.Linear) else dense_weight(self.base.lm_head)
        return w if self.draft_vocab is None or full else w[self.draft_vocab.to(w.device)]

    def build_draft_head(self, bits: int | None = None) -> None:
        """``sub_head``: the draft vocabulary's rows of the LM head with its kernel (``bits=4``: that kernel's
        4-bit blocks, :func:`m2r2.kernels.linear_like`)."""
        head = self.base.lm_head
        w = dense_weight(head)
        rows = w if self.draft_vocab is None else w[self.draft_vocab.to(w.device)]
        object.__setattr__(self, "sub_head", linear_like(head, rows, bits))

    def vocab_logits(self, f: Tensor) -> Tensor:
        """``W . Norm(f)`` over the draft vocabulary only (``[..., len(draft_vocab)]``, float32)."""
        if self.sub_head is None:
            return F.linear(self.base.norm(f), self.head_weight().to(f.dtype)).float()
        return self.sub_head(self.base.norm(f)).float()

    def widen(self, sub: Tensor) -> Tensor:
        """Draft-vocabulary logits as full-vocabulary ones (-inf outside the draft vocabulary)."""
        if self.draft_vocab is None:
            return sub
        return widen_logits(sub, self.draft_vocab, self.base.cfg.vocab_size)

    def top_of(self, sub: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The ``k`` most probable token ids and their probabilities (``[..., k]``) of draft-vocabulary
        logits: softmax and top-k over the draft vocabulary only (not a 49k row of -inf), same numbers."""
        top = torch.softmax(sub, -1).topk(k, dim=-1)
        ids = top.indices if self.draft_vocab is None else self.draft_vocab.to(sub.device)[top.indices]
        return ids, top.values

    def draft_logits(self, f: Tensor) -> Tensor:
        """``W . Norm(f)`` over the whole vocabulary (float32; -inf outside the draft vocabulary)."""
        return self.widen(self.vocab_logits(f))

    def draft_top(self, f: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Greedy drafting's ``k`` most probable next tokens and their draft probabilities (``[..., k]``)."""
        return self.top_of(self.vocab_logits(f), k)


class SeededFastStream(DraftHead, nn.Module):
    """Fuse + adapters + ARLA for a frozen base model held by reference (not a registered submodule)."""

    def __init__(self, base: Transformer, cfg: SeededConfig) -> None:
        super().__init__()
        if cfg.num_base_layers != base.cfg.num_layers:
            raise SettingsError(
                f"fast stream built for {cfg.num_base_layers} base layers, the model has {base.cfg.num_layers}"
            )
        self.cfg = cfg
        object.__setattr__(self, "base", base)
        d = base.cfg.hidden_size
        self.fuse = nn.Linear(cfg.seed_parts * d, d, bias=False)
        with torch.no_grad():  # start as h_N(t) + E(x_{t+1}): a residual the deep layer can read (taps: 0)
            self.fuse.weight.zero_()
            self.fuse.weight[:, : 2 * d].copy_(torch.cat([torch.eye(d), torch.eye(d)], dim=1))
        self.adapters = nn.ModuleList(
            LayerAdapters(base.cfg, cfg.rank, layer, layer in cfg.attention_only) for layer in cfg.layers
        )
        self.arla = ARLA(d, cfg.depth, cfg.arla_dim)
        # [attention, FFN] output gates of grown layers (none in a stream trained at its depth)
        self.gates = nn.ParameterDict({str(i): nn.Parameter(torch.zeros(2, d)) for i in cfg.gated})
        self.merged: list[Block] | None = None
        self.draft_vocab: Tensor | None = None
        self.sub_head: nn.Module | None = None
        self.fuse_infer: nn.Module | None = None

    base: Transformer

    # ---- shared by training and inference -------------------------------------------------------
    def seed(
        self, h_prev: Tensor, tokens: Tensor, taps: Tensor | None = None, token_feats: Tensor | None = None
    ) -> Tensor:
        """``f_0``: the previous position's final state (slow, or the previous draft's) fused with the token
        (and, for a tapped stream, the last verified position's tap features ``[..., len(taps), d]``; for one
        with token taps, the token's own early-layer features ``[..., len(token_taps), d]``)."""
        parts = [h_prev, self.base.embed_tokens(tokens).to(h_prev.dtype)]
        for name, want, got in (("tap", self.cfg.taps, taps), ("token-tap", self.cfg.token_taps, token_feats)):
            if want:
                if got is None:
                    raise SettingsError(f"this seeded stream fuses {name} features into its seed; none were given")
                parts.append(got.flatten(-2).to(h_prev.dtype))
        x = torch.cat(parts, dim=-1)
        if self.fuse_infer is not None:
            return self.fuse_infer(x.to(self.base.dtype))
        w = self.fuse.weight  # float32 parameters (training, or the unfolded inference form)
        return F.linear(x.to(w.dtype), w).to(self.base.dtype)

    def layer(self, j: int) -> tuple[Block, Any]:
        if self.merged is not None:
            return self.merged[j], None
        return self.base.layers[self.cfg.layers[j]], self.adapters[j].lora()

    def gate(self, j: int) -> Tensor | None:
        """Fast layer ``j``'s [attention, FFN] output scales, or None (ungated, or folded into the merged copy)."""
        if self.merged is not None or not self.gates:
            return None
        key = str(self.cfg.layers[j])
        return GATE_SCALE * self.gates[key] if key in self.gates else None

    def residual(self, j: int, blk: Block, lora: Any, f: Tensor, o: Tensor) -> Tensor:
        """Fast layer ``j``'s output from its input ``f`` and attention ``o``: both sub-layers add to the
        residual (an attention-only layer: attention alone), scaled by the layer's gates if it was grown."""
        g = self.gate(j)
        h = blk.attn.out(o, lora)
        a = f + (h if g is None else g[0].to(h.dtype) * h)
        if self.cfg.layers[j] in self.cfg.attention_only:
            return a
        m = blk.mlp(blk.mlp_norm(a), lora, resid=a)
        return a + (m if g is None else g[1].to(m.dtype) * m)

    def adopt(self, start: SeededFastStream) -> None:
        """Start training from ``start``: a stream of this shape, or one of the same or a lower rank whose
        layers are this stream's last ones (shallower, or with layers this one runs attention-only). Why
        grow: a trained one-layer stream stopped gaining from more data (docs/TRAINING.md); the earlier
        layers it lacks are added with their outputs gated shut, and a higher rank keeps ``start``'s pairs
        in its first ranks with the new ranks' ``B`` columns at 0, so training starts exactly at
        ``start``'s drafts and opens the new capacity as it helps."""
        if start.cfg == self.cfg:
            self.load_state_dict(start.state_dict())
            return
        a, b = start.cfg, self.cfg
        extra = [i for i in b.layers if i not in a.layers]
        if (
            a.rank > b.rank
            or b.layers[-a.depth :] != a.layers
            or not set(extra) <= set(b.gated)
            or not set(a.attention_only) <= set(b.attention_only)
            or a.taps not in ([], b.taps)
            or a.token_taps not in ([], b.token_taps)
            or (a.token_taps and a.taps != b.taps)
        ):
            raise SettingsError(
                f"cannot start a seeded stream of layers {b.layers}, rank {b.rank}, gated {b.gated}, attention-only "
                f"{b.attention_only}, taps {b.taps} from one of layers {a.layers}, rank {a.rank}, attention-only "
                f"{a.attention_only}, taps {a.taps}"
            )
        with torch.no_grad():  # a stream without taps: their columns stay 0, so its drafts are kept at first
            self.fuse.weight.zero_()
            self.fuse.weight[:, : start.fuse.in_features].copy_(start.fuse.weight)
            for j, layer in enumerate(a.layers):  # an attention-only layer takes the attention adapters alone
                mine = self.adapters[b.layers.index(layer)].state_dict()  # views of the parameters
                for key, pair in start.adapters[j].state_dict().items():
                    if key.startswith("A.") and key in mine:  # [rank, in]: the start's ranks first
                        mine[key][: a.rank].copy_(pair)
                    elif key in mine:  # B [out, rank]: the new ranks' columns add nothing yet
                        mine[key].zero_()[:, : a.rank].copy_(pair)
            for key, p in start.gates.items():
                self.gates[key].copy_(p)
            for name in ("q", "k", "v", "out"):  # ARLA's layer embedding has one row per depth: kept fresh
                getattr(self.arla, name).load_state_dict(getattr(start.arla, name).state_dict())

    # ---- training -------------------------------------------------------------------------------
    def forward_chain(
        self, tokens: Tensor, hidden: Tensor, k: Tensor, v: Tensor, steps: int, taps: Tensor | None = None
    ) -> list[list[Tensor]]:
        """States ``[f_0 .. f_K]`` of draft steps 1..``steps`` at every position of whole sequences.

        ``tokens`` ``[B, T]``; ``hidden``: the slow ``h_N`` ``[B, T, d]``; ``k``/``v``: slow K/V of the
        fast layers' base layers ``[K, B, KVH, T, D]``; ``taps``: the tap layers' outputs ``[B, T, len, d]``
        (tapped streams), then along the same dim the token taps' (``[B, T, len(token_taps), d]``). Step 1 at
        position p is seeded by ``h_N(p-1)``, step s by step s-1's final fast state at ``p-1``, and both by the
        taps of the block's last verified position ``p-s`` and the token taps of ``p`` itself (teacher forced,
        the drafted tokens are the true ones, so these are what the base's first layers give the draft); its
        target is ``h_N(p)``.
        """
        base = self.base
        t = tokens.shape[1]
        cos, sin = base.rope(0, t, hidden.dtype)
        prev = F.pad(hidden, (0, 0, 1, 0))[:, :t]  # h_N(p-1); zeros at p = 0 (masked out of the loss)
        fast_kv: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.cfg.layers]
        n_taps = len(self.cfg.taps)
        own = taps[:, :, n_taps:] if self.cfg.token_taps and taps is not None else None
        out = []
        for s in range(1, steps + 1):
            verified = None
            if n_taps and taps is not None:
                verified = F.pad(taps[:, :, :n_taps], (0, 0, 0, 0, s, 0))[:, :t]  # taps(p - s)
            states = [self.seed(prev, tokens, verified, own)]
            for j in range(self.cfg.depth):
                blk, lora = self.layer(j)
                f = states[-1]
                q, kk, vv = blk.attn.qkv(blk.attn_norm(f), cos, sin, lora)
                fast_kv[j].append((kk, vv))
                states.append(self.residual(j, blk, lora, f, chained_attention(q, (k[j], v[j]), fast_kv[j])))
            out.append(states)
            prev = F.pad(states[-1], (0, 0, 1, 0))[:, :t]
        return out

    # ---- inference ------------------------------------------------------------------------------
    def freeze(self, merge: bool = True, head_bits: int | None = None) -> SeededFastStream:
        """Eval, no grad; ``merge`` folds the adapters into private copies of the fast layers and
        builds the draft head over the draft vocabulary with the base head's kernel (``head_bits=4``: in its
        4-bit blocks)."""
        self.eval().requires_grad_(False)
        for a in self.adapters:
            a.freeze(self.base.dtype)
        self.merged, self.sub_head, self.fuse_infer = None, None, None
        if merge:
            gates = [self.gate(j) for j in range(self.cfg.depth)]  # a grown layer's fold into its output rows
            self.merged = [
                merged_block(self.base.layers[i], a, None if g is None else {"o": g[0], "down": g[1]})
                for i, a, g in zip(self.cfg.layers, self.adapters, gates, strict=True)
            ]
            head = self.base.lm_head  # its kernel (bf16 under q4) also serves the fuse: 4 bits would blur it
            self.fuse_infer = linear_like(head, self.fuse.weight.detach().float())
            self.build_draft_head(head_bits)
        return self

    def train(self, mode: bool = True) -> SeededFastStream:
        if mode:
            self.merged, self.sub_head, self.fuse_infer = None, None, None
        return super().train(mode)

    def step(
        self,
        h_prev: Tensor,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache,
        verified_len: int,
        drafted: int,
        fast_mask: Tensor,
        taps: Tensor | None = None,
    ) -> list[Tensor]:
        """Draft ``n`` nodes at once (``tokens`` ``[1, n]`` at RoPE ``positions`` ``[n]``); returns the states.

        Each node attends the slow cache ``0..verified_len-1`` of the fast layer's base layer and the
        fast keys of earlier draft nodes plus its own, as ``fast_mask`` (``[n, drafted + n]``) allows
        (a chain: all earlier; a tree: its ancestors); ``taps`` ``[1, n, len, d]``: a tapped stream's tap
        features of the last verified position. The fast K/V of draft nodes live in that cache's
        free slots ``verified_len..``, after the ``drafted`` rows of earlier levels: scratch that the
        verify pass overwrites, so a level attends one cache view and copies no keys.
        """
        base = self.base
        cos, sin = base.rope_cos[positions].to(base.dtype), base.rope_sin[positions].to(base.dtype)
        n, at = tokens.shape[1], verified_len + drafted
        mask = torch.ones(n, at + n, dtype=torch.bool, device=fast_mask.device)
        mask[:, verified_len:] = fast_mask
        own = self.token_features(tokens, positions, cache, at, mask)
        states = [self.seed(h_prev.to(base.dtype), tokens, taps, own).to(base.dtype)]
        for j, layer in enumerate(self.cfg.layers):
            blk, lora = self.layer(j)
            f = states[-1]
            if lora is None and self.gate(j) is None and layer not in self.cfg.attention_only:
                # a merged full layer is a block of its own: the same ops as below (one C++ call where fused)
                states.append(blk(f, cos, sin, cache, layer, at, mask))
                continue
            q, k, v = blk.attn.qkv(blk.attn_norm(f), cos, sin, lora)
            cache.write(layer, at, k, v)
            sk, sv = cache.view(layer, at + n)
            states.append(self.residual(j, blk, lora, f, attend(q, sk, sv, mask)))  # C++ rows on a CPU
        return states

    def token_features(self, tokens: Tensor, positions: Tensor, cache: KVCache, at: int, mask: Tensor) -> Tensor | None:
        """The token taps of ``n`` draft nodes (``[1, n, len(token_taps), d]``; None without token taps): base layers
        ``0..max(token_taps)`` over the nodes, each attending the slow cache and the ancestors ``mask`` allows. Their
        K/V go to those layers' slots ``at..at+n-1``: the slow K/V of the nodes, which the verify pass writes again."""
        if not self.cfg.token_taps:
            return None
        base, outs = self.base, []
        stop = max(self.cfg.token_taps) + 1
        base.run_layers(base.embed_tokens(tokens), cache, at, outs, stop, positions=positions, mask=mask)
        return torch.stack([outs[i] for i in self.cfg.token_taps], dim=-2)

    def fused_level(self) -> tuple[object, ...] | None:
        """The C++ weights of a greedy draft level in one call (``csrc_avx2/block_avx2.cpp: draft_level``), or
        None where it does not apply: a folded one-layer stream (a full layer, no taps or gates) whose fast
        block, fuse and draft head run the AVX2 build's kernels (token taps: the base's first blocks too, and
        which of their outputs join the seed). Built once per folding."""
        key = (id(self.merged), id(self.fuse_infer), id(self.sub_head))
        kept = self.__dict__.get("_fused_level")
        if kept is not None and kept[0] == key:
            return kept[1]
        level = None
        ext = amx.avx2_extension()
        parts = (self.fuse_infer, self.sub_head)
        if self.merged is not None and self.cfg.depth == 1:  # a level's weights on huge pages, in its reading order
            b = self.merged[0]
            order = (self.fuse_infer, b.attn.wqkv, b.attn.wo, getattr(b.mlp, "w13", None), getattr(b.mlp, "w2", None))
            place_on_huge_pages([*order, self.sub_head])
        if (
            ext is not None
            and hasattr(ext, "draft_level")
            and self.merged is not None
            and self.cfg.depth == 1
            and not self.cfg.taps
            and self.cfg.layers[0] not in self.cfg.attention_only
            and self.gate(0) is None
            and (block := self.merged[0].fused()) is not None
            and all(getattr(m, "op", None) in AVX2_OPS and m.bias is None for m in parts)
            and self.base.norm.weight.dtype == torch.bfloat16
            and self.base.embed.weight.dtype == torch.bfloat16
            and None
            not in (pre := [self.base.layers[i].fused() for i in range(1 + max(self.cfg.token_taps, default=-1))])
        ):
            none = torch.empty(0)
            fuse, head = (
                ext.make_linear(m.qbytes, m.scales, AVX2_OPS[m.op], none, m.in_features, m.out_features) for m in parts
            )
            level = (block, fuse, head, pre, self.cfg.token_taps)
        self.__dict__["_fused_level"] = (key, level)
        return level

    def draft_top_fused(
        self,
        seeds: Tensor,
        tokens: list[int],
        positions: list[int],
        cache: KVCache,
        verified: int,
        drafted: int,
        fast_mask: Tensor,
        k: int,
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """:meth:`step` then :meth:`draft_top` for ``n`` nodes in one C++ call where :meth:`fused_level` applies
        (seeds ``[n, d]``; else None): the fast states ``[n, d]``, the ``k`` best token ids and their draft
        probabilities ``[n, k]``. Same kernels and fast K/V as :meth:`step`; the softmax's exp is the C++ one."""
        if verified + drafted + len(tokens) > cache.max_len or (parts := self._level_parts(cache)) is None:
            return None
        level, read, rope, caches = parts
        ext = amx.avx2_extension()
        states, idx, probs = ext.draft_level(  # type: ignore[union-attr]
            *level,
            *read,
            seeds.contiguous(),
            torch.tensor(tokens),
            torch.tensor(positions),
            *rope,
            *caches,
            verified,
            drafted,
            fast_mask.contiguous(),
            k,
        )
        ids = idx if self.draft_vocab is None else self.draft_vocab[idx]
        return states, ids, probs

    def draft_tree_fused(
        self, h_last: Tensor, root: int, cache: KVCache, verified: int, limits: TreeLimits
    ) -> tuple[list[int], list[int], list[float]] | None:
        """A greedy draft tree under ``root`` within ``limits`` in one C++ call where :meth:`fused_level` applies
        (else None): the drafted nodes' tokens, parents and path probabilities in creation order, node 0 being
        ``root`` seeded by ``h_last`` (``[d]``). What :meth:`m2r2.decoding.tree.TreeSpeculative.draft` builds level
        by level with :meth:`draft_top_fused` (the same levels, candidates and stopping rule:
        ``csrc_avx2/block_avx2.cpp`` ``draft_tree``), without a level's Python; the fast K/V go to the cache's free
        slots as there."""
        if (parts := self._level_parts(cache)) is None:
            return None
        level, read, rope, caches = parts
        vocab = self.draft_vocab if self.draft_vocab is not None else torch.empty(0, dtype=torch.long)
        ext = amx.avx2_extension()
        return ext.draft_tree(*level, *read, vocab, h_last.contiguous(), root, *rope, *caches, verified, *limits)  # type: ignore[union-attr]

    def _level_parts(self, cache: KVCache) -> tuple[tuple[object, ...], ...] | None:
        """What the C++ draft calls read besides their rows, where they apply to this inference pass over ``cache``
        (else None): :meth:`fused_level`'s weights; the final norm's weight and eps and the embedding; the RoPE
        tables; the fast layer's K/V cache and the whole cache (whose first layers token taps write)."""
        if (
            not m2r2.model.FUSED_BLOCKS
            or torch.is_grad_enabled()
            or cache.k.shape[1] != 1
            or (level := self.fused_level()) is None
        ):
            return None
        base, layer = self.base, self.cfg.layers[0]
        read = (base.norm.weight, base.norm.eps, base.embed.weight)
        return level, read, (base.rope_cos, base.rope_sin), (cache.k[layer], cache.v[layer], cache.k, cache.v)

    def exit_probability(self, states: list[Tensor]) -> Tensor:
        return torch.sigmoid(self.arla(states, self.cfg.depth))
