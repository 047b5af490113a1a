"""Training drafters from a training store (base model never run during training): the seeded fast
stream and, on the same loop, Medusa heads (:mod:`m2r2.decoding.medusa`).

One loop (:func:`train_on_store`) serves both: data, batching, schedule, checkpoints, resume and
validation are shared; a :class:`Trainee` brings the module, its losses and its file. Targets are
always the full model's distribution ``p_N(p) = softmax(W . Norm(h_N(p)))`` over the draft vocabulary
(the store holds ``h_N``, so a target costs one draft-vocabulary head).

Seeded fast stream, per step: a batch of whole sequences from the store (their slow ``h_N`` and the
slow K/V of the fast layers' base layers); the fast stream drafts ``chain`` steps at every position
at once (:meth:`SeededFastStream.forward_chain`: step s is seeded by step s-1's own state, so drafts
2..s see at training what they see at inference). Losses at every valid position and step:

* ``CE(p_N, q)`` over the draft vocabulary;
* alignment: smooth-L1 of ``(f_K - h_N(p)) / rms(h_N(p))`` (the fast state should *be* the slow one);
* ARLA: BCE on detached states, label = the draft's top-1 equals the full model's top-1.

With ``copy_w`` < 1 the CE and alignment terms weigh positions a copy source already drafts right
(:mod:`m2r2.training.copy_weights`) by ``copy_w``.

Medusa heads: head i at position t drafts the token after position ``t + i`` from ``h_N(t)`` alone;
loss ``CE(p_N(t + i), q_i(t))`` averaged over heads (the store's K/V is not even read).

Data order is a function of ``(seed, step)``; checkpoints are atomic and a resumed run continues
bit-for-bit on the same store. Validation agreement per draft step (or head) is measured on store
sequences held out of training (the first ``holdout`` sequences of the first store).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from m2r2.decoding.medusa import MedusaConfig, MedusaHeads
from m2r2.errors import SettingsError
from m2r2.model import Transformer
from m2r2.multirate.seeded import SeededConfig, SeededFastStream
from m2r2.training.checkpoint import load_checkpoint, save_checkpoint
from m2r2.training.copy_weights import copy_weigher
from m2r2.training.store import TrainStore, store_digest

#: what training teaches where the full model's top-1 lies outside the draft vocabulary (:func:`chain_losses`)
OOV_TARGETS = ("renorm", "flat")


@dataclass
class StoreTrainSettings:
    """What every drafter trained from a store shares (data, schedule, checkpoints)."""

    store: Path
    out: Path
    steps: int = 100000
    minutes: float = 0.0
    batch: int = 16  # sequences per step
    lr: float = 2e-3
    warmup: int = 20
    seed: int = 0
    ckpt_minutes: float = 5.0
    resume: bool = False
    holdout: int = 48
    #: bf16 autocast for the drafter's matmuls (parameters and optimizer stay float32): on a CPU with
    #: AMX the step runs several times faster (docs/TRAINING.md); off = float32 throughout
    bf16: bool = False
    #: adapters to start from (an earlier run's, e.g. before the store grew): matching tensors are copied
    init: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["store"], d["out"] = str(self.store), str(self.out)
        return d


@dataclass
class SeededTrainSettings(StoreTrainSettings):
    depth: int = 1
    rank: int = 32
    chain: int = 3  # draft steps trained at each position (train-time drafting)
    attention_only: bool = False  # layers grown onto --init run attention but no FFN
    taps: list[int] = field(default_factory=list)  # base layers whose outputs join the seed (the store's)
    #: base layers whose outputs at the drafted token's own position join the seed (the store's taps)
    token_taps: list[int] = field(default_factory=list)
    align_w: float = 0.5
    arla_w: float = 0.1
    #: weight of a hard cross-entropy on the full model's top-1 token (over the draft vocabulary) beside the
    #: soft one: greedy verification accepts only the top-1, the soft target also spends capacity on the tail
    top1_w: float = 0.0
    #: loss weight of positions where prompt lookup or the answer store proposes the next token (1 = all alike)
    copy_w: float = 1.0
    #: the answer store those positions are judged with (None: the one shipped for the base model)
    copy_answers: str | None = None
    #: what a position whose full-model top-1 lies outside the draft vocabulary teaches: "renorm" (the
    #: model's distribution over the draft vocabulary, renormalized, as before) or "flat" (no token: a
    #: uniform target and no top-1 term; ARLA counts a draft there as a miss, as verification does)
    oov: str = "renorm"


@dataclass
class MedusaTrainSettings(StoreTrainSettings):
    heads: int = 4


@dataclass
class Trainee:
    """One kind of drafter trained by :func:`train_on_store`: what it adds to the shared loop."""

    module: nn.Module  # trained and saved; has ``cfg`` (``to_dict``) and ``draft_vocab``
    #: batch -> ``loss`` (to minimise), ``agree``/``counts`` (top-1 agreement and positions per draft
    #: step or head) and any other scalar tensors to log
    losses: Callable[[dict[str, Tensor]], dict[str, Any]]
    save: Callable[..., Path]  # (path, fingerprint, **info): the module's file
    load: Callable[[Path, str], nn.Module]  # (path, fingerprint): a file of this kind (--init)
    file: str = "adapters.safetensors"  # written into --out
    kv_layers: list[int] = field(default_factory=list)  # base layers whose slow K/V each batch carries
    #: loads an --init module into ``module``; None: it must be of the same type and shape
    adopt: Callable[[nn.Module], None] | None = None
    #: base layers whose outputs each batch carries, in this order (a store may hold more)
    taps: list[int] = field(default_factory=list)
    #: a sequence's tokens -> its per-position loss weights (None: every position weighs 1)
    weigh: Callable[[list[int]], Tensor] | None = None


def pad_batch(
    seqs: list[dict[str, Tensor]], depth: int, taps: bool = False, device: torch.device | None = None
) -> dict[str, Tensor]:
    """Right-pad store sequences to one length; ``valid`` marks real positions; K/V of the last ``depth``
    stored layers (none for 0); with ``taps``, the stored tap layers' outputs; the sequences' loss
    ``weight`` where they carry one. On ``device`` (the trainee's: the store is read into host memory, a GPU
    run moves each batch over)."""
    t = max(len(s["tokens"]) for s in seqs)
    b = len(seqs)
    tokens = torch.zeros(b, t, dtype=torch.long)
    valid = torch.zeros(b, t, dtype=torch.bool)
    d = seqs[0]["hidden"].shape[-1]
    hidden = torch.zeros(b, t, d)
    out = {"tokens": tokens, "valid": valid, "hidden": hidden}
    if taps:
        out["taps"] = torch.zeros(b, t, *seqs[0]["taps"].shape[1:])
    if "weight" in seqs[0]:
        out["weight"] = torch.zeros(b, t)
    if depth:
        kv_shape = seqs[0]["k"].shape  # [L, n, KVH, D]
        out["k"] = torch.zeros(depth, b, kv_shape[2], t, kv_shape[3])
        out["v"] = torch.zeros_like(out["k"])
    for i, s in enumerate(seqs):
        n = len(s["tokens"])
        tokens[i, :n], valid[i, :n] = s["tokens"], True
        hidden[i, :n] = s["hidden"].float()
        if taps:
            out["taps"][i, :n] = s["taps"].float()
        if "weight" in out:
            out["weight"][i, :n] = s["weight"]
        if depth:
            out["k"][:, i, :, :n] = s["k"][-depth:].float().transpose(1, 2)
            out["v"][:, i, :, :n] = s["v"][-depth:].float().transpose(1, 2)
    return out if device is None else {k: v.to(device, non_blocking=True) for k, v in out.items()}


def _mean(x: Tensor, m: Tensor, w: Tensor | None = None) -> Tensor:
    """Mean of ``x`` over the mask ``m``, weighted by ``w`` if given (0 where ``m`` is empty: no position
    to learn from)."""
    if w is None:
        return x[m].sum() / max(int(m.sum()), 1)
    return (x * w)[m].sum() / w[m].sum().clamp_min(1e-6)


def targets(module: nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The draft-vocabulary head rows and the full model's distribution and top-1 at every position."""
    w = module.head_weight().float()
    with torch.no_grad():
        target = F.linear(module.base.norm(hidden), w)
    return w, target.softmax(-1), target.argmax(-1)


