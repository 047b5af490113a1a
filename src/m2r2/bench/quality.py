"""Quality of a lossy method's output against the full model's own greedy output on the same prompt.

- ROUGE-L F1 on decoded text (``rouge_score``, the maintained implementation; stemming on), the
  paper's style of quality axis;
- exact match of the token ids;
- the full model's mean negative log-likelihood of the method's output tokens (teacher-forced: one
  pass over prompt + output), which says how *plausible* the full model finds the text even where
  it differs from its own greedy choice.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from functools import cache

import torch

from m2r2.model import Transformer


@cache
def _scorer():  # building the scorer loads tokenizers/stemmers once
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(reference: str, candidate: str) -> float:
    """ROUGE-L F1 of ``candidate`` against ``reference``.

    Identical texts score 1.0 even where the scorer's tokenizer keeps no word of them (it drops
    everything but ASCII letters and digits, so emoji-only or CJK-only answers would score 0).
    """
    if reference == candidate:
        return 1.0
    return float(_scorer().score(reference, candidate)["rougeL"].fmeasure)


@torch.inference_mode()
def mean_nll(model: Transformer, prompt: list[int], output: list[int]) -> float:
    """The full model's mean NLL (nats per token) of ``output`` after ``prompt``; NaN for no output."""
    if not output:
        return float("nan")
    ids = prompt + output
    cache = model.new_cache(len(ids))
    logits = model(torch.tensor([ids], device=model.device), cache, 0)[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1)
    target = torch.tensor(output, device=logp.device)
    return float(-logp.gather(1, target[:, None]).mean())


def paired_speedup(rates: Sequence[float], reference: Sequence[float]) -> float | None:
    """Median of per-prompt tokens/s ratios against the reference on the same prompts."""
    ratios = [r / b for r, b in zip(rates, reference, strict=True) if b > 0]
    return statistics.median(ratios) if ratios else None


def speedup_at(curve: Sequence[dict], level: float) -> float | None:
    """Best speedup at which the measured quality curve is at or above ROUGE-L ``level``.

    ``curve`` lists points in knob order (each ``{"speedup", "rouge_l"}``); between two neighbours
    quality and speedup are interpolated linearly, so a crossing of the level between two measured
    points counts at its interpolated speedup. None if no point or crossing reaches the level.
    """
    pts = [(p["speedup"], p["rouge_l"]) for p in curve if p.get("speedup") is not None and p.get("rouge_l") is not None]
    best: float | None = None
    for s, q in pts:
        if q >= level:
            best = s if best is None else max(best, s)
    for (s0, q0), (s1, q1) in itertools.pairwise(pts):
        if (q0 - level) * (q1 - level) < 0:  # the level lies strictly between the two qualities
            s = s0 + (level - q0) * (s1 - s0) / (q1 - q0)
            best = s if best is None else max(best, s)
    return best
