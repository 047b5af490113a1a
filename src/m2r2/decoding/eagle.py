"""Method ``eagle``: an EAGLE-style feature head (Li et al., 2024) on the frozen base model, drafting
token trees that the verifier of ``m2r2`` checks (:mod:`m2r2.decoding.tree`): a trained peer on M2R2's
footing.

EAGLE drafts at the feature level: from the last verified position's final slow state ``h_N(t)`` and
the next token ``x_{t+1}`` it predicts the next final state, ``f = Layer(fc([h_N(t), E(x_{t+1})]))
~ h_N(t+1)``, whose draft distribution is the frozen base final norm and LM head over the draft
vocabulary (:class:`~m2r2.multirate.seeded.DraftHead`); deeper drafts feed the head its own predicted
features. ``Layer`` is one decoder layer, initialised as a copy of the base model's last layer, and
``fc`` (2d -> d) starts as ``h + E(x)`` (as the seeded stream's fuse). Unlike the seeded fast stream,
which attends the slow K/V cache, the EAGLE layer attends *its own* KV cache over the feature sequence
(EAGLE-1/2): entry ``i`` holds the pair ``(h_N(i), x_{i+1})`` at RoPE position ``i``.

That cache holds the true features of every verified position: the prefill's states go in, and after
each verify pass the accepted rows' slow states (which the pass computed anyway) with their next
tokens (:meth:`EagleDrafter.observe`, called by :class:`~m2r2.decoding.tree.TreeSpeculative`). They
are run through the layer lazily, as extra rows of the next round's first draft level (one pass);
tree nodes' K/V stay outside the cache (rejected drafts never pollute it). The server's batched steps
between rounds report their pairs too (:meth:`~m2r2.decoding.tree.TreeSpeculative.stepped`); a sequence
seen from the middle anyway forgets what came before the gap: drafts get worse, never wrong, since
verification decides every token. Heads are trained from a training store by
``m2r2 train-eagle`` (:mod:`m2r2.training.eagle_train`) and kept as ``NAME.safetensors`` +
``NAME.json`` bound to the base model's fingerprint.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m2r2 import weightfile
from m2r2.cache import KVCache
from m2r2.decoding import register
from m2r2.decoding.lookup import DEFAULT_LOOKUP
from m2r2.decoding.tree import Tree, TreeSpeculative, build_tree_speculative
from m2r2.errors import SettingsError, WeightsError
from m2r2.kernels import dense_weight, linear_like
from m2r2.model import Block, RMSNorm, Transformer
from m2r2.multirate.io import weights_of, with_weights
from m2r2.multirate.seeded import DraftHead, chained_attention
from m2r2.paths import DEFAULT_EAGLE

if TYPE_CHECKING:
    from m2r2.decoding.base import Loaded

KIND = "eagle"
FORMAT = "m2r2-eagle-head"
VERSION = 1
HEAD = weightfile.Kind(
    FORMAT,
    "EAGLE head",
    "an m2r2 EAGLE head config",
    "`m2r2 train-eagle`",
    f"no EAGLE head for this base model: train one with `m2r2 train-eagle` (it writes {DEFAULT_EAGLE}, "
    "read from there by default) or pass --option adapters=PATH",
)


@dataclass
class EagleConfig:
    """Shape of an EAGLE head: the base layer its decoder layer was copied from (the last one)."""

    num_base_layers: int
    hidden_size: int
    layer: int
    kind: str = KIND

    @classmethod
    def build(cls, num_layers: int, hidden_size: int) -> EagleConfig:
        return cls(num_layers, hidden_size, num_layers - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EagleConfig:
        try:
            return cls(int(d["num_base_layers"]), int(d["hidden_size"]), int(d["layer"]))
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsError(f"bad EAGLE head config {d}: {e}") from e


class EagleHead(DraftHead, nn.Module):
    """``fc`` + one decoder layer for a frozen base model held by reference (not a registered submodule).

    Biases stay the base layer's (frozen): the inference form runs each linear with its base layer's
    kernel, which takes the bias from there (:func:`m2r2.kernels.linear_like`).
    """

    def __init__(self, base: Transformer, cfg: EagleConfig) -> None:
        super().__init__()
        if (cfg.num_base_layers, cfg.hidden_size) != (base.cfg.num_layers, base.cfg.hidden_size):
            raise SettingsError(
                f"EAGLE head built for {cfg.num_base_layers} layers of width {cfg.hidden_size}, the model has "
                f"{base.cfg.num_layers} of width {base.cfg.hidden_size}"
            )
        if base.cfg.is_moe:
            raise SettingsError("EAGLE heads are for dense base models")
        self.cfg = cfg
        object.__setattr__(self, "base", base)
        d = cfg.hidden_size
        self.model_cfg = replace(base.cfg, num_layers=1)
        self.fc = nn.Linear(2 * d, d, bias=False)
        with torch.no_grad():  # start as h_N(t) + E(x_{t+1}), a residual the copied last layer can read
            self.fc.weight.copy_(torch.cat([torch.eye(d), torch.eye(d)], dim=1))
        self.layer = Block(self.model_cfg, 0)
        for name, p in self.layer.named_parameters():
            p.requires_grad_(not name.endswith("bias"))
        self.draft_vocab: Tensor | None = None
        self.sub_head: nn.Module | None = None
        self.fc_infer: nn.Module | None = None

    base: Transformer

    def copy_base(self) -> EagleHead:
        """Start the layer as the base's last layer (a float32 model with plain kernels)."""
        if self.base.dtype != torch.float32:
            raise SettingsError("an EAGLE head is copied from and trained on the float32 model (--dtype fp32)")
        with torch.no_grad():
            self.layer.load_state_dict(self.base.layers[self.cfg.layer].state_dict())
        return self

    def fuse(self, h: Tensor, tokens: Tensor) -> Tensor:
        """``fc([h, E(x)])``: features ``h`` ``[B, T, d]`` with the embeddings of ``tokens`` ``[B, T]``."""
        x = torch.cat([h, self.base.embed_tokens(tokens).to(h.dtype)], dim=-1)
        if self.fc_infer is not None:
            return self.fc_infer(x.to(self.base.dtype))
        return F.linear(x.to(self.fc.weight.dtype), self.fc.weight)

    def _mlp(self, x: Tensor, o: Tensor) -> Tensor:
        """The layer's residual adds after attention output ``o`` (``[B, H, T, D]``)."""
        blk = self.layer
        a = x + blk.attn.out(o)
        return a + blk.mlp(blk.mlp_norm(a), resid=a)

    # ---- training -------------------------------------------------------------------------------
    def forward_chain(self, tokens: Tensor, hidden: Tensor, steps: int) -> list[Tensor]:
        """Predicted features ``f_s`` ``[B, T, d]`` of draft depths ``s + 1 = 1..steps`` at every position.

        ``f_0(p)`` reads the true pairs ``(h_N(i), x_{i+1})``, ``i <= p``; depth ``s + 1`` at ``p`` reads
        ``(f_{s-1}(p-1), x_{p+1})`` and sees the true entries ``0..p-s`` and the deeper drafts' own
        entries of its chain, as a tree path at inference (:func:`chained_attention`). Every
        ``f_s(p)`` targets ``h_N(p+1)``.
        """
        base, blk = self.base, self.layer
        t = tokens.shape[1]
        cos, sin = base.rope(0, t, hidden.dtype)
        nxt = F.pad(tokens[:, 1:], (0, 1))  # x_{p+1} (the last position has none: masked out by the caller)
        feats, out, drafted = hidden, [], []
        for s in range(steps):
            x = self.fuse(feats, nxt)
            q, k, v = blk.attn.qkv(blk.attn_norm(x), cos, sin)
            if s == 0:
                true = (k, v)
                o = _causal(q, k, v)
            else:
                drafted.append((k, v))
                o = chained_attention(q, true, drafted)
            f = self._mlp(x, o)
            out.append(f)
            feats = F.pad(f, (0, 0, 1, 0))[:, :t]  # depth s + 2 at p reads f_s(p - 1)
        return out

    # ---- inference ------------------------------------------------------------------------------
    def freeze(self) -> EagleHead:
        """Inference form: no grad, the base's dtype, each linear in its base layer's kernel (4-bit under
        q4), ``fc`` and the draft head over the draft vocabulary with the base head's kernel."""
        self.eval().requires_grad_(False)
        src = self.base.layers[self.cfg.layer]
        for owner, attr in (("attn", "wqkv"), ("attn", "wo"), ("mlp", "w13"), ("mlp", "w2")):
            mine, theirs = getattr(self.layer, owner), getattr(src, owner)
            setattr(mine, attr, linear_like(getattr(theirs, attr), dense_weight(getattr(mine, attr))))
        for m in self.layer.modules():
            if isinstance(m, RMSNorm):
                m.to(self.base.dtype)
        self.fc_infer = linear_like(self.base.lm_head, self.fc.weight.detach().float())
        self.build_draft_head()
        return self