@torch.no_grad()
def exact_top(module: nn.Module, hidden: Tensor, top: Tensor) -> Tensor:
    """``top`` (draft-vocabulary indices) where it is also the full model's top-1 over its whole vocabulary,
    else -1, which no draft matches: agreement counted against the token the model really picks, as the
    speculative loop counts it. Over the draft vocabulary alone, the positions whose token lies outside it
    (~14% of SmolLM2's MT-Bench answer tokens with 4,096 rows) would count whenever the stream picks the
    runner-up the model scores best inside it."""
    if module.draft_vocab is None:
        return top
    full = F.linear(module.base.norm(hidden), module.head_weight(full=True).float()).argmax(-1)
    return torch.where(module.draft_vocab.to(top.device)[top] == full, top, -1)


def chain_losses(
    stream: SeededFastStream, batch: dict[str, Tensor], chain: int, exact: bool = False, oov: str = "renorm"
) -> dict[str, Any]:
    """Losses and per-step top-1 agreement (over the draft vocabulary) of one batch; with ``exact``, also
    ``agree_exact``: agreement with the full model's own top-1 (:func:`exact_top`).

    With ``oov="flat"``, a position whose full-model top-1 lies outside the draft vocabulary (~14% of
    SmolLM2's MT-Bench answer tokens with 4,096 rows) teaches no token: its soft target is uniform, it
    has no hard top-1 term, and ARLA learns a draft there as a miss. Why: verification rejects every
    draft there, yet the renormalized target can point confidently at the model's runner-up inside the
    vocabulary, and the tree spends rows on such confident drafts."""
    hidden, valid, weight = batch["hidden"], batch["valid"], batch.get("weight")
    w, p, top = targets(stream, hidden)
    top_exact = exact_top(stream, hidden, top) if exact or oov == "flat" else None
    hit_target, top1_mask = top, valid
    if oov == "flat":
        outside = top_exact < 0
        p = torch.where(outside[..., None], torch.full_like(p, 1.0 / p.shape[-1]), p)
        hit_target, top1_mask = top_exact, valid & ~outside
    out = stream.forward_chain(batch["tokens"], hidden, batch["k"], batch["v"], chain, batch.get("taps"))
    pos = torch.arange(hidden.shape[1], device=hidden.device)
    rms = hidden.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-3)
    ce = hard = align = arla = hidden.new_zeros(())
    agree, counts, agree_exact = [], [], []
    for s, states in enumerate(out, start=1):
        m = valid & (pos >= s)[None, :]
        f = states[-1]
        logits = F.linear(stream.base.norm(f), w)
        logp = logits.log_softmax(-1)
        ce = ce + _mean(-(p * logp).sum(-1), m, weight)
        hard = hard + _mean(-logp.gather(-1, top[..., None])[..., 0], m & top1_mask, weight)
        dist = F.smooth_l1_loss((f - hidden) / rms, torch.zeros_like(f), reduction="none").mean(-1)
        align = align + _mean(dist, m, weight)
        picks = logits.argmax(-1)
        hit = picks == top
        counts.append(int(m.sum()))
        agree.append(int(hit[m].sum()) / max(counts[-1], 1))
        if exact:
            agree_exact.append(int((picks == top_exact)[m].sum()) / max(counts[-1], 1))
        z = stream.arla([x.detach() for x in states], stream.cfg.depth)
        arla = arla + F.binary_cross_entropy_with_logits(z[m], (picks == hit_target)[m].float())
    means = {"ce": ce / chain, "top1": hard / chain, "align": align / chain, "arla": arla / chain}
    return {**means, "agree": agree, "counts": counts} | ({"agree_exact": agree_exact} if exact else {})


