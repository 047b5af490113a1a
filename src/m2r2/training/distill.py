"""Self-distillation data: training prompts answered by the base model itself.

The fast stream must learn the distribution it will later draft, so its training text is the
base model's own (greedy) answers. Generation is batched (left padding, masked pad keys, and
finished rows dropped from the batch) because a 1-row decode step leaves most of a CPU's matmul
throughput unused. Output is one JSONL line per answer, flushed per batch; a rerun skips ids
already written, so an interrupted run resumes where it stopped. Eval sets are refused by path.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from m2r2.errors import InputError, SettingsError
from m2r2.model import Transformer
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
def generate_batch(model: Transformer, prompts: list[list[int]], max_new: int, eos_ids: list[int]) -> list[list[int]]:
    """Greedy answers for several prompts at once (left-padded; pads masked out of attention).

    RoPE is relative, so shifting a prompt right by its padding leaves its attention scores
    unchanged; pad queries attend only to themselves so no row of the mask is empty.
    """
    dev = model.device
    b, plen = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, plen, dtype=torch.long, device=dev)
    valid = torch.ones(b, plen + max_new, dtype=torch.bool, device=dev)
    for i, p in enumerate(prompts):
        ids[i, plen - len(p) :] = torch.tensor(p, device=dev)
        valid[i, : plen - len(p)] = False
    cache = model.new_cache(plen + max_new, batch=b)
    rows = torch.arange(b, device=dev)  # original row of each live batch row
    out: list[list[int]] = [[] for _ in range(b)]
    eos = torch.tensor(eos_ids or [-1], device=dev)
    x, pos = ids, 0
    for _ in range(max_new):
        t = x.shape[1]
        keys = torch.arange(pos + t, device=dev)
        causal = keys[None, :] <= torch.arange(pos, pos + t, device=dev)[:, None]
        self_key = keys[None, :] == torch.arange(pos, pos + t, device=dev)[:, None]
        mask = (causal & valid[rows, None, : pos + t]) | self_key
        cos, sin = model.rope(pos, t, model.dtype)
        h = model.embed_tokens(x)
        for li, layer in enumerate(model.layers):
            h = layer(h, cos, sin, cache, li, pos, mask[:, None])
        nxt = model.head(h[:, -1]).argmax(-1)
        pos += t
        done = torch.isin(nxt, eos)
        for r, tok, d in zip(rows.tolist(), nxt.tolist(), done.tolist(), strict=True):
            if not d:
                out[r].append(tok)
        keep = ~done
        if not bool(keep.any()):
            break
        if not bool(keep.all()):  # drop finished rows: no compute is spent on them any more
            cache.k, cache.v = cache.k[:, keep], cache.v[:, keep]
            rows, nxt = rows[keep], nxt[keep]
        x = nxt[:, None]
    return out


@dataclass
class DistillSettings:
    prompts: Path
    out: Path
    limit: int = 2000
    max_new_tokens: int = 256
    max_prompt_tokens: int = 384
    batch: int = 16
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


def _batches(
    todo: list[tuple[dict[str, Any], list[int]]], size: int
) -> Iterator[list[tuple[dict[str, Any], list[int]]]]:
    # Sort each window of 8 batches by prompt length: less padding, order still deterministic.
    win = size * 8
    for i in range(0, len(todo), win):
        chunk = sorted(todo[i : i + win], key=lambda x: len(x[1]))
        for j in range(0, len(chunk), size):
            yield chunk[j : j + size]


def distill(
    model: Transformer,
    encode_chat: Callable[[list[dict[str, str]]], list[int]],
    eos_ids: list[int],
    s: DistillSettings,
    progress: Callable[[int, int, float], None] | None = None,
) -> int:
    """Answer ``s.limit`` rebalanced prompts into ``s.out`` (append-only); returns answers written now."""
    if s.batch < 1 or s.max_new_tokens < 1 or s.limit < 0:
        raise SettingsError("batch and max_new_tokens must be >= 1, limit >= 0")
    refuse_eval(s.out)
    items = rebalance(read_prompts(s.prompts), s.weights)
    s.out.parent.mkdir(parents=True, exist_ok=True)
    seen = done_ids(s.out)
    todo: list[tuple[dict[str, Any], list[int]]] = []
    kept = 0
    for it in items:
        if s.limit and kept >= s.limit:
            break
        ids = encode_chat([{"role": "user", "content": it["turns"][0]}])
        if len(ids) > s.max_prompt_tokens:
            continue
        kept += 1
        if it["id"] not in seen:
            todo.append((it, ids))
    written, t0 = 0, time.perf_counter()
    with s.out.open("a") as f:
        for chunk in _batches(todo, s.batch):
            answers = generate_batch(model, [p for _, p in chunk], s.max_new_tokens, eos_ids)
            for (it, p), a in zip(chunk, answers, strict=True):
                rec = {"id": it["id"], "source": it["source"], "prompt_ids": p, "answer_ids": a}
                f.write(json.dumps(rec) + "\n")
            f.flush()
            written += len(chunk)
            if progress is not None:
                progress(len(seen) + written, kept, time.perf_counter() - t0)
    return written


def to_tensor(ids: list[int]) -> Tensor:
    return torch.tensor(ids, dtype=torch.long)