def _causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention over whole training sequences (right-padded: padding sees only what precedes it)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class EagleMemory:
    """One sequence's EAGLE cache: entries ``lo..fed-1`` hold the layer's K/V of verified pairs; ``pending``
    holds verified pairs not yet run (features ``[n, d]`` and their next tokens)."""

    def __init__(self, head: EagleHead, capacity: int, start: int = 0) -> None:
        base = head.base
        self.cache = KVCache(head.model_cfg, capacity, dtype=base.dtype, device=base.device)
        self.lo = self.fed = start
        self.pending: list[tuple[Tensor, list[int]]] = []

    @property
    def end(self) -> int:
        """Index of the next pair to observe."""
        return self.fed + sum(len(t) for _, t in self.pending)

    def forget(self, start: int) -> None:
        """A gap: nothing before ``start`` is known any more."""
        self.lo = self.fed = start
        self.pending = []


class EagleDrafter:
    """Tree levels from an EAGLE head, autoregressive on its own features: a node's step fuses its parent's
    predicted feature (the root: the last verified slow state) with its token, and attends the sequence's
    EAGLE cache plus its ancestors' entries in the tree. One memory per sequence, keyed by its slow cache."""

    layers_per_level = 1
    max_levels = 1 << 30

    def __init__(self, head: EagleHead) -> None:
        self.head = self.module = head
        self.memories: weakref.WeakKeyDictionary[KVCache, EagleMemory] = weakref.WeakKeyDictionary()

    def observe(self, cache: KVCache, feats: Tensor, tokens: list[int], first: int) -> None:
        """Verified pairs ``(h_N(i), x_{i+1})`` for ``i = first, first + 1, ...`` (``feats`` ``[n, d]``):
        the prompt's after the prefill (``first`` 0: a new sequence), each verify pass's accepted ones."""
        mem = self.memories.get(cache)
        if mem is None or first == 0:
            mem = self.memories[cache] = EagleMemory(self.head, cache.max_len, first)
        elif first != mem.end:
            mem.forget(first)
        if tokens:
            mem.pending.append((feats.reshape(len(tokens), -1), list(tokens)))

    def carry(self, old: KVCache, new: KVCache, upto: int) -> None:
        """A conversation's next turn copied ``old``'s first ``upto`` positions into ``new``: the memory's
        pairs before ``upto`` (whose next tokens the new prompt repeats) move along with them."""
        mem = self.memories.get(old)
        if mem is None or not mem.lo <= upto <= mem.end:
            return
        kept = EagleMemory(self.head, new.max_len, mem.lo)
        kept.fed = min(mem.fed, upto)
        kept.cache.take_prefix(mem.cache, kept.fed)
        need = upto - kept.fed
        for feats, tokens in mem.pending:
            if need <= 0:
                break
            kept.pending.append((feats[:need], tokens[:need]))
            need -= len(tokens[:need])
        self.memories[new] = kept

    def start(self, h_last: Tensor, cache: KVCache, verified: int) -> None:
        mem = self.memories.get(cache)
        root = max(verified - 1, 0)  # the root's entry: the pair (h_last, tok)
        if mem is None:
            mem = self.memories[cache] = EagleMemory(self.head, cache.max_len, root)
        elif mem.end != root:
            mem.forget(root)
        self.mem, self.root = mem, root
        self.seeds: dict[int, Tensor] = {-1: h_last.reshape(-1)}  # node -> the feature its children fuse
        self.kv: tuple[Tensor, Tensor] | None = None  # tree nodes' K/V so far (never in the cache)
        self.kv_rows: list[int] = []

    def _level(self, tree: Tree, frontier: list[int]) -> Tensor:
        head, mem = self.head, self.mem
        base, blk = head.base, head.layer
        dev = base.device
        start = mem.fed
        feats = [f for f, _ in mem.pending] + [torch.stack([self.seeds[tree.parents[r]] for r in frontier])]
        toks = [t for _, ts in mem.pending for t in ts]
        p = len(toks)  # verified pairs caught up in this pass (the first level of a round)
        toks += [tree.tokens[r] for r in frontier]
        positions = torch.tensor(
            [*range(start, start + p), *(self.root + tree.depths[r] for r in frontier)], device=dev
        )
        x = head.fuse(torch.cat([f.to(base.dtype) for f in feats])[None], torch.tensor([toks], device=dev))
        cos, sin = base.rope_cos[positions].to(base.dtype), base.rope_sin[positions].to(base.dtype)
        q, k, v = blk.attn.qkv(blk.attn_norm(x), cos, sin)
        if p:
            mem.cache.write(0, start, k[:, :, :p], v[:, :, :p])
            mem.fed, mem.pending = start + p, []
        tk, tv = k[:, :, p:], v[:, :, p:]
        if self.kv is not None:
            tk, tv = torch.cat([self.kv[0], tk], dim=2), torch.cat([self.kv[1], tv], dim=2)
        self.kv = (tk, tv)
        rows = self.kv_rows + frontier
        self.kv_rows = rows
        fed = mem.fed
        slot = torch.arange(fed)
        mask = torch.zeros(p + len(frontier), fed + len(rows), dtype=torch.bool)
        mask[:p, :fed] = (slot[None] <= torch.arange(start, fed)[:, None]) & (slot >= mem.lo)[None]
        mask[p:, mem.lo : fed] = True
        mask[p:, fed:] = tree.ancestors(rows)[len(rows) - len(frontier) :]
        ck, cv = mem.cache.view(0, fed)
        o = F.scaled_dot_product_attention(
            q, torch.cat([ck, tk], dim=2), torch.cat([cv, tv], dim=2), attn_mask=mask.to(dev), enable_gqa=True
        )
        f = head._mlp(x, o)[0, p:]
        self.seeds.update(zip(frontier, f, strict=True))
        return f

    def top(self, tree: Tree, frontier: list[int], k: int) -> tuple[Tensor, Tensor]:
        return self.head.draft_top(self._level(tree, frontier), k)

    def logits(self, tree: Tree, frontier: list[int]) -> Tensor:
        return self.head.draft_logits(self._level(tree, frontier))


