"""Training the seeded fast stream from a training store (base model never run during training).

Per step: a batch of whole sequences from the store (their slow ``h_N`` and the slow K/V of the fast
layers' base layers); the fast stream drafts ``chain`` steps at every position at once
(:meth:`SeededFastStream.forward_chain`: step s is seeded by step s-1's own state, so drafts 2..s see
at training what they see at inference). Losses at every valid position and step:

* ``CE(p_N, q)`` over the draft vocabulary, ``p_N = softmax(W . Norm(h_N(p)))`` the full model's
  distribution (the store holds ``h_N``, so the target costs one draft-vocabulary head);
* alignment: smooth-L1 of ``(f_K - h_N(p)) / rms(h_N(p))`` (the fast state should *be* the slow one);
* ARLA: BCE on detached states, label = the draft's top-1 equals the full model's top-1.

Data order is a function of ``(seed, step)``; checkpoints are atomic and a resumed run continues
bit-for-bit on the same store. Validation agreement per draft step is measured on store sequences
held out of training (the last ``holdout`` sequences of the first shard).
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
from torch import Tensor

from m2r2.errors import SettingsError
from m2r2.model import Transformer
from m2r2.multirate.seeded import SeededConfig, SeededFastStream
from m2r2.training.checkpoint import load_checkpoint, save_checkpoint
from m2r2.training.store import TrainStore, store_digest


@dataclass
class SeededTrainSettings:
    store: Path
    out: Path
    depth: int = 1
    rank: int = 32
    steps: int = 100000
    minutes: float = 0.0
    batch: int = 16  # sequences per step
    chain: int = 3  # draft steps trained at each position (train-time drafting)
    lr: float = 2e-3
    warmup: int = 20
    align_w: float = 0.5
    arla_w: float = 0.1
    seed: int = 0
    ckpt_minutes: float = 5.0
    resume: bool = False
    holdout: int = 48
    #: bf16 autocast for the fast stream's matmuls (parameters and optimizer stay float32): on a CPU
    #: with AMX the step runs several times faster (docs/TRAINING.md); off = float32 throughout
    bf16: bool = False
    #: adapters to start from (an earlier run's, e.g. before the store grew): matching tensors are copied
    init: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["store"], d["out"] = str(self.store), str(self.out)
        return d


def pad_batch(seqs: list[dict[str, Tensor]], depth: int) -> dict[str, Tensor]:
    """Right-pad store sequences to one length; ``valid`` marks real positions."""
    t = max(len(s["tokens"]) for s in seqs)
    b = len(seqs)
    tokens = torch.zeros(b, t, dtype=torch.long)
    valid = torch.zeros(b, t, dtype=torch.bool)
    d = seqs[0]["hidden"].shape[-1]
    hidden = torch.zeros(b, t, d)
    kv_shape = seqs[0]["k"].shape  # [L, n, KVH, D]
    k = torch.zeros(depth, b, kv_shape[2], t, kv_shape[3])
    v = torch.zeros_like(k)
    for i, s in enumerate(seqs):
        n = len(s["tokens"])
        tokens[i, :n], valid[i, :n] = s["tokens"], True
        hidden[i, :n] = s["hidden"].float()
        k[:, i, :, :n] = s["k"][-depth:].float().transpose(1, 2)
        v[:, i, :, :n] = s["v"][-depth:].float().transpose(1, 2)
    return {"tokens": tokens, "valid": valid, "hidden": hidden, "k": k, "v": v}


def chain_losses(stream: SeededFastStream, batch: dict[str, Tensor], chain: int) -> dict[str, Any]:
    """Losses and per-step top-1 agreement (over the draft vocabulary) of one batch."""
    hidden, valid = batch["hidden"], batch["valid"]
    w = stream.head_weight().float()
    with torch.no_grad():
        target = F.linear(stream.base.norm(hidden), w)
        p = target.softmax(-1)
        top = target.argmax(-1)
    out = stream.forward_chain(batch["tokens"], hidden, batch["k"], batch["v"], chain)
    pos = torch.arange(hidden.shape[1])
    rms = hidden.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-3)
    ce = align = arla = torch.zeros(())
    agree = []
    for s, states in enumerate(out, start=1):
        m = valid & (pos >= s)[None, :]
        f = states[-1]
        logits = F.linear(stream.base.norm(f), w)
        ce = ce + (-(p * logits.log_softmax(-1)).sum(-1))[m].mean()
        align = align + F.smooth_l1_loss((f - hidden) / rms, torch.zeros_like(f), reduction="none").mean(-1)[m].mean()
        hit = logits.argmax(-1) == top
        agree.append(float(hit[m].float().mean()))
        z = stream.arla([x.detach() for x in states], stream.cfg.depth)
        arla = arla + F.binary_cross_entropy_with_logits(z[m], hit[m].float())
    return {"ce": ce / chain, "align": align / chain, "arla": arla / chain, "agree": agree}


def _lr(step: int, s: SeededTrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    frac = min(1.0, (step - s.warmup) / max(1, s.steps - s.warmup))
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_seeded(
    base: Transformer,
    fingerprint: str,
    s: SeededTrainSettings,
    draft_vocab: Tensor | None,
    log: Callable[[dict[str, Any]], None] | None = None,
) -> SeededFastStream:
    """Train (or resume) a seeded fast stream on the store at ``s.store``; writes checkpoints and adapters."""
    from m2r2.multirate.io import save_adapters

    if s.chain < 1 or s.batch < 1 or s.depth < 1:
        raise SettingsError("chain, batch and depth must be >= 1")
    if base.dtype != torch.float32:
        raise SettingsError("train the seeded fast stream on the float32 model (--dtype fp32)")
    stores = [TrainStore(Path(p), fingerprint) for p in str(s.store).split(",")]
    cfg = SeededConfig.build(base.cfg.num_layers, s.depth, s.rank)
    for store in stores:
        if store.kv_layers[-s.depth :] != cfg.layers:
            raise SettingsError(f"store {store.root} holds K/V of layers {store.kv_layers}, not of {cfg.layers}")
    stream = SeededFastStream(base, cfg)
    stream.draft_vocab = draft_vocab
    seqs = [[q for i in range(len(st.shards)) for q in st.sequences(st.load_shard(i))] for st in stores]
    held = seqs[0][: s.holdout]  # validation: the first store's first sequences
    train = seqs[0][s.holdout :] + [q for more in seqs[1:] for q in more]
    if not train:
        raise SettingsError(f"the stores hold no sequences beyond --holdout {s.holdout}")
    params = [p for p in stream.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
    ckpt = Path(s.out) / "checkpoint.pt"
    digest = "+".join(store_digest(st.root) for st in stores)
    traj = {
        k: v
        for k, v in s.to_dict().items()
        if k not in ("out", "store", "minutes", "steps", "resume", "ckpt_minutes", "info")
    }
    step = 0
    if s.init and not s.resume:
        from m2r2.multirate.io import load_adapters

        start = load_adapters(Path(s.init), base, fingerprint)
        if not isinstance(start, SeededFastStream) or start.cfg != cfg:
            raise SettingsError(f"--init {s.init} is not a seeded fast stream of this shape ({cfg.to_dict()})")
        stream.load_state_dict(start.state_dict())
    if s.resume:
        state = load_checkpoint(ckpt, fingerprint, cfg.to_dict(), traj, digest)
        stream.load_state_dict(state["stream"])
        opt.load_state_dict(state["optim"])
        step = int(state["step"])

    def save(step: int) -> None:
        save_checkpoint(
            ckpt,
            {
                "stream": stream.state_dict(),
                "optim": opt.state_dict(),
                "step": step,
                "fingerprint": fingerprint,
                "fast_config": cfg.to_dict(),
                "settings": traj,
                "data_hash": digest,
            },
        )

    t0 = last_ckpt = time.perf_counter()
    per_epoch = max(1, len(train) // s.batch)
    seen = 0
    stream.train()
    while step < s.steps and not (s.minutes and time.perf_counter() - t0 > s.minutes * 60):
        epoch, k = divmod(step, per_epoch)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(s.seed * 100003 + epoch))
        batch = pad_batch([train[i] for i in order[k * s.batch : (k + 1) * s.batch].tolist()], s.depth)
        for g in opt.param_groups:
            g["lr"] = _lr(step, s)
        with torch.autocast(base.device.type, dtype=torch.bfloat16, enabled=s.bf16):
            out = chain_losses(stream, batch, s.chain)
        loss = out["ce"] + s.align_w * out["align"] + s.arla_w * out["arla"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        seen += int(batch["valid"].sum())
        if log is not None:
            log(
                {
                    "step": step,
                    "epoch": epoch,
                    "ce": float(out["ce"]),
                    "align": float(out["align"]),
                    "arla": float(out["arla"]),
                    "agree": out["agree"],
                    "tokens": seen,
                    "tok_s": seen / (time.perf_counter() - t0),
                }
            )
        if time.perf_counter() - last_ckpt > s.ckpt_minutes * 60:
            save(step)
            last_ckpt = time.perf_counter()
    save(step)
    val = evaluate_chain(stream, held, s.depth, s.chain)
    stream.eval()
    save_adapters(
        Path(s.out) / "adapters.safetensors",
        stream,
        fingerprint,
        torch.bfloat16,
        train={
            **s.to_dict(),
            "steps_done": step,
            "store_tokens": sum(st.tokens for st in stores),
            "store_digest": digest,
            "tokens_seen_this_run": seen,
            "minutes_this_run": (time.perf_counter() - t0) / 60,
        },
        validation={"agree_per_step": val, "sequences": len(held)},
        **s.info,
    )
    return stream


@torch.no_grad()
def evaluate_chain(
    stream: SeededFastStream, seqs: list[dict[str, Tensor]], depth: int, chain: int, starts: list[int] | None = None
) -> list[float]:
    """Top-1 agreement with the full model at draft steps 1..chain on ``seqs`` (token-weighted);
    with ``starts``, only positions from each sequence's answer start on count."""
    was = stream.training
    stream.eval()
    hits = [0.0] * chain
    total = [0] * chain
    for i in range(0, len(seqs), 16):
        batch = pad_batch(seqs[i : i + 16], depth)
        for j, start in enumerate((starts or [])[i : i + 16]):
            batch["valid"][j, :start] = False  # the prompt is not drafted
        out = chain_losses(stream, batch, chain)
        pos = torch.arange(batch["tokens"].shape[1])
        for s, a in enumerate(out["agree"]):
            n = int((batch["valid"] & (pos >= s + 1)[None, :]).sum())
            hits[s] += a * n
            total[s] += n
    stream.train(was)
    return [h / max(t, 1) for h, t in zip(hits, total, strict=True)]


@torch.no_grad()
def answers_store(base: Transformer, answers: list[list[int]], depth: int) -> list[dict[str, Tensor]]:
    """Store-form sequences (slow ``h_N`` and the last ``depth`` layers' K/V) of token sequences."""
    from m2r2.training.store import slow_pass

    n = base.cfg.num_layers
    return [r for seq in answers for r in slow_pass(base, [seq], list(range(n - depth, n)))]


def held_out_agreement(
    base: Transformer, stream: SeededFastStream, sequences: list[tuple[list[int], int]], chain: int
) -> list[float]:
    """Agreement at draft steps 1..chain on the answer part of ``(tokens, answer_start)`` sequences.

    Used with the base model's own greedy answers to eval prompts that training never saw: the
    acceptance proxy the speculative loop sees, per draft position.
    """
    rows = answers_store(base, [t for t, _ in sequences], stream.cfg.depth)
    return evaluate_chain(stream, rows, stream.cfg.depth, chain, [start for _, start in sequences])