def medusa_losses(heads: MedusaHeads, batch: dict[str, Tensor]) -> dict[str, Any]:
    """CE of each head against the full model's distribution ``i`` positions later, and its agreement."""
    hidden, valid = batch["hidden"], batch["valid"]
    w, p, top = targets(heads, hidden)
    t = hidden.shape[1]
    ce = hidden.new_zeros(())
    agree, counts = [], []
    for i in range(heads.cfg.heads):
        off = i + 1  # head i at position t predicts what the full model predicts at t + off
        n = max(t - off, 0)
        m = valid[:, :n] & valid[:, off:]
        logits = F.linear(heads.base.norm(heads.state(hidden[:, :n], i)), w)
        ce = ce + _mean(-(p[:, off:] * logits.log_softmax(-1)).sum(-1), m)
        counts.append(int(m.sum()))
        agree.append(int(((logits.argmax(-1) == top[:, off:]) & m).sum()) / max(counts[-1], 1))
    ce = ce / heads.cfg.heads
    return {"loss": ce, "ce": ce, "agree": agree, "counts": counts}


#: steps of a run timed before its wall-clock budget fixes the schedule's horizon (:func:`time_horizon`)
HORIZON_PROBE = 8


def _lr(step: int, s: StoreTrainSettings, horizon: int) -> float:
    """Linear warm-up, then a cosine from ``s.lr`` to a tenth of it at step ``horizon``."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    frac = min(1.0, (step - s.warmup) / max(1, horizon - s.warmup))
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def time_horizon(step: int, steps_timed: int, elapsed: float, minutes: float, steps: int) -> int:
    """The step at which a run with a wall-clock budget will stop, from its measured step time.

    Without it a run stopped by ``--minutes`` long before ``--steps`` (100,000 by default) kept the
    learning rate at its peak to the end: the cosine never decayed (the shipped SmolLM2 stream's runs until
    the 24th round).
    """
    per_step = elapsed / max(1, steps_timed)
    return max(step + 1, min(steps, step + int((minutes * 60 - elapsed) / per_step)))


def seeded_trainee(
    stream: SeededFastStream,
    chain: int,
    align_w: float = 0.5,
    arla_w: float = 0.1,
    top1_w: float = 0.0,
    weigh: Callable[[list[int]], Tensor] | None = None,
    oov: str = "renorm",
) -> Trainee:
    from m2r2.multirate.io import load_adapters, save_adapters

    def losses(batch: dict[str, Tensor], exact: bool = False) -> dict[str, Any]:
        out = chain_losses(stream, batch, chain, exact, oov)
        loss = out["ce"] + top1_w * out["top1"] + align_w * out["align"] + arla_w * out["arla"]
        return {"loss": loss, **out}

    return Trainee(
        stream,
        losses,
        lambda path, fp, **info: save_adapters(path, stream, fp, torch.bfloat16, **info),
        lambda path, fp: load_adapters(path, stream.base, fp),
        kv_layers=stream.cfg.layers,
        adopt=stream.adopt,
        taps=stream.cfg.taps + stream.cfg.token_taps,
        weigh=weigh,
    )


def medusa_trainee(heads: MedusaHeads) -> Trainee:
    from m2r2.decoding.medusa import load_heads, save_heads

    return Trainee(
        heads,
        lambda batch: medusa_losses(heads, batch),
        lambda path, fp, **info: save_heads(path, heads, fp, torch.bfloat16, **info),
        lambda path, fp: load_heads(path, heads.base, fp),
        file="heads.safetensors",
    )


def train_seeded(
    base: Transformer,
    fingerprint: str,
    s: SeededTrainSettings,
    draft_vocab: Tensor | None,
    log: Callable[[dict[str, Any]], None] | None = None,
) -> SeededFastStream:
    """Train (or resume) a seeded fast stream on the store at ``s.store``; writes checkpoints and adapters."""
    if s.chain < 1 or s.depth < 1:
        raise SettingsError("chain and depth must be >= 1")
    if min(s.align_w, s.arla_w, s.top1_w) < 0:
        raise SettingsError("loss weights (--align-w, --top1-w) must be >= 0")
    if not 0 < s.copy_w <= 1:
        raise SettingsError(f"--copy-w must be in (0, 1], got {s.copy_w}")
    if s.oov not in OOV_TARGETS:
        raise SettingsError(f"--oov must be one of {', '.join(OOV_TARGETS)}, got {s.oov!r}")
    gated, attention_only = grown_layers(s)
    cfg = SeededConfig.build(
        base.cfg.num_layers,
        s.depth,
        s.rank,
        gated=gated,
        attention_only=attention_only,
        taps=s.taps,
        token_taps=s.token_taps,
    )
    stream = SeededFastStream(base, cfg)
    stream.draft_vocab = draft_vocab
    weigh = copy_weigher(fingerprint, s.copy_w, s.copy_answers) if s.copy_w != 1 else None
    train_on_store(fingerprint, s, seeded_trainee(stream, s.chain, s.align_w, s.arla_w, s.top1_w, weigh, s.oov), log)
    return stream


def grown_layers(s: SeededTrainSettings) -> tuple[list[int], list[int]]:
    """Gated and attention-only fast layers. Gated: the layers a --init stream lacks (shut at first,
    :meth:`SeededFastStream.adopt`) plus those it had gated itself; with ``attention_only`` the gated
    layers run no FFN (measured: a grown layer's gain came from its attention, docs/TRAINING.md), as do
    those the --init stream ran so. None without --init. Read from the file's config alone, so --resume
    rebuilds the same shape."""
    if s.attention_only and not s.init:
        raise SettingsError("--attention-only applies to layers grown onto an --init stream")
    if not s.init:
        return [], []
    from m2r2.multirate.io import adapter_kind, read_meta
    from m2r2.weightfile import weights_path

    cfg = read_meta(weights_path(s.init))["config"]
    if adapter_kind(cfg) != "seeded":
        return [], []  # refused with a clear error when the file is loaded
    start = SeededConfig.from_dict(cfg)
    n = start.num_base_layers
    layers = set(range(n - s.depth, n))
    gated = {i for i in layers if i not in start.layers} | (set(start.gated) & layers)
    attn = (gated if s.attention_only else set()) | (set(start.attention_only) & layers)
    return sorted(gated), sorted(attn)


def train_medusa(
    base: Transformer,
    fingerprint: str,
    s: MedusaTrainSettings,
    draft_vocab: Tensor | None,
    log: Callable[[dict[str, Any]], None] | None = None,
) -> MedusaHeads:
    """Train (or resume) Medusa heads on the store at ``s.store``; writes checkpoints and ``heads.safetensors``."""
    heads = MedusaHeads(base, MedusaConfig.build(base.cfg.hidden_size, s.heads))
    heads.draft_vocab = draft_vocab
    train_on_store(fingerprint, s, medusa_trainee(heads), log)
    return heads


def train_on_store(
    fingerprint: str, s: StoreTrainSettings, t: Trainee, log: Callable[[dict[str, Any]], None] | None = None
) -> nn.Module:
    """The training loop every store-trained drafter shares: writes checkpoints and ``--out/t.file``."""
    module, cfg = t.module, t.module.cfg
    if s.batch < 1:
        raise SettingsError("batch must be >= 1")
    if module.base.dtype != torch.float32:
        raise SettingsError("train drafters on the float32 model (--dtype fp32)")
    module.to(module.base.device)  # built on the host; a GPU run trains where the base model lies
    stores = [TrainStore(Path(p), fingerprint) for p in str(s.store).split(",")]
    depth = len(t.kv_layers)
    for store in stores:
        if depth and store.kv_layers[-depth:] != t.kv_layers:
            raise SettingsError(f"store {store.root} holds K/V of layers {store.kv_layers}, not of {t.kv_layers}")
        if not set(t.taps) <= set(store.taps):
            raise SettingsError(f"store {store.root} holds the outputs of layers {store.taps}, not of all of {t.taps}")
    seqs = [[q for i in range(len(st.shards)) for q in st.sequences(st.load_shard(i, kv=depth > 0))] for st in stores]
    for st, more in zip(stores, seqs, strict=True):  # each batch carries the trainee's tap layers, in its order
        pick = [st.taps.index(i) for i in t.taps]
        for q in more:
            if t.taps:
                q["taps"] = q["taps"][:, pick]
            else:
                q.pop("taps", None)
    if t.weigh is not None:
        for q in tqdm([q for more in seqs for q in more], desc="copy labels", unit="seq", leave=False):
            q["weight"] = t.weigh(q["tokens"].tolist())
    held = seqs[0][: s.holdout]  # validation: the first store's first sequences
    train = seqs[0][s.holdout :] + [q for more in seqs[1:] for q in more]
    if not train:
        raise SettingsError(f"the stores hold no sequences beyond --holdout {s.holdout}")
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
    ckpt = Path(s.out) / "checkpoint.pt"
    digest = "+".join(store_digest(st.root) for st in stores)
    traj = {
        k: v
        for k, v in s.to_dict().items()
        if k not in ("out", "store", "minutes", "steps", "resume", "ckpt_minutes", "info")
    }
    step = 0
    #: where --minutes will stop the run, fixed after HORIZON_PROBE timed steps (None: the cosine ends at --steps)
    horizon: int | None = None
    if s.init and not s.resume:
        start = t.load(Path(s.init), fingerprint)
        if type(start) is not type(module):
            raise SettingsError(f"--init {s.init} is not a {type(module).__name__}")
        if t.adopt is not None:
            t.adopt(start)
        elif start.cfg != cfg:
            raise SettingsError(f"--init {s.init} is not a {type(module).__name__} of this shape ({cfg.to_dict()})")
        else:
            module.load_state_dict(start.state_dict())
    if s.resume:
        state = load_checkpoint(ckpt, fingerprint, cfg.to_dict(), traj, digest)
        module.load_state_dict(state["stream"])
        opt.load_state_dict(state["optim"])
        step = int(state["step"])
        if s.minutes and state.get("horizon"):  # resumed after a kill: the schedule its budget set
            horizon = int(state["horizon"])

    def save(step: int) -> None:
        save_checkpoint(
            ckpt,
            {
                "stream": module.state_dict(),
                "optim": opt.state_dict(),
                "step": step,
                "fingerprint": fingerprint,
                "fast_config": cfg.to_dict(),
                "settings": traj,
                "data_hash": digest,
                "horizon": horizon,
            },
        )

    t0 = last_ckpt = time.perf_counter()
    first = step
    per_epoch = max(1, len(train) // s.batch)
    seen = 0
    module.train()
    while step < s.steps and not (s.minutes and time.perf_counter() - t0 > s.minutes * 60):
        epoch, k = divmod(step, per_epoch)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(s.seed * 100003 + epoch))
        picked = [train[i] for i in order[k * s.batch : (k + 1) * s.batch].tolist()]
        batch = pad_batch(picked, depth, bool(t.taps), module.base.device)
        if s.minutes and horizon is None and step - first == HORIZON_PROBE:
            horizon = time_horizon(step, HORIZON_PROBE, time.perf_counter() - t0, s.minutes, s.steps)
        for g in opt.param_groups:
            g["lr"] = _lr(step, s, horizon or s.steps)
        with torch.autocast(module.base.device.type, dtype=torch.bfloat16, enabled=s.bf16):
            out = t.losses(batch)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        seen += int(batch["valid"].sum())
        if log is not None:
            scalars = {name: float(v.detach()) for name, v in out.items() if isinstance(v, Tensor)}  # the losses
            log(
                {
                    "step": step,
                    "epoch": epoch,
                    **scalars,
                    "agree": out["agree"],
                    "lr": opt.param_groups[0]["lr"],
                    "tokens": seen,
                    "tok_s": seen / (time.perf_counter() - t0),
                }
            )
        if time.perf_counter() - last_ckpt > s.ckpt_minutes * 60:
            save(step)
            last_ckpt = time.perf_counter()
    save(step)
    val = agreement(t, held)
    module.eval()
    t.save(
        Path(s.out) / t.file,
        fingerprint,
        train={
            **s.to_dict(),
            "steps_done": step,
            "lr_horizon": horizon or s.steps,
            "store_tokens": sum(st.tokens for st in stores),
            "store_digest": digest,
            "tokens_seen_this_run": seen,
            "minutes_this_run": (time.perf_counter() - t0) / 60,
        },
        validation={"agree_per_step": val, "sequences": len(held)},
        **s.info,
    )
    return module


@torch.no_grad()
def agreement(
    t: Trainee, seqs: list[dict[str, Tensor]], starts: list[int] | None = None, key: str = "agree"
) -> list[float]:
    """Top-1 agreement with the full model per draft step (or head) on ``seqs`` (token-weighted);
    with ``starts``, only positions from each sequence's answer start on count. ``key="agree_exact"``
    (a seeded stream's): against the model's own token rather than its best guess in the draft vocabulary."""
    was = t.module.training
    t.module.eval()
    hits: list[float] = []
    total: list[int] = []
    for i in range(0, len(seqs), 16):
        batch = pad_batch(seqs[i : i + 16], len(t.kv_layers), bool(t.taps), t.module.base.device)
        for j, start in enumerate((starts or [])[i : i + 16]):
            batch["valid"][j, :start] = False  # the prompt is not drafted
        out = t.losses(batch, exact=True) if key == "agree_exact" else t.losses(batch)
        hits, total = hits or [0.0] * len(out[key]), total or [0] * len(out[key])
        for s, (a, n) in enumerate(zip(out[key], out["counts"], strict=True)):
            hits[s] += a * n
            total[s] += n
    t.module.train(was)
    return [h / max(n, 1) for h, n in zip(hits, total, strict=True)]


@torch.no_grad()
def answers_store(
    base: Transformer, answers: list[list[int]], depth: int, taps: list[int] | None = None
) -> list[dict[str, Tensor]]:
    """Store-form sequences (slow ``h_N``, the last ``depth`` layers' K/V, the ``taps`` layers' outputs)
    of token sequences."""
    from m2r2.training.store import slow_pass

    n = base.cfg.num_layers
    return [r for seq in answers for r in slow_pass(base, [seq], list(range(n - depth, n)), taps)]


def held_out_agreement(
    base: Transformer, t: Trainee, sequences: list[tuple[list[int], int]], keys: tuple[str, ...] = ("agree",)
) -> list[list[float]]:
    """Agreement per draft position on the answer part of ``(tokens, answer_start)`` sequences, for each of
    ``keys`` (see :func:`agreement`).

    Used with the base model's own greedy answers to eval prompts that training never saw: the
    acceptance proxy the speculative loop sees, per draft position.
    """
    rows = answers_store(base, [toks for toks, _ in sequences], len(t.kv_layers), t.taps)
    return [agreement(t, rows, [start for _, start in sequences], key) for key in keys]