def save_head(path: Path, head: EagleHead, fingerprint: str, dtype: torch.dtype = torch.bfloat16, **info: Any) -> Path:
    """Write the head (in ``dtype``) then the JSON sidecar; ``info`` lands in the JSON (training, validation)."""
    sd, dtype_name = weights_of(head, dtype), str(dtype).removeprefix("torch.")
    return weightfile.save(path, sd, HEAD, fingerprint, VERSION, head.cfg.to_dict(), dtype=dtype_name, **info)


def load_head(path: Path, model: Transformer, fingerprint: str) -> EagleHead:
    """An EAGLE head for ``model`` from a head file, after the fingerprint and checksum checks."""
    sd, meta = weightfile.load(path, HEAD, fingerprint)
    return with_weights(EagleHead(model, EagleConfig.from_dict(meta["config"])), sd, path)


def is_head_file(path: Path) -> bool:
    """Whether ``path`` names an EAGLE head (by its sidecar; any other file is someone else's to judge)."""
    return weightfile.is_kind(path, HEAD)


@register(
    "eagle",
    "baseline: EAGLE-style feature head (one decoder layer on its own KV cache) drafts token trees, "
    "verified as m2r2's (lossless)",
)
def _eagle(
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
    """The same tree verifier and settings as ``m2r2`` and ``medusa``; only the drafter differs."""
    given = Path(adapters) if adapters else None
    path = weightfile.given_or_shipped(given, HEAD, engine.fingerprint, DEFAULT_EAGLE)
    head = load_head(path, engine.model, engine.fingerprint).to(engine.model.device).freeze()
    tree = (max_nodes, max_depth, width, branch, lookup)
    return build_tree_speculative("eagle", engine, EagleDrafter(head), adaptive, cost_cache, *tree, answers=answers)
