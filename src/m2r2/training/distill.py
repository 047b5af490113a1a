"""Self-distillation data: training prompts answered by the base model itself.

The fast stream must learn the distribution it will later draft, so its training text is the
base model's own (greedy) answers, bit for bit those plain decoding gives. Generation is batched
(continuous batching over pooled caches, :func:`answer_stream`) because a 1-row decode step leaves
most of a CPU's matmul throughput unused. Output is one JSONL line per answer, written as it
finishes; a rerun skips ids already written, so an interrupted run resumes where it stopped. Eval
sets are refused by path.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from m2r2.cache import KVCache, KVPool
from m2r2.decoding.base import GenerationConfig, Stopper, begin
from m2r2.errors import InputError, SettingsError
from m2r2.kernels import head_argmax
from m2r2.model import ROW_INVARIANT_MAX_ROWS, Transformer
from m2r2.paths import load_distilled, refuse_eval  # noqa: F401 (load_distilled: re-exported)

#: Sampling weights per source: math (gsm8k) and code make up ~68% of the raw file, so they are
#: capped at ~25% together; the remaining chat-like sources share the rest. Unknown sources get 0.1.
SOURCE_WEIGHTS: dict[str, float] = {
    "gsm8k": 0.10,
    "gpteacher_codegen": 0.08,
    "code_alpaca": 0.06,
    "gpteacher_roleplay": 0.13,
    "p3_t0": 0.12,
    "oasst": 0.16,
    "lima": 0.16,
    "instruction_wild": 0.13,
    "self_instruct_seed": 0.06,
}


def read_prompts(path: Path) -> list[dict[str, Any]]:
    refuse_eval(path)
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise InputError(f"cannot read prompts {path}: {e}") from e
    return [json.loads(line) for line in lines if line.strip()]


def rebalance(items: list[dict[str, Any]], weights: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Deterministic interleaving of sources by weight (stride scheduling, file order within a source).

    Any prefix of the result has the target mix (until a source runs out), so a run stopped at
    any point, or a ``--limit``, still gets balanced data.
    """
    weights = weights or SOURCE_WEIGHTS
    by_src: dict[str, list[dict[str, Any]]] = {}
    for it in items:
        by_src.setdefault(str(it.get("source")), []).append(it)
    taken = dict.fromkeys(by_src, 0)
    out: list[dict[str, Any]] = []
    while True:
        live = [s for s in by_src if taken[s] < len(by_src[s]) and weights.get(s, 0.1) > 0]
        if not live:
            return out
        s = min(live, key=lambda s: ((taken[s] + 1) / weights.get(s, 0.1), s))
        out.append(by_src[s][taken[s]])
        taken[s] += 1


@torch.inference_mode()
def answer_stream(
    model: Transformer, prompts: Iterable[list[int]], max_new: int, eos_ids: list[int], live: int = 32
) -> Iterator[tuple[int, list[int]]]:
    """Greedy answers of ``prompts`` as they finish, ``(index, answer)``: up to ``live`` sequences decode together,
    each in its own cache of one pool, and a finished one's place goes to the next prompt at once (continuous
    batching: no batch waits for its longest answer).

    Each answer is the one plain greedy decoding gives (`vanilla`'s, bit for bit): a prompt is prefilled alone as
    every method prefills it, and each batched step gives every row its lone step's bits
    (:meth:`Transformer.greedy_steps`, one C++ call, where the kernel has it; else :meth:`Transformer.step_rows` and
    the head). The stream is trained on these answers and seeded by these states at inference. Off the CPU (a GPU)
    every live sequence steps in one call: a GPU's kernels give no row a lone step's bits anyway, and parts of 32 would
    multiply its kernel launches (not measured: no GPU was lent)."""
    gen = GenerationConfig(max_new_tokens=max_new)
    pool = KVPool(model.cfg, live, model.dtype, model.device)  # stored as decoding stores them
    todo = iter(enumerate(prompts))
    seqs: list[tuple[int, KVCache, Stopper]] = []  # (prompt index, cache, its tokens and where they end)
    while True:
        while len(seqs) < live and (nxt := next(todo, None)) is not None:
            i, prompt = nxt  # prefilled, at the capacity and with the stopping rules, as every method starts
            _, stopper, cache, logits = begin(model, prompt, gen, eos_ids, None, new_cache=pool.take)
            stopper.push([int(logits[0, -1].argmax())])
            seqs.append((i, cache, stopper))
        if not seqs:
            return
        stepping = [q for q in seqs if not q[2].done]
        size = ROW_INVARIANT_MAX_ROWS if model.device.type == "cpu" else max(1, len(stepping))
        for part in [stepping[j : j + size] for j in range(0, len(stepping), size)]:
            toks, caches = [q[2].tokens[-1] for q in part], [q[1] for q in part]
            fused = model.greedy_steps(toks, caches)
            picks = fused[0] if fused is not None else head_argmax(model, model.step_rows(toks, caches)[:, 0]).tolist()
            for q, tok in zip(part, picks, strict=True):
                q[2].push([tok])
        for q in [q for q in seqs if q[2].done]:
            seqs.remove(q)
            pool.give(q[1])
            yield q[0], q[2].tokens


