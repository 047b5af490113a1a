"""``two-model``: 2-model speculative decoding (Leviathan et al.; Chen et al.), verified by the same loop.

A separate draft model with its *own* KV cache proposes tokens autoregressively; the target verifies
them in one pass of :class:`m2r2.decoding.speculative.SelfSpeculative` (the loop of ``m2r2``'s
chains: greedy output bit-identical to ``vanilla``, sampling exact). The draft cache is kept in step
with what the target verified (:class:`ModelDrafter`): positions holding rejected drafts are rolled
back, and tokens the draft model has not seen yet (the prompt, the last accepted draft, the
target's own token) are fed as extra rows of the next block's first draft step.

Two kinds of draft model:

* :class:`SmallDraft`, for a base without a smaller sibling (SmolLM2-135M): the base's embedding,
  copies of its first layers (trained: ``m2r2 train-draft`` distils the full model's next-token
  distribution from a training store), a final norm and the base's LM head over the stored draft
  vocabulary. Only the layers and the norm are stored (safetensors + JSON bound to the base model's
  fingerprint); embedding and head are the base's own tensors.
* any model with the same tokenizer (``--option draft=NAME_OR_PATH``, e.g. Qwen2.5-Coder-0.5B for
  the 1.5B), loaded in the target's precision (:class:`FullDraft`). By default it scores the same draft
  vocabulary as M2R2's shipped adapters for the target (``draft_vocab``): Qwen2.5-Coder-0.5B's
  151,936-token head is read at every draft step and cost about as much as its 24 layers, so a
  step of the full 0.5B cost 0.46 of a 1.5B step and the cost model never drafted with it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m2r2 import weightfile
from m2r2.cache import KVCache
from m2r2.decoding import register
from m2r2.decoding.costs import cached_costs, cost_cache_path, measure_costs
from m2r2.decoding.speculative import Drafter, SelfSpeculative
from m2r2.errors import InputError, SettingsError, WeightsError
from m2r2.kernels import dense_weight, linear_like, widen_logits
from m2r2.model import Block, RMSNorm, Transformer, attend
from m2r2.paths import DEFAULT_DRAFT

if TYPE_CHECKING:
    from m2r2.decoding.base import Loaded

DRAFT = weightfile.Kind(
    "m2r2-draft-model",
    "draft model",
    "an m2r2 draft-model config",
    "`m2r2 train-draft`",
    "no draft model ships for this base model; train one with `m2r2 train-draft` and pass "
    "--option draft=PATH (or a smaller model with the same tokenizer)",
)
VERSION = 1


@dataclass
class DraftConfig:
    """Shape of a small draft model: the base layers its blocks were copied from (then trained)."""

    num_base_layers: int
    layers: list[int]
    kind: str = "small-draft"

    @classmethod
    def build(cls, num_layers: int, depth: int = 2) -> DraftConfig:
        if not 1 <= depth <= num_layers:
            raise SettingsError(f"draft model depth must be in 1..{num_layers}, got {depth}")
        return cls(num_layers, list(range(depth)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftConfig:
        try:
            return cls(int(d["num_base_layers"]), [int(i) for i in d["layers"]])
        except (KeyError, TypeError, ValueError) as e:
            raise SettingsError(f"bad draft-model config {d}: {e}") from e


class DraftModel(Protocol):
    """What :class:`ModelDrafter` needs of a draft model."""

    num_layers: int

    def new_cache(self, max_len: int) -> KVCache: ...

    def run(self, tokens: Tensor, cache: KVCache, pos: int) -> Tensor:
        """Final states ``[1, n, d]`` of ``tokens`` ``[1, n]`` written at cache positions ``pos..``."""

    def logits(self, h: Tensor) -> Tensor:
        """Float32 logits over the target's vocabulary (``-inf`` where the draft cannot propose)."""


