"""Training the accelerator adapters and ARLA by self-distillation (base model frozen).

Per step: one slow pass without grad gives every slow state ``h_i``, the slow K/V of all layers
and the full model's distribution ``p``; the fast stream then runs over the same tokens through
the shared-cache attention with a random block partition (block lengths 1..gamma_max emulate
drafting w tokens). Losses on answer positions only (where drafting happens):

* alignment ``1 - cos(Norm(f_j), Norm(h_{R*j}))`` averaged over fast layers,
* ``KL(p || softmax(W . Norm(f_j)))`` at the exit layers,
* ARLA: binary cross-entropy on detached states, label = exit top-1 equals full top-1 (all exit
  positions; a subsample of positions at the other fast layers, where the head is run without grad).

Data order, block lengths and subsamples are functions of ``(seed, step, rank)`` only, so a resumed
run continues bit-for-bit. Runs single-process or under ``accelerate launch`` / ``torchrun``
(each process takes its share of every global batch; DDP averages the gradients).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m2r2.errors import InputError, SettingsError, WeightsError
from m2r2.model import Transformer
from m2r2.multirate.fast import FastConfig, FastStream, block_starts
from m2r2.multirate.io import save_adapters
from m2r2.training.checkpoint import load_checkpoint, save_checkpoint
from m2r2.weightfile import weights_path


@dataclass
class TrainSettings:
    out: Path
    steps: int = 1000
    minutes: float = 0.0  # wall-clock budget (0 = none); the run stops cleanly at the first limit
    batch: int = 4  # sequences per step, over all processes
    max_len: int = 384
    lr: float = 1e-3
    warmup: int = 20
    gamma_max: int = 6
    align_w: float = 1.0
    kl_w: float = 1.0
    arla_w: float = 0.1
    arla_frac: float = 0.125
    seed: int = 0
    ckpt_minutes: float = 5.0
    resume: bool = False
    adapter_dtype: str = "bfloat16"
    #: adapters to start from (e.g. the dense model's for its MoEfied version): every tensor whose name
    #: and shape match is copied, the others keep their fresh initialisation
    init: str | None = None
    info: dict[str, Any] = field(default_factory=dict)  # provenance written into the adapter JSON

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out"] = str(self.out)
        return d


def make_sequences(records: list[dict[str, Any]], max_len: int) -> list[tuple[list[int], int]]:
    """``(tokens, answer_start)`` pairs cut to ``max_len``; records with no answer inside are dropped."""
    out = []
    for r in records:
        p, a = r["prompt_ids"], r["answer_ids"]
        if a and len(p) + 1 < max_len:
            out.append(((p + a)[:max_len], len(p)))
    if not out:
        raise InputError(f"no training sequence has answer tokens within max_len={max_len}")
    return out


def batch_indices(n: int, step: int, batch: int, seed: int) -> list[int]:
    """Global batch ``step``: consecutive slices of per-epoch permutations seeded by ``(seed, epoch)``."""
    out = []
    for i in range(step * batch, (step + 1) * batch):
        epoch, k = divmod(i, n)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        out.append(int(torch.randperm(n, generator=g)[k]))
    return out


def collate(seqs: list[tuple[list[int], int]]) -> tuple[Tensor, Tensor]:
    """Right-padded tokens ``[B, T]`` and the mask of positions that predict an answer token."""
    t = max(len(s) for s, _ in seqs)
    tokens = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.bool)
    for i, (s, start) in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
        mask[i, start - 1 : len(s) - 1] = True
    return tokens, mask


def draw_blocks(length: int, gamma_max: int, g: torch.Generator) -> Tensor:
    ws = torch.randint(1, gamma_max + 1, (length,), generator=g).tolist()
    return block_starts(length, ws)


class DistillLoss(nn.Module):
    """The trainable module (adapters + ARLA inside ``stream``); ``forward`` returns loss and metrics.

    Being an ``nn.Module`` whose ``forward`` computes the loss lets DDP (via accelerate) hook the
    gradient all-reduce; the frozen base and teacher models are held outside its parameters.
    """

    def __init__(self, stream: FastStream, s: TrainSettings, teacher: Transformer | None = None) -> None:
        super().__init__()
        self.stream = stream
        self.settings = s
        object.__setattr__(self, "teacher", teacher or stream.base)

    teacher: Transformer

    @torch.no_grad()
    def slow(self, tokens: Tensor) -> tuple[list[Tensor], Tensor, Tensor]:
        """Slow states ``h_0..h_N``, slow K/V of every layer, in the fast stream's dtype."""
        t, dtype = self.teacher, self.stream.base.dtype
        cache = t.new_cache(tokens.shape[1], batch=tokens.shape[0])
        hidden = [t.embed_tokens(tokens)]
        t.run_layers(hidden[0], cache, 0, hidden)
        return [h.to(dtype) for h in hidden], cache.k.to(dtype), cache.v.to(dtype)

    def forward(
        self, tokens: Tensor, mask: Tensor, starts: Tensor, g: torch.Generator
    ) -> tuple[Tensor, dict[str, Any]]:
        s, stream, cfg = self.settings, self.stream, self.stream.cfg
        base = stream.base
        h, k, v = self.slow(tokens)
        with torch.no_grad():
            p_logits = self.teacher.head(h[-1][mask].to(self.teacher.dtype))
            p_log = F.log_softmax(p_logits, -1)
            p_top = p_logits.argmax(-1)
        states = stream.forward_train(h[0], k, v, starts)
        sel = [f[mask] for f in states]  # [M, d] per layer, answer positions only
        align = torch.stack(
            [
                1 - F.cosine_similarity(base.norm(sel[j]), base.norm(h[cfg.target(j)][mask]), dim=-1).mean()
                for j in range(1, cfg.depth + 1)
            ]
        ).mean()
        kl, agree, labels = [], {}, {}
        for j in cfg.exits:
            q_log = F.log_softmax(stream.exit_logits(sel[j]), -1)
            kl.append(F.kl_div(q_log, p_log, log_target=True, reduction="batchmean"))
            hit = q_log.argmax(-1) == p_top
            agree[j], labels[j] = hit.float().mean().item(), hit.float()
        kl_loss = torch.stack(kl).mean()
        # ARLA on detached states: it must not pull the adapters towards being easy to route.
        det = [x.detach() for x in sel]
        m = det[0].shape[0]
        sub = torch.randperm(m, generator=g)[: max(1, math.ceil(s.arla_frac * m))]
        bce = []
        for j in range(1, cfg.depth + 1):
            if j in labels:
                bce.append(F.binary_cross_entropy_with_logits(stream.arla(det, j), labels[j]))
            else:
                part = [x[sub] for x in det[: j + 1]]
                with torch.no_grad():
                    lab = (stream.exit_logits(part[j]).argmax(-1) == p_top[sub]).float()
                bce.append(F.binary_cross_entropy_with_logits(stream.arla(part, j), lab))
        arla = torch.stack(bce).mean()
        loss = s.align_w * align + s.kl_w * kl_loss + s.arla_w * arla
        return loss, {"align": align.item(), "kl": kl_loss.item(), "arla": arla.item(), "agree": agree}


