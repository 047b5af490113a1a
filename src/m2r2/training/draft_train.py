"""Distilling the small draft model of ``two-model`` from a training store, on the shared store loop.

The draft (:class:`m2r2.decoding.two_model.SmallDraft`: the base's embedding, copies of its first
layers, a final norm, the base's head) reads each store sequence causally and is trained to match
the full model's next-token distribution at every position, ``CE(softmax(W . Norm(h_N)), q)`` over
the draft vocabulary: the store holds ``h_N``, so the base never runs. Copied layers and norm train;
embedding and head stay the base's. Data order, checkpoints, resume and validation are those of
:func:`m2r2.training.seeded_train.train_on_store`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from m2r2.decoding.two_model import DraftConfig, SmallDraft, load_draft, save_draft
from m2r2.model import Transformer
from m2r2.training.seeded_train import StoreTrainSettings, Trainee, targets, train_on_store


@dataclass
class DraftTrainSettings(StoreTrainSettings):
    depth: int = 2  # base layers copied into the draft (its first ones)
    lr: float = 5e-4


def draft_losses(draft: SmallDraft, batch: dict[str, Tensor]) -> dict[str, Any]:
    """CE against the full model's distribution at every valid position (and the KL it amounts to), and
    top-1 agreement."""
    valid = batch["valid"]
    w, p, top = targets(draft, batch["hidden"])
    logits = F.linear(draft.norm(draft.forward_train(batch["tokens"])), w)
    ce = (-(p * logits.float().log_softmax(-1)).sum(-1))[valid].mean()
    entropy = (-(p * p.clamp_min(1e-30).log()).sum(-1))[valid].mean()  # CE's floor: KL = CE - entropy
    n = int(valid.sum())
    agree = int((logits.argmax(-1) == top)[valid].sum()) / max(n, 1)
    return {"loss": ce, "ce": ce, "kl": ce.detach() - entropy, "agree": [agree], "counts": [n]}


def draft_trainee(draft: SmallDraft) -> Trainee:
    return Trainee(
        draft,
        lambda batch: draft_losses(draft, batch),
        lambda path, fp, **info: save_draft(path, draft, fp, torch.bfloat16, **info),
        lambda path, fp: load_draft(path, draft.base, fp),
        file="draft.safetensors",
    )


def train_draft(
    base: Transformer,
    fingerprint: str,
    s: DraftTrainSettings,
    draft_vocab: Tensor | None,
    log: Callable[[dict[str, Any]], None] | None = None,
) -> SmallDraft:
    """Train (or resume) a small draft model on the store at ``s.store``; writes checkpoints and the draft file."""
    draft = SmallDraft(base, DraftConfig.build(base.cfg.num_layers, s.depth)).copy_base()
    draft.draft_vocab = draft_vocab
    train_on_store(fingerprint, s, draft_trainee(draft), log)
    return draft