class SmallDraft(nn.Module):
    """Embedding + copies of the base's first layers + a final norm + the base's LM head.

    The base is held by reference (not registered), so ``state_dict`` and the optimiser see only the
    copied layers and the norm. Biases stay the base's (frozen): the inference form runs each layer
    with its base layer's kernel, which takes the bias from there (:func:`m2r2.kernels.linear_like`).
    """

    def __init__(self, base: Transformer, cfg: DraftConfig) -> None:
        super().__init__()
        if cfg.num_base_layers != base.cfg.num_layers:
            raise SettingsError(
                f"draft built for {cfg.num_base_layers} base layers, the model has {base.cfg.num_layers}"
            )
        if base.cfg.is_moe:
            raise SettingsError("small draft models are for dense base models")
        self.cfg = cfg
        object.__setattr__(self, "base", base)
        self.model_cfg = replace(base.cfg, num_layers=len(cfg.layers))
        self.layers = nn.ModuleList(Block(self.model_cfg, i) for i in range(len(cfg.layers)))
        self.norm = RMSNorm(base.cfg.hidden_size, base.cfg.rms_norm_eps)
        for name, p in self.named_parameters():
            p.requires_grad_(not name.endswith("bias"))
        self.draft_vocab: Tensor | None = None
        self.sub_head: nn.Module | None = None

    base: Transformer

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def copy_base(self) -> SmallDraft:
        """Start from the base's own layers and final norm (a float32 model with plain kernels)."""
        if self.base.dtype != torch.float32:
            raise SettingsError("a draft model is copied from and trained on the float32 model (--dtype fp32)")
        with torch.no_grad():
            for blk, i in zip(self.layers, self.cfg.layers, strict=True):
                blk.load_state_dict(self.base.layers[i].state_dict())
            self.norm.load_state_dict(self.base.norm.state_dict())
        return self

    def head_weight(self) -> Tensor:
        """Rows of the LM head the draft scores (the draft vocabulary, else all)."""
        head = self.base.lm_head
        w = head.weight if isinstance(head, nn.Linear) else dense_weight(head)
        return w if self.draft_vocab is None else w[self.draft_vocab.to(w.device)]

    # ---- training ---------------------------------------------------------------------------------
    def forward_train(self, tokens: Tensor) -> Tensor:
        """Final states ``[B, T, d]`` of whole sequences (causal, no cache: what :meth:`run` computes)."""
        base = self.base
        x = base.embed_tokens(tokens)
        t = tokens.shape[1]
        cos, sin = base.rope(0, t, x.dtype)
        mask = base.causal_mask(0, t, t)
        for blk in self.layers:
            q, k, v = blk.attn.qkv(blk.attn_norm(x), cos, sin)
            a = x + blk.attn.out(attend(q, k, v, mask))
            x = a + blk.mlp(blk.mlp_norm(a), resid=a)
        return x

    # ---- inference --------------------------------------------------------------------------------
    def freeze(self) -> SmallDraft:
        """Inference form: no grad, the base's dtype, each linear in its base layer's kernel (4-bit under
        q4), the head over the draft vocabulary with the base head's kernel."""
        self.eval().requires_grad_(False)
        dtype = self.base.dtype
        for blk, i in zip(self.layers, self.cfg.layers, strict=True):
            src = self.base.layers[i]
            for owner, attr in (("attn", "wqkv"), ("attn", "wo"), ("mlp", "w13"), ("mlp", "w2")):
                mine, theirs = getattr(blk, owner), getattr(src, owner)
                setattr(mine, attr, linear_like(getattr(theirs, attr), dense_weight(getattr(mine, attr))))
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.to(dtype)
        head = self.base.lm_head  # over the whole vocabulary the base's own head serves
        rows = None if self.draft_vocab is None else dense_weight(head)[self.draft_vocab.to(self.base.device)]
        object.__setattr__(self, "sub_head", head if rows is None else linear_like(head, rows))
        return self

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.model_cfg, max_len, dtype=self.base.dtype, device=self.base.device)

    def run(self, tokens: Tensor, cache: KVCache, pos: int) -> Tensor:
        base = self.base
        x = base.embed_tokens(tokens)
        n = tokens.shape[1]
        cos, sin = base.rope(pos, n, x.dtype)
        mask = base.causal_mask(pos, n, cache.max_len)
        for i, blk in enumerate(self.layers):
            x = blk(x, cos, sin, cache, i, pos, mask)
        cache.length = pos + n
        return x

    def logits(self, h: Tensor) -> Tensor:
        if self.sub_head is None:
            return F.linear(self.norm(h), self.head_weight().to(h.dtype)).float()
        sub = self.sub_head(self.norm(h)).float()
        return sub if self.draft_vocab is None else widen_logits(sub, self.draft_vocab, self.base.cfg.vocab_size)


