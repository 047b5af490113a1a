"""Where a copy source already drafts the next token, so that fast-stream training can weigh it down.

Why (BENCHMARKS.md, twenty-fourth round): `m2r2`'s tree verifies the fast stream's drafts beside
copies (prompt lookup and the answer store), and copies supply ~0.4 of all accepted tokens. A stream
trained with a decayed rate accepted 11% more tokens a pass with copies off but 1% more with them on:
it had improved where the copies were right already. A draft the copies make redundant earns nothing,
so ``train-seeded --copy-w W`` scales the loss at such positions by ``W`` and spends the stream's
capacity where a copy is wrong.

A position counts as copied when the first token that prompt lookup (over the sequence so far, as
:meth:`m2r2.decoding.tree.TreeSpeculative.prefilled` indexes a request) or the answer store proposes is the
sequence's next token: the copy a first draft competes with. Deeper drafts get the label of their
own position (an approximation: the copy chain that competes with a draft at depth ``s`` started
``s - 1`` tokens earlier).

Measured (docs/TRAINING.md, twenty-fifth round): at ``W`` 0.5 and 0.25 the SmolLM2 stream's first-draft
agreement where no copy is right rose by less than 0.01 and end to end it tied; the positions copies miss
are hard, not under-weighted. The shipped stream is trained with ``W`` = 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from m2r2.decoding.answer_store import AnswerStore, answer_store_for
from m2r2.decoding.lookup import NgramIndex


def copied_positions(tokens: list[int], store: AnswerStore | None) -> Tensor:
    """bool ``[n]``: position ``i`` is copied when lookup over ``tokens[: i + 1]`` or ``store`` proposes
    ``tokens[i + 1]`` first (the last position never is: it has no next token)."""
    out = torch.zeros(len(tokens), dtype=torch.bool)
    index = NgramIndex()
    for i, t in enumerate(tokens[:-1]):
        index.extend([t])
        nxt = tokens[i + 1]
        look = index.propose(1)
        if look and look[0] == nxt:
            out[i] = True
        elif store is not None:
            got, _ = store.propose(tokens[max(0, i - 3) : i + 1], 1)
            out[i] = bool(got) and got[0] == nxt
    return out


def copy_weights(tokens: list[int], store: AnswerStore | None, weight: float) -> Tensor:
    """float ``[n]``: ``weight`` at copied positions (:func:`copied_positions`), 1 elsewhere."""
    return torch.where(copied_positions(tokens, store), weight, 1.0)


def copy_weigher(fingerprint: str, weight: float, answers: str | None) -> Callable[[list[int]], Tensor]:
    """A sequence's tokens -> its loss weights (:func:`copy_weights`), judged with the answer store file
    ``answers`` (None: the one shipped for the base model; loaded here, before any training work)."""
    store = answer_store_for(fingerprint, answers)
    return lambda tokens: copy_weights(tokens, store, weight)