def generate_batch(model: Transformer, prompts: list[list[int]], max_new: int, eos_ids: list[int]) -> list[list[int]]:
    """Greedy answers for several prompts at once, in their order (:func:`answer_stream`, all of them live)."""
    answers: list[list[int]] = [[] for _ in prompts]
    for i, answer in answer_stream(model, prompts, max_new, eos_ids, live=max(1, len(prompts))):
        answers[i] = answer
    return answers


@dataclass
class DistillSettings:
    prompts: Path
    out: Path
    limit: int = 2000
    max_new_tokens: int = 256
    max_prompt_tokens: int = 384
    batch: int = 16
    #: stop after the first answer written past this many minutes of the run (0 = no budget); a rerun resumes
    minutes: float = 0.0
    weights: dict[str, float] = field(default_factory=lambda: dict(SOURCE_WEIGHTS))


def done_ids(out: Path) -> set[str]:
    """Ids already answered; a half-written last line (killed mid-write) is cut off first."""
    if not out.exists():
        return set()
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        out.write_bytes(data)
    return {json.loads(line)["id"] for line in data.decode().splitlines() if line.strip()}


def distill(
    model: Transformer,
    encode_chat: Callable[[list[dict[str, str]]], list[int]],
    eos_ids: list[int],
    s: DistillSettings,
    progress: Callable[[int, int, float], None] | None = None,
) -> int:
    """Answer ``s.limit`` rebalanced prompts into ``s.out`` (append-only); returns answers written now. Prompts are
    tokenized as decoding reaches them (a run with a minutes' budget over 20k prompts starts at once)."""
    if s.batch < 1 or s.max_new_tokens < 1 or s.limit < 0 or s.minutes < 0:
        raise SettingsError("batch and max_new_tokens must be >= 1, limit and minutes >= 0")
    refuse_eval(s.out)
    items = rebalance(read_prompts(s.prompts), s.weights)
    s.out.parent.mkdir(parents=True, exist_ok=True)
    seen = done_ids(s.out)
    total = min(s.limit, len(items)) if s.limit else len(items)  # for progress: prompts over the length cap count
    todo: list[tuple[dict[str, Any], list[int]]] = []  # prompts handed to decoding, in order

    def pending() -> Iterator[list[int]]:
        kept = 0
        for it in items:
            if s.limit and kept >= s.limit:
                return
            ids = encode_chat([{"role": "user", "content": it["turns"][0]}])
            if len(ids) > s.max_prompt_tokens:
                continue
            kept += 1
            if it["id"] not in seen:
                todo.append((it, ids))
                yield ids

    written, t0 = 0, time.perf_counter()
    with s.out.open("a") as f:  # each answer as it finishes, a whole line at a time (done_ids cuts a torn one)
        for i, answer in answer_stream(model, pending(), s.max_new_tokens, eos_ids, s.batch):
            it, p = todo[i]
            f.write(json.dumps({"id": it["id"], "source": it["source"], "prompt_ids": p, "answer_ids": answer}) + "\n")
            f.flush()
            written += 1
            if progress is not None and written % s.batch == 0:
                progress(len(seen) + written, total, time.perf_counter() - t0)
            if s.minutes > 0 and time.perf_counter() - t0 >= 60 * s.minutes:
                break  # the answers still being decoded are dropped; a rerun answers them
    if progress is not None and written % s.batch:  # the last line, where the loop's was not
        progress(len(seen) + written, total, time.perf_counter() - t0)
    return written


def to_tensor(ids: list[int]) -> Tensor:
    return torch.tensor(ids, dtype=torch.long)