class FullDraft:
    """A separate model with the target's tokenizer (e.g. a smaller sibling) as the draft model, scoring
    the whole vocabulary or only ``draft_vocab`` (its head's rows for those ids, in the head's kernel)."""

    def __init__(self, model: Transformer, vocab_size: int, draft_vocab: Tensor | None = None) -> None:
        self.model, self.vocab_size = model, vocab_size
        self.num_layers = model.cfg.num_layers
        self.cfg = model.cfg  # for the cost cache's key (the drafter's shape)
        self.draft_vocab = self.sub_head = None  # the cost cache's key reads both
        if draft_vocab is not None:
            head = model.lm_head
            self.draft_vocab = draft_vocab.to(model.device)
            self.sub_head = linear_like(head, dense_weight(head)[self.draft_vocab])

    def new_cache(self, max_len: int) -> KVCache:
        return self.model.new_cache(max_len)

    def run(self, tokens: Tensor, cache: KVCache, pos: int) -> Tensor:
        return self.model.run_layers(self.model.embed_tokens(tokens), cache, pos)

    def logits(self, h: Tensor) -> Tensor:
        """The draft's logits cut or padded (``-inf``) to the target's vocabulary (padded embedding rows
        differ), ``-inf`` outside the draft vocabulary."""
        if self.sub_head is not None:
            return widen_logits(self.sub_head(self.model.norm(h)).float(), self.draft_vocab, self.vocab_size)
        out = self.model.head(h)[..., : self.vocab_size]
        return F.pad(out, (0, self.vocab_size - out.shape[-1]), value=float("-inf"))


class ModelDrafter:
    """Drafts with a draft model on its own KV cache, kept in step with the verified tokens.

    ``fed`` is the token at each position of the draft cache. At the start of a block the cache is
    cut back to the longest prefix that matches the verified tokens (rejected drafts go); the first
    draft step then feeds every verified token it lacks plus the block's root token in one pass.
    """

    def __init__(self, draft: DraftModel, capacity: int) -> None:
        self.draft = draft
        self.cache = draft.new_cache(capacity)
        self.layers_per_step = draft.num_layers
        self.context: list[int] = []  # verified tokens, from observe()
        self.fed: list[int] = []
        self.good = 0  # positions known to hold verified tokens

    def observe(self, tokens: list[int]) -> None:
        self.context += tokens

    def start(self, verified_len: int) -> None:
        if verified_len != len(self.context):
            raise InputError(f"draft model out of step: {len(self.context)} tokens observed, {verified_len} verified")
        k, end = self.good, min(len(self.fed), verified_len)
        while k < end and self.fed[k] == self.context[k]:
            k += 1
        self.good = k
        del self.fed[k:]
        self.cache.truncate(k)

    def step(self, token: int) -> tuple[Tensor, float | None]:
        rows = [*self.context[len(self.fed) :], token]
        device = self.cache.k.device
        h = self.draft.run(torch.tensor([rows], device=device), self.cache, len(self.fed))
        self.fed += rows
        logits = self.draft.logits(h[:, -1:])[0, -1]
        return logits, float(torch.softmax(logits, -1).max())


# ---- files ----------------------------------------------------------------------------------------
def save_draft(
    path: Path, draft: SmallDraft, fingerprint: str, dtype: torch.dtype = torch.bfloat16, **info: Any
) -> Path:
    """Write the draft's layers and norm (in ``dtype``) and its draft vocabulary, bound to the base model."""
    sd = {k: v.detach().to(dtype).contiguous() for k, v in draft.state_dict().items()}
    if draft.draft_vocab is not None:
        sd["draft_vocab"] = draft.draft_vocab.to(torch.int32).cpu().contiguous()
    name = str(dtype).removeprefix("torch.")
    return weightfile.save(path, sd, DRAFT, fingerprint, VERSION, draft.cfg.to_dict(), dtype=name, **info)


def load_draft(path: Path, base: Transformer, fingerprint: str) -> SmallDraft:
    """A :class:`SmallDraft` for ``base`` from a draft-model file, after the fingerprint and checksum checks."""
    from m2r2.multirate.io import check_vocab

    sd, meta = weightfile.load(path, DRAFT, fingerprint)
    draft = SmallDraft(base, DraftConfig.from_dict(meta["config"]))
    vocab = sd.pop("draft_vocab", None)
    expected = draft.state_dict()
    if set(sd) != set(expected) or any(sd[k].shape != expected[k].shape for k in sd):
        raise WeightsError(f"draft-model weights {path} do not match their config {meta['config']}")
    draft.load_state_dict({k: v.float() for k, v in sd.items()})
    if vocab is not None:
        draft.draft_vocab = check_vocab(vocab, base.cfg.vocab_size, path)
    return draft


