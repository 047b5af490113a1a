"""The draft vocabulary: the tokens a reduced draft head scores (``FastStream.exit_logits``).

Why: the bundled model's LM head (49,152 x 576) is read at every draft step and costs about as
much as five of its layers, but drafts are only accepted where the fast stream agrees with the
full model, which is overwhelmingly on frequent tokens. Scoring the most frequent tokens only
cuts the head's cost in proportion, at the price of never drafting the rest.

Frequencies come from the same self-distillation data the adapters were trained on (the base
model's own answers, which is the distribution a draft must match), topped up with the training
prompts' tokens (words a user brings that answers copy back), each source normalised to a
distribution and the prompts weighted by ``prompt_weight``. End-of-sequence ids are always kept,
so a draft can end an answer. Evaluation prompts are never read (``refuse_eval``).
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from m2r2.errors import InputError, SettingsError
from m2r2.paths import refuse_eval

if TYPE_CHECKING:
    from m2r2.decoding.base import Loaded


def count_tokens(seqs: Iterable[list[int]]) -> Counter[int]:
    c: Counter[int] = Counter()
    for s in seqs:
        c.update(s)
    return c


def read_prompt_texts(path: Path) -> list[str]:
    """Every turn of a prompts JSONL (``{"turns": [...]}`` per line, as in ``../shared/data/train``)."""
    refuse_eval(path)
    texts = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            texts += [t for t in json.loads(line).get("turns", []) if isinstance(t, str)]
    return texts


def draft_vocabulary(
    answers: Counter[int],
    prompts: Counter[int],
    size: int,
    vocab_size: int,
    keep: Iterable[int] = (),
    prompt_weight: float = 0.5,
) -> Tensor:
    """The ``size`` most frequent token ids (sorted), always including ``keep``.

    ``answers``/``prompts`` are token counts; ties break by smaller id so the result is
    deterministic.
    """
    keep = sorted(set(keep))
    if not len(keep) <= size <= vocab_size:
        raise SettingsError(f"draft vocabulary size must be in {len(keep)}..{vocab_size}, got {size}")
    n_a, n_p = sum(answers.values()), sum(prompts.values())
    if n_a == 0:
        raise InputError("no answer tokens to count: the draft vocabulary needs distilled answers")
    score: dict[int, float] = {t: c / n_a for t, c in answers.items()}
    for t, c in prompts.items():
        score[t] = score.get(t, 0.0) + prompt_weight * c / max(n_p, 1)
    chosen = set(keep)
    for t, _ in sorted(score.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if 0 <= t < vocab_size:
            chosen.add(t)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(ids: Tensor, tokens: Iterable[int]) -> float:
    """Share of ``tokens`` inside the vocabulary ``ids`` (an upper bound on what drafts can hit)."""
    inside = set(ids.tolist())
    toks = list(tokens)
    return sum(t in inside for t in toks) / len(toks) if toks else 0.0


def build_from_files(
    data: Path,
    prompts: Path | None,
    size: int,
    vocab_size: int,
    keep: Iterable[int],
    encode: Callable[[list[str]], list[list[int]]],
) -> Tensor:
    """:func:`draft_vocabulary` from a distilled-answers JSONL and an optional training-prompts JSONL."""
    from m2r2.training.distill import load_distilled

    for path, what in ((data, "distilled answers (run `m2r2 distill-data` first)"), (prompts, "training prompts")):
        if path is not None and not Path(path).is_file():
            raise InputError(f"{path}: no such file of {what}")
    answers = count_tokens(r["answer_ids"] for r in load_distilled(data))
    prompt_counts = count_tokens(encode(read_prompt_texts(prompts))) if prompts is not None else Counter()
    return draft_vocabulary(answers, prompt_counts, size, vocab_size, keep)


def write_draft_vocab(
    engine: Loaded, adapters: Path | None, data: Path, prompts: Path | None, size: int, out: Path | None = None
) -> tuple[Path, int]:
    """``m2r2 draft-vocab``: store the ``size`` most frequent tokens in a drafter's file (fast-stream
    adapters, Medusa heads or an EAGLE head; rewritten atomically, or written to ``out``); returns
    the file and the vocabulary size kept."""
    from m2r2 import weightfile
    from m2r2.decoding import eagle, medusa
    from m2r2.multirate import io

    src = adapters or io.bundled_adapters(engine.fingerprint, "prefix")
    if src is None:
        raise InputError("no adapters ship for this base model; pass --adapters PATH")
    src = Path(src)
    model, fp = engine.model, engine.fingerprint
    if medusa.is_heads_file(src):
        drafter, kind = medusa.load_heads(src, model, fp), medusa.HEADS
        save = functools.partial(medusa.save_heads, heads=drafter, fingerprint=fp)
    elif eagle.is_head_file(src):
        drafter, kind = eagle.load_head(src, model, fp), eagle.HEAD
        save = functools.partial(eagle.save_head, head=drafter, fingerprint=fp)
    else:
        drafter, kind = io.load_adapters(src, model, fp), io.ADAPTERS
        save = functools.partial(io.save_adapters, stream=drafter, fingerprint=fp)
    hf = engine.tokenizer.hf

    def encode(texts: list[str]) -> list[list[int]]:
        return hf(texts, add_special_tokens=False)["input_ids"]

    vocab = model.cfg.vocab_size
    size = min(size, vocab)
    drafter.draft_vocab = build_from_files(data, prompts, size, vocab, engine.tokenizer.eos_ids, encode)
    written = ("format", "version", "config", "base_fingerprint", "weights_sha256", "dtype")  # the saver's own
    info = {k: v for k, v in weightfile.read_meta(src, kind).items() if k not in written}
    info["draft_vocab"] = {"size": size, "data": str(data), "prompts": str(prompts) if prompts else None}
    out = out or src
    save(out, **info)
    return weightfile.weights_path(out), size
