"""Training the EAGLE head of method ``eagle`` (:mod:`m2r2.decoding.eagle`) from a training store, on
the shared store loop (:func:`m2r2.training.seeded_train.train_on_store`).

The store holds every token's final slow state ``h_N``, which is all EAGLE reads: the input at
position t is ``fc([h_N(t), E(x_{t+1})])``, causal over the sequence, and the prediction targets
``h_N(t+1)`` (the base model never runs). Losses at every position with a next one:

* feature regression, smooth-L1 of ``(f(t) - h_N(t+1)) / rms(h_N(t+1))`` (EAGLE's, normalised like the
  seeded stream's alignment);
* ``CE(p_N(t+1), q(t))``, the full model's next-token distribution over the draft vocabulary
  (:func:`~m2r2.training.seeded_train.targets`).

``chain`` > 1 also trains deeper drafts on the head's own features (depth ``s`` fuses depth ``s-1``'s
prediction; :meth:`EagleHead.forward_chain`), at ``chain`` times the cost. Validation always measures
agreement at draft depths 1..4, autoregressive on the head's own features as at inference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from m2r2.decoding.eagle import EagleConfig, EagleHead, load_head, save_head
from m2r2.errors import SettingsError
from m2r2.model import Transformer
from m2r2.training.seeded_train import StoreTrainSettings, Trainee, _mean, targets, train_on_store

#: draft depths validation reports (autoregressive on the head's own features)
EVAL_DEPTHS = 4


@dataclass
class EagleTrainSettings(StoreTrainSettings):
    chain: int = 3  # draft depths trained per position, on its own features (1: EAGLE-1, true features only)
    feat_w: float = 1.0  # feature regression weight (EAGLE: 1.0)
    ce_w: float = 0.1  # CE weight (EAGLE: 0.1)


def eagle_losses(head: EagleHead, batch: dict[str, Tensor], steps: int) -> dict[str, Any]:
    """Feature and CE losses (averaged over depths) and top-1 agreement per draft depth ``1..steps``."""
    hidden, valid = batch["hidden"], batch["valid"]
    w, p, top = targets(head, hidden)
    t = hidden.shape[1]
    nxt_h, nxt_p, nxt_top = hidden[:, 1:], p[:, 1:], top[:, 1:]  # position t's targets are t + 1's
    rms = nxt_h.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-3)
    pos = torch.arange(t - 1, device=hidden.device)
    feat = ce = hidden.new_zeros(())
    agree, counts = [], []
    for s, f in enumerate(head.forward_chain(batch["tokens"], hidden, steps)):
        m = valid[:, 1:] & (pos >= s)[None, :]  # depth s + 1 needs s drafted positions before it
        f = f[:, :-1].float()
        logits = F.linear(head.base.norm(f), w)
        ce = ce + _mean(-(nxt_p * logits.log_softmax(-1)).sum(-1), m)
        feat = feat + _mean(F.smooth_l1_loss((f - nxt_h) / rms, torch.zeros_like(f), reduction="none").mean(-1), m)
        counts.append(int(m.sum()))
        agree.append(int(((logits.argmax(-1) == nxt_top) & m).sum()) / max(counts[-1], 1))
    return {"feat": feat / steps, "ce": ce / steps, "agree": agree, "counts": counts}


def eagle_trainee(head: EagleHead, chain: int = 1, feat_w: float = 1.0, ce_w: float = 0.1) -> Trainee:
    """Training runs ``chain`` depths; evaluation (the loop's validation, ``eval-align``) at least 4."""

    def losses(batch: dict[str, Tensor]) -> dict[str, Any]:
        steps = chain if head.training else max(chain, EVAL_DEPTHS)
        out = eagle_losses(head, batch, steps)
        if not head.training:  # the loss is only logged: agreement per depth is what is reported
            return {"loss": out["ce"], **out}
        return {"loss": feat_w * out["feat"] + ce_w * out["ce"], **out}

    return Trainee(
        head,
        losses,
        lambda path, fp, **info: save_head(path, head, fp, torch.bfloat16, **info),
        lambda path, fp: load_head(path, head.base, fp),
        file="eagle.safetensors",
    )


def train_eagle(
    base: Transformer,
    fingerprint: str,
    s: EagleTrainSettings,
    draft_vocab: Tensor | None,
    log: Callable[[dict[str, Any]], None] | None = None,
) -> EagleHead:
    """Train (or resume) an EAGLE head on the store at ``s.store``; writes checkpoints and ``eagle.safetensors``."""
    if s.chain < 1:
        raise SettingsError(f"chain must be >= 1, got {s.chain}")
    head = EagleHead(base, EagleConfig.build(base.cfg.num_layers, base.cfg.hidden_size)).copy_base()
    head.draft_vocab = draft_vocab
    train_on_store(fingerprint, s, eagle_trainee(head, s.chain, s.feat_w, s.ce_w), log)
    return head