def default_draft(engine: Loaded) -> str | Path:
    """What ``two-model`` drafts with when no ``draft`` is given: the draft-model file shipped for this
    base model, else its bundled sibling (``BundledModel.draft``: Qwen2.5-Coder-0.5B for the 1.5B), else a
    fresh ``m2r2 train-draft`` run's default output; a one-line error if none is there."""
    from m2r2.loading import BUNDLED, bundled_gguf, bundled_name

    if shipped := weightfile.bundled(DRAFT, engine.fingerprint):
        return shipped
    name = bundled_name(engine.model_dir)
    sibling = BUNDLED[name].draft if name else None
    if sibling is None:
        return weightfile.given_or_shipped(None, DRAFT, engine.fingerprint, DEFAULT_DRAFT)
    try:
        bundled_gguf(sibling)  # its parts installed? (checked before anything loads)
    except WeightsError as e:
        raise WeightsError(f"two-model drafts for {name} with {sibling} unless given --option draft=...; {e}") from None
    return sibling


def draft_vocab_for(engine: Loaded, spec: str | None) -> Tensor | None:
    """The draft vocabulary a full draft model scores: ``spec`` names an adapter file carrying one,
    ``"none"`` the whole vocabulary; None = that of M2R2's shipped adapters for the target (if any)."""
    from m2r2.multirate.io import bundled_adapters, read_draft_vocab

    if spec is not None and spec.lower() == "none":
        return None
    path = Path(spec) if spec else bundled_adapters(engine.fingerprint, None)
    if path is None:
        return None
    if not weightfile.weights_path(path).is_file():
        raise InputError(f"draft_vocab: no adapter file {path}")
    return read_draft_vocab(path, engine.model.cfg.vocab_size)


def draft_for(engine: Loaded, spec: str | None, vocab: str | None = None) -> DraftModel:
    """The draft model ``spec`` names: a draft-model file, else a model with the target's tokenizer (a
    bundled name, a .gguf or an HF directory; scoring :func:`draft_vocab_for` ``vocab``); None =
    :func:`default_draft`."""
    spec = str(spec or default_draft(engine))
    if Path(spec).suffix in (".safetensors", ".json"):
        if vocab is not None:
            raise SettingsError("draft_vocab is for a separate model; a draft-model file keeps its own vocabulary")
        return load_draft(Path(spec), engine.model, engine.fingerprint).to(engine.model.device).freeze()
    from m2r2.loading import load_model, parse_dtype, resolve_model
    from m2r2.tokenizer import ChatTokenizer

    model_dir = resolve_model(spec, quiet=True)
    if ChatTokenizer(model_dir).hf.get_vocab() != engine.tokenizer.hf.get_vocab():
        raise SettingsError(
            f"draft model {spec} has another tokenizer than the target; 2-model drafting needs the same"
        )
    ids = draft_vocab_for(engine, vocab)  # checked before the draft model loads
    kernel = "plain" if engine.dtype_name == "fp32" else "auto"
    draft = load_model(model_dir, parse_dtype(engine.dtype_name), engine.device, kernel=kernel).model
    return FullDraft(draft, engine.model.cfg.vocab_size, ids)


@register(
    "two-model",
    "2-model speculative decoding (lossless): a separate draft model with its own KV cache drafts, the model "
    "verifies; option draft=FILE (`m2r2 train-draft`) or a model with the same tokenizer (draft_vocab=FILE|none: "
    "the draft vocabulary it scores, default that of the target's shipped M2R2 adapters)",
)
def _two_model(
    engine: Loaded,
    draft: str | None = None,
    draft_vocab: str | None = None,
    max_draft: int = 8,
    stop_below: float = 0.2,
    adaptive: bool = True,
    cost_cache: bool = True,
) -> SelfSpeculative:
    model = draft_for(engine, draft, draft_vocab)

    def make(cache: object) -> Drafter:
        return ModelDrafter(model, cache.max_len)  # type: ignore[attr-defined]

    costs = None
    if adaptive:

        def measure() -> Any:
            return measure_costs(engine.model, make, max_draft)

        path = cost_cache_path(engine, model, max_draft)  # type: ignore[arg-type]
        costs = cached_costs(path.with_name(f"two-model-{path.name}"), measure) if cost_cache else measure()
    tok = engine.tokenizer
    return SelfSpeculative("two-model", engine.model, make, tok.eos_ids, tok.decode, max_draft, stop_below, costs)
