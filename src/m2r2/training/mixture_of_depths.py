"""Mixture-of-Depths baseline: per-block routers trained on the frozen base model.

Raposo et al. 2024 (MoD) give every block a router, a linear map of the block input to one scalar
weight; a token the router picks runs the block, the others pass through on the residual unchanged.
In training MoD picks the top-k tokens of the sequence per block (capacity), which is non-causal, so
for autoregressive sampling the paper trains a causal decision next to it (an auxiliary BCE on the
router output with threshold 0.5, or a small predictor). We only decode one token at a time and
the base model is frozen, so we train the per-token causal decision directly:

* router ``i``: ``g_i(x) = sigmoid(w_i . rmsnorm(x) + b_i)`` on block ``i``'s input (the RMS norm,
  without weight, because this model's residual norms vary by orders of magnitude across layers);
* soft gating in training: ``x' = x + g * (block(x) - x)``; inside the block's attention, keys of
  other positions get the additive bias ``log g_j``, which tends to the hard masking used at decode
  time (a skipped token writes no K/V at that block) as ``g_j -> 0`` and leaves attention unchanged
  as ``g_j -> 1``;
* loss: ``KL(p_full || q_routed)`` on answer positions + ``lam * mean gate`` (a compute penalty),
  gates applied only to answer tokens because decoding routes generated tokens and prefills the
  prompt through every block;
* blocks in ``always_on`` (default: the first and the last) have no router: skipping the block
  that reads the embeddings or writes the final state costs the most quality for 1/N of compute.

At decode time a token runs block ``i`` iff ``g_i >= threshold``
(:mod:`m2r2.decoding.mixture_of_depths`, which also holds the routers and their files: ``NAME.safetensors``
+ ``NAME.json`` bound to the base model's fingerprint, as adapters).
Data order is a function of ``(seed, step)`` only, so a resumed run continues bit-for-bit.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m2r2.decoding.mixture_of_depths import (  # noqa: F401 (RouterConfig, load_routers: re-exported)
    RouterConfig,
    Routers,
    load_routers,
    save_routers,
)
from m2r2.errors import SettingsError
from m2r2.model import Block, Transformer
from m2r2.training.checkpoint import load_checkpoint, save_checkpoint
from m2r2.training.loop import Progress, batch_indices, collate, make_sequences, run_steps

# --------------------------------------------------------------------------- soft-routed forward


def soft_block(blk: Block, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor) -> Tensor:
    """Block ``blk`` over a whole sequence without a cache; ``bias`` is an additive attention mask."""
    q, k, v = blk.attn.qkv(blk.attn_norm(x), cos, sin)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=k.shape[1] != q.shape[1])
    a = x + blk.attn.out(o)
    return a + blk.mlp(blk.mlp_norm(a))


def routed_forward(
    model: Transformer, routers: Routers, tokens: Tensor, routable: Tensor, hard: bool = False
) -> tuple[Tensor, Tensor]:
    """Final states of the routed model and the gates ``[B, T, routed blocks]`` (1 where not routable).

    Soft: blocks mixed in by ``g`` and keys weighted by ``g``. Hard (straight-through): the forward
    makes the decode-time decision at threshold 0.5 exactly (skip = residual unchanged and key
    masked out) while gradients flow as in the soft model.
    """
    t = tokens.shape[1]
    x = model.embed_tokens(tokens)
    cos, sin = model.rope(0, t, x.dtype)
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    neg = torch.zeros(t, t, device=x.device).masked_fill(~causal, float("-inf"))
    eye = torch.eye(t, dtype=torch.bool, device=x.device)
    plain = neg.to(x.dtype)[None, None]
    gates = []
    for i, blk in enumerate(model.layers):
        if i in routers.cfg.always_on:
            x = soft_block(blk, x, cos, sin, plain)
            continue
        z = routers.logit(x, i)
        g = torch.where(routable, torch.sigmoid(z), torch.ones_like(z))
        log_g = torch.where(routable, F.logsigmoid(z), torch.zeros_like(z))
        # keys of other positions weighted by their gate; a token always sees its own key
        mix = g
        if hard:
            run = g >= 0.5
            mix = run.float() + g - g.detach()
            log_g = torch.where(run, log_g - log_g.detach(), float("-inf"))
        bias = (neg[None] + log_g[:, None, :]).masked_fill(eye, 0.0)[:, None].to(x.dtype)
        y = soft_block(blk, x, cos, sin, bias)
        x = x + mix[..., None].to(x.dtype) * (y - x)
        gates.append(g)
    return x, torch.stack(gates, -1)


# --------------------------------------------------------------------------- training


@dataclass
class MoDSettings:
    out: Path
    steps: int = 100_000
    minutes: float = 0.0  # wall-clock budget (0 = none); stops cleanly at the first limit
    batch: int = 4
    max_len: int = 256
    lr: float = 3e-3
    warmup: int = 10
    lam: float = 1.0  # weight of the compute penalty (mean gate)
    hard: bool = True  # straight-through hard gates at 0.5 (else soft gates; see routed_forward)
    init_bias: float = 3.0
    seed: int = 0
    ckpt_minutes: float = 5.0
    resume: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out"] = str(self.out)
        return d


#: Settings that change the trajectory (beyond those :func:`load_checkpoint` compares).
MOD_TRAJECTORY_KEYS = ("lam", "init_bias", "hard", "dtype")


class MoDLoss(nn.Module):
    """Trainable module (the routers); the frozen base model is held outside its parameters."""

    def __init__(self, routers: Routers, model: Transformer, lam: float, hard: bool = True) -> None:
        super().__init__()
        self.routers = routers
        self.lam, self.hard = lam, hard
        object.__setattr__(self, "model", model)

    model: Transformer

    def forward(self, tokens: Tensor, mask: Tensor, routable: Tensor) -> tuple[Tensor, dict[str, float]]:
        m = self.model
        with torch.no_grad():
            cache = m.new_cache(tokens.shape[1], batch=tokens.shape[0])
            p_logits = m.head(m.run_layers(m.embed_tokens(tokens), cache, 0)[mask])
            p_log = F.log_softmax(p_logits, -1)
        h, gates = routed_forward(m, self.routers, tokens, routable, self.hard)
        q_log = F.log_softmax(m.head(h[mask]), -1)
        kl = F.kl_div(q_log, p_log, log_target=True, reduction="batchmean")
        g = gates[routable]  # [tokens, routed blocks]
        gate = g.mean()
        loss = kl + self.lam * gate
        with torch.no_grad():
            agree = (q_log.argmax(-1) == p_log.argmax(-1)).float().mean().item()
            hard = (g >= 0.5).float().mean().item()
        return loss, {"kl": kl.item(), "gate": gate.item(), "run@0.5": hard, "agree": agree}


def routable_mask(seqs: list[tuple[list[int], int]], t: int) -> Tensor:
    """Answer-token positions (those decoding feeds through the routed blocks)."""
    out = torch.zeros(len(seqs), t, dtype=torch.bool)
    for i, (s, start) in enumerate(seqs):
        out[i, start : len(s)] = True
    return out


def train_mod(
    model: Transformer,
    records: list[dict[str, Any]],
    s: MoDSettings,
    fingerprint: str,
    always_on: list[int] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train routers on distilled ``records``; checkpoints and ``routers.safetensors`` go under ``s.out``."""
    from accelerate import Accelerator

    if s.batch < 1 or s.steps < 1:
        raise SettingsError("batch and steps must be >= 1")
    if s.lam < 0:
        raise SettingsError(f"the compute penalty weight must be >= 0, got {s.lam}")
    acc = Accelerator(cpu=model.device.type == "cpu")
    world, rank = acc.num_processes, acc.process_index
    if s.batch % world:
        raise SettingsError(f"--batch {s.batch} must be a multiple of the {world} processes")
    model.requires_grad_(False).eval()
    seqs = make_sequences(records, s.max_len)
    cfg = RouterConfig.build(model.cfg.num_layers, model.cfg.hidden_size, always_on)
    routers = Routers(cfg, s.init_bias).to(model.device)
    module = MoDLoss(routers, model, s.lam, s.hard)
    opt = torch.optim.AdamW(routers.parameters(), lr=s.lr, weight_decay=0.0)
    ckpt = Path(s.out) / "checkpoint.pt"
    traj = {**{k: v for k, v in s.to_dict().items() if k in MOD_TRAJECTORY_KEYS}, "dtype": str(model.dtype)}
    prog = Progress()
    data_hash = hashlib.sha256(json.dumps(seqs).encode()).hexdigest()[:16]
    if s.resume:
        # "stream"/"fast_config" are the checkpoint format's names for the trainable state and its config
        state = load_checkpoint(ckpt, fingerprint, cfg.to_dict(), s.to_dict(), data_hash)
        if state.get("mod_trajectory") != traj:
            raise SettingsError(f"checkpoint {ckpt} was written with {state.get('mod_trajectory')}, this run is {traj}")
        routers.load_state_dict(state["stream"])
        opt.load_state_dict(state["optimizer"])
        prog = Progress(int(state["step"]), int(state.get("tokens_seen", 0)))
    module, opt = acc.prepare(module, opt)

    def save() -> None:
        if not acc.is_main_process:
            return
        st = {
            "stream": routers.state_dict(),
            "optimizer": opt.state_dict(),
            "step": prog.step,
            "fingerprint": fingerprint,
            "fast_config": cfg.to_dict(),
            "settings": s.to_dict(),
            "mod_trajectory": traj,
            "data_hash": data_hash,
            "tokens_seen": prog.tokens_seen,
        }
        save_checkpoint(ckpt, st)
        info = {
            **s.info,
            "steps": prog.step,
            "tokens_seen": prog.tokens_seen,
            "sequences": len(seqs),
            "train_settings": {k: v for k, v in s.to_dict().items() if k != "info"},
            "train_dtype": traj["dtype"],
            "metrics": prog.last,
        }
        save_routers(Path(s.out) / "routers.safetensors", routers, fingerprint, **info)

    def one_step(step: int) -> tuple[Tensor, dict[str, float], int]:
        batch = [seqs[i] for i in batch_indices(len(seqs), step, s.batch, s.seed)[rank::world]]
        tokens, mask = collate(batch)
        routable = routable_mask(batch, tokens.shape[1])
        dev = model.device
        loss, met = module(tokens.to(dev), mask.to(dev), routable.to(dev))
        return loss, met, int(mask.sum()) * world

    return {**run_steps(acc, s, opt, prog, one_step, save, log), "routers": routers}