def init_from(stream: FastStream, path: Path) -> int:
    """Copy the tensors of adapter file ``path`` whose names and shapes match ``stream``'s; returns how many.

    Used to start a MoE model's fast stream from the dense model's adapters: attention adapters
    carry over, the MLP ones (absent on sparse blocks) are skipped.
    """
    from safetensors import SafetensorError, safe_open

    own = stream.state_dict()
    try:
        with safe_open(str(weights_path(path)), framework="pt") as fh:
            found = {k: fh.get_tensor(k) for k in fh.keys() if k in own}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise WeightsError(f"cannot read adapters to start from, {path}: {e}") from e
    found = {k: v for k, v in found.items() if v.shape == own[k].shape}
    if not found:
        raise SettingsError(f"no tensor of {path} fits this fast stream (check --rank and --path)")
    stream.load_state_dict({k: v.to(own[k].dtype) for k, v in found.items()}, strict=False)
    return len(found)


@dataclass
class Progress:
    """Where a training run stands: what checkpoints record and what ``--resume`` restores."""

    step: int = 0
    tokens_seen: int = 0
    last: dict[str, Any] = field(default_factory=dict)  # loss and metrics of the latest step


def run_steps(
    acc: Any,
    s: Any,
    opt: torch.optim.Optimizer,
    prog: Progress,
    one_step: Callable[[int], tuple[Tensor, dict[str, float], int]],
    save: Callable[[], None],
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The optimisation loop every trainer shares (adapters, MoD routers).

    ``one_step(step)`` returns (loss, metrics, answer tokens over all processes) for global step
    ``step``; this loop owns the rest: linear warm-up of ``s.lr`` over ``s.warmup`` steps, the
    optimizer step, the wall-clock budget ``s.minutes`` (agreed across processes, so all stop
    together), a checkpoint every ``s.ckpt_minutes`` and a final one. Keeping it in one place is
    what keeps ``--resume`` bit-for-bit for every trainer.
    """
    from tqdm import tqdm

    t0 = last_ckpt = time.monotonic()
    start_step, seen_before = prog.step, prog.tokens_seen
    bar = tqdm(total=s.steps, initial=prog.step, disable=not acc.is_local_main_process, dynamic_ncols=True)
    while prog.step < s.steps:
        for grp in opt.param_groups:
            grp["lr"] = s.lr * min(1.0, (prog.step + 1) / max(1, s.warmup))
        loss, metrics, tokens = one_step(prog.step)
        opt.zero_grad(set_to_none=True)
        acc.backward(loss)
        opt.step()
        prog.step += 1
        prog.tokens_seen += tokens
        prog.last = {"loss": loss.item(), **metrics}
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in prog.last.items()})
        if log is not None and acc.is_main_process:
            log(f"step {prog.step} " + " ".join(f"{k}={v:.4f}" for k, v in prog.last.items()))
        now = time.monotonic()
        if acc.is_main_process and s.minutes and now - t0 > s.minutes * 60:
            acc.set_trigger()
        if acc.check_trigger():
            break
        if now - last_ckpt > s.ckpt_minutes * 60:
            save()
            last_ckpt = now
    bar.close()
    save()
    acc.wait_for_everyone()
    return {
        "steps": prog.step,
        "steps_this_run": prog.step - start_step,
        "seconds": time.monotonic() - t0,
        "tokens_seen_this_run": prog.tokens_seen - seen_before,
        "metrics": prog.last,
    }


def begin_training(s: Any, device: torch.device, records: list[dict[str, Any]]) -> tuple[Any, int, int, list]:
    """The accelerate start both trainers share: checks, the Accelerator, this run's sequences.

    Returns ``(accelerator, processes, this process's rank, sequences)``.
    """
    from accelerate import Accelerator

    if s.batch < 1 or s.steps < 1:
        raise SettingsError("batch and steps must be >= 1")
    acc = Accelerator(cpu=device.type == "cpu")
    world, rank = acc.num_processes, acc.process_index
    if s.batch % world:
        raise SettingsError(f"--batch {s.batch} must be a multiple of the {world} processes")
    return acc, world, rank, make_sequences(records, s.max_len)


class Checkpointed:
    """What both trainers keep across ``--resume``: the trainable module, its AdamW state and
    :class:`Progress`, bound to the base model, the trainable's config, the settings and the data.

    ``extra`` entries are saved too and must match on resume (e.g. MoD's trajectory settings).
    The checkpoint names the trainable state ``stream`` and its config ``fast_config`` whatever
    it trains (the format of the adapters' trainer, which came first).
    """

    def __init__(
        self,
        s: Any,
        trainable: nn.Module,
        fingerprint: str,
        config: dict[str, Any],
        seqs: list,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.settings, self.trainable, self.fingerprint, self.config, self.seqs = (
            s,
            trainable,
            fingerprint,
            config,
            seqs,
        )
        self.extra = extra or {}
        self.opt = torch.optim.AdamW(trainable.parameters(), lr=s.lr, weight_decay=0.0)
        self.path = Path(s.out) / "checkpoint.pt"
        self.data_hash = hashlib.sha256(json.dumps(seqs).encode()).hexdigest()[:16]
        self.prog = Progress()
        if s.resume:
            state = load_checkpoint(self.path, fingerprint, config, s.to_dict(), self.data_hash)
            for key, want in self.extra.items():
                if state.get(key) != want:
                    raise SettingsError(f"checkpoint {self.path} was written with {state.get(key)}, this run is {want}")
            trainable.load_state_dict(state["stream"])
            self.opt.load_state_dict(state["optimizer"])
            self.prog = Progress(int(state["step"]), int(state.get("tokens_seen", 0)))

    def save(self) -> None:
        """Write the checkpoint (atomically)."""
        state = {
            "stream": self.trainable.state_dict(),
            "optimizer": self.opt.state_dict(),
            "step": self.prog.step,
            "fingerprint": self.fingerprint,
            "fast_config": self.config,
            "settings": self.settings.to_dict(),
            **self.extra,
            "data_hash": self.data_hash,
            "tokens_seen": self.prog.tokens_seen,
        }
        save_checkpoint(self.path, state)

    def info(self, **extra: Any) -> dict[str, Any]:
        """What the trained file's sidecar records about the run."""
        return {
            **self.settings.info,
            "steps": self.prog.step,
            "tokens_seen": self.prog.tokens_seen,
            "sequences": len(self.seqs),
            "train_settings": {k: v for k, v in self.settings.to_dict().items() if k != "info"},
            **extra,
            "metrics": self.prog.last,
        }


def train(
    base: Transformer,
    fast_cfg: FastConfig,
    records: list[dict[str, Any]],
    s: TrainSettings,
    fingerprint: str,
    teacher: Transformer | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train adapters + ARLA on distilled ``records``; writes checkpoints and adapters under ``s.out``."""
    if s.gamma_max < 1:
        raise SettingsError("batch, steps and gamma_max must be >= 1")
    acc, world, rank, seqs = begin_training(s, base.device, records)
    torch.manual_seed(s.seed)
    stream = FastStream(base, fast_cfg).to(base.device)
    if s.init and not s.resume:
        s.info["init"] = {"path": s.init, "tensors": init_from(stream, Path(s.init))}
    module = DistillLoss(stream, s, teacher)
    run = Checkpointed(s, stream, fingerprint, fast_cfg.to_dict(), seqs)
    module, opt = acc.prepare(module, run.opt)

    def save() -> None:
        if not acc.is_main_process:
            return
        run.save()
        adapters = Path(s.out) / "adapters.safetensors"
        save_adapters(adapters, stream, fingerprint, dtype=getattr(torch, s.adapter_dtype), **run.info())

    ema: float | None = None

    def one_step(step: int) -> tuple[Tensor, dict[str, float], int]:
        nonlocal ema
        idx = batch_indices(len(seqs), step, s.batch, s.seed)[rank::world]
        tokens, mask = collate([seqs[i] for i in idx])
        # block partition shared by all processes (as in a one-process run); subsamples per process
        starts = draw_blocks(s.max_len, s.gamma_max, torch.Generator().manual_seed(s.seed * 7919 + step))
        starts = starts[: tokens.shape[1]]
        g = torch.Generator().manual_seed(s.seed * 7919 + step * 131 + rank + 1)
        loss, met = module(tokens.to(base.device), mask.to(base.device), starts, g)
        top = met["agree"][max(met["agree"])]
        ema = top if ema is None else 0.95 * ema + 0.05 * top
        metrics = {"align": met["align"], "kl": met["kl"], "arla": met["arla"], "agree_ema": ema}
        return loss, metrics, int(mask.sum()) * world

    return {**run_steps(acc, s, opt, run.prog, one_step, save, log), "stream": stream}
