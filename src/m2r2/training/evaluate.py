"""Alignment report: how well each fast layer stands in for the full model, on eval prompts.

Teacher-forced on the base model's own greedy answers (what a drafter must predict), per fast
layer j: top-1 agreement of ``logits_j`` with the full model, cosine alignment of ``Norm(f_j)`` to
the slow target ``Norm(h_{R*j})``, and ARLA's calibration (precision and coverage of the exits it
allows at a few thresholds); side by side with the plain early exit ``W . Norm(h_j)`` at the same
depth without adapters. Also an expected speculative speedup from the acceptance and the cost
of a draft step relative to a full step (weights read per token: the LM head counts in both).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from m2r2 import amx
from m2r2.decoding.costs import expected_tokens
from m2r2.errors import InputError
from m2r2.files import atomic_text
from m2r2.model import Transformer
from m2r2.multirate.adapters import projection_shapes
from m2r2.multirate.fast import FastStream, block_starts
from m2r2.training.loop import collate, make_sequences

if TYPE_CHECKING:
    from m2r2.decoding.base import Loaded

THRESHOLDS = (0.5, 0.7, 0.9)


def eval_prompts(dataset: str, root: Path, limit: int) -> list[str]:
    """First turns of an eval set (``root/NAME.jsonl`` or a JSONL path)."""
    path = Path(dataset) if dataset.endswith(".jsonl") else root / f"{dataset}.jsonl"
    if not path.is_file():
        raise InputError(f"eval set {path} not found")
    items = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [it["turns"][0] for it in items[: limit or None]]


def step_costs(model: Transformer, stream: FastStream) -> tuple[float, float]:
    """Weights read per token by a draft step and by a full step (decode on CPU is memory-bound).

    Counted from the shapes (packed kernels hold their weights in buffers, not parameters). A
    dense layer's projections; a draft step adds the low-rank deltas unless they are folded in
    (``freeze(merge=True)``), where a fast layer reads what a base layer reads, and reads only its
    draft vocabulary's rows of the head when it has one.
    """
    cfg = model.cfg
    layer = sum(i * o for i, o in projection_shapes(cfg).values())
    head = cfg.vocab_size * cfg.hidden_size
    draft_head = head
    if stream.sub_head is not None and stream.draft_vocab is not None:
        draft_head = stream.draft_vocab.numel() * cfg.hidden_size
    lora = 0 if stream.merged is not None else sum(p.numel() for p in stream.adapters[0].parameters())
    return stream.cfg.depth * (layer + lora) + draft_head, cfg.num_layers * layer + head


def expected_speedup(alpha: float, cost_ratio: float, max_gamma: int = 8) -> tuple[float, int]:
    """Best ``(speedup, gamma)`` for i.i.d. acceptance ``alpha`` (Leviathan et al.'s formula)."""
    best = (1.0, 0)
    for g in range(1, max_gamma + 1):
        best = max(best, (expected_tokens(alpha, g) / (g * cost_ratio + 1), g))
    return best


@torch.no_grad()
def align_report(
    stream: FastStream, records: list[dict[str, Any]], block: int = 1, batch: int = 4, max_len: int = 512
) -> dict[str, Any]:
    """Per-fast-layer metrics over ``records`` (prompt_ids + answer_ids), drafting blocks of ``block``."""
    model, cfg = stream.base, stream.cfg
    seqs = make_sequences(records, max_len)
    k = cfg.depth
    sums: dict[str, list[float]] = {n: [0.0] * (k + 1) for n in ("agree_fast", "agree_plain", "cos_fast", "cos_plain")}
    probs: list[list[torch.Tensor]] = [[] for _ in range(k + 1)]
    hits: list[list[torch.Tensor]] = [[] for _ in range(k + 1)]
    count = 0
    for i in range(0, len(seqs), batch):
        tokens, mask = collate(seqs[i : i + batch])
        tokens, mask = tokens.to(model.device), mask.to(model.device)
        cache = model.new_cache(tokens.shape[1], batch=tokens.shape[0])
        h = [model.embed_tokens(tokens)]
        with amx.decoding_bits():
            model.run_layers(h[0], cache, 0, h)
        states = stream.forward_train(h[0], cache.k, cache.v, block_starts(tokens.shape[1], [block] * tokens.shape[1]))
        top = model.head(h[-1][mask]).argmax(-1)
        sel = [f[mask] for f in states]
        count += top.shape[0]
        for j in range(1, k + 1):
            target = model.norm(h[cfg.target(j)][mask]).float()
            fast_hit = stream.exit_logits(sel[j]).argmax(-1) == top
            sums["agree_fast"][j] += fast_hit.sum().item()
            sums["agree_plain"][j] += (model.head(h[j][mask]).argmax(-1) == top).sum().item()
            sums["cos_fast"][j] += F.cosine_similarity(model.norm(sel[j]).float(), target, dim=-1).sum().item()
            sums["cos_plain"][j] += F.cosine_similarity(model.norm(h[j][mask]).float(), target, dim=-1).sum().item()
            probs[j].append(torch.sigmoid(stream.arla(sel, j)).float().cpu())
            hits[j].append(fast_hit.cpu())
    if not count:
        raise InputError("no answer positions to evaluate")
    layers = []
    for j in range(1, k + 1):
        row: dict[str, Any] = {
            "layer": j,
            "base_layer": cfg.path[j - 1] + 1,
            "target_layer": cfg.target(j),
            "exit": j in cfg.exits,
        }
        row |= {n: v[j] / count for n, v in sums.items()}
        p, y = torch.cat(probs[j]), torch.cat(hits[j]).float()
        row["arla_mean_prob"] = float(p.mean())  # calibrated in the mean when close to agree_fast
        for t in THRESHOLDS:
            on = p >= t
            row[f"arla_precision@{t}"] = float(y[on].mean()) if bool(on.any()) else None
            row[f"arla_coverage@{t}"] = float(on.float().mean())
        layers.append(row)
    draft, full = step_costs(model, stream)
    alpha = layers[max(cfg.exits) - 1]["agree_fast"]
    speed, gamma = expected_speedup(alpha, draft / full)
    return {
        "positions": count,
        "block": block,
        "config": cfg.to_dict(),
        "layers": layers,
        "draft_cost_ratio": draft / full,
        "expected_speedup": speed,
        "best_gamma": gamma,
    }


Records = list[tuple[list[int], list[int]]]


@torch.inference_mode()
def _drafts_and_picks(model: Transformer, drafter: Any, records: Records) -> list[tuple[list[int], list[int]]]:
    """Per record, the first drafts of :func:`first_drafts` and the model's own pick at the same positions, both
    from one pass of the model over the record."""
    from m2r2.decoding.tree import Tree
    from m2r2.kernels import head_argmax

    out = []
    for prompt, answer in records:
        full = prompt + answer
        cache = model.new_cache(len(full) + 8)
        with amx.decoding_bits():  # the states decoding's passes give (a prompt's prefill has bits of its own)
            h = model.run_layers(model.embed_tokens(torch.tensor([full], device=model.device)), cache, 0)
        row = []
        for p in range(len(prompt), len(full)):
            slow = cache.k[:, :, :, p].clone(), cache.v[:, :, :, p].clone()
            drafter.start(h[:, p - 1 : p], cache, p)
            top, _ = drafter.top(Tree([full[p]], [-1], [0], [1.0]), [0], 1)
            row.append(int(top[0, 0]))
            # the draft wrote its fast K/V into slot p, which decoding's next verify pass overwrites: put the slow
            # K/V back, or every later position's draft reads a fast key among the slow ones
            cache.k[:, :, :, p], cache.v[:, :, :, p] = slow
        out.append((row, head_argmax(model, h)[0, len(prompt) :].tolist()))
    return out


def first_drafts(model: Transformer, drafter: Any, records: Records) -> list[list[int]]:
    """Per ``(prompt_ids, answer_ids)`` record, a tree drafter's first draft at every answer position, in the
    form ``m2r2`` runs it (folded layers, the decoding kernel, the draft head's kernel).

    Teacher-forced: at answer position p the drafter is seeded as a tree's first level is after a verify pass
    that accepted tokens up to p, with the model's final state at p - 1 and the token at p.
    """
    return [drafts for drafts, _ in _drafts_and_picks(model, drafter, records)]


def first_draft_agreement(model: Transformer, drafter: Any, records: Records) -> float:
    """Share of answer positions at which :func:`first_drafts` is the token the model itself picks next there:
    the acceptance a tree's first level sees, on the decoding kernel's states and tokens, which is what
    verification accepts or rejects (the training form, ``eval-align``, runs float32 states)."""
    pairs = _drafts_and_picks(model, drafter, records)
    hits = sum(d == t for drafts, picks in pairs for d, t in zip(drafts, picks, strict=True))
    return hits / max(sum(len(drafts) for drafts, _ in pairs), 1)


def greedy_records(engine: Loaded, prompts: list[str], max_new_tokens: int) -> Records:
    """``(prompt_ids, answer_ids)`` of the engine's ``vanilla`` greedy answers, on its own kernel: the tokens
    verification checks drafts against when ``m2r2`` runs on that kernel."""
    from m2r2.decoding.base import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    records = []
    for p in prompts:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": p}])
        records.append((ids, engine.generate_ids(ids, "vanilla", gen).tokens))
    return records


def as_drafted(engine: Loaded, records: Records, adapters: Path | None = None, head_bits: int = 4) -> dict[str, Any]:
    """The first draft of a seeded stream as ``m2r2`` builds and runs it on ``engine`` (:func:`first_draft_agreement`),
    and the share of the answers' tokens inside its draft vocabulary (a draft outside it is never accepted)."""
    options: dict[str, Any] = {"head_bits": head_bits} | ({"adapters": str(adapters)} if adapters else {})
    drafter = engine.strategy("m2r2", **options).drafter
    vocab = set(drafter.fast.draft_vocab.tolist()) if drafter.fast.draft_vocab is not None else None
    tokens = [t for _, answer in records for t in answer]
    inside = 1.0 if vocab is None else sum(t in vocab for t in tokens) / max(len(tokens), 1)
    return {
        "first_draft_as_drafted": first_draft_agreement(engine.model, drafter, records),
        "answer_tokens_in_draft_vocab": inside,
        "decoding_kernel": engine.kernel,
        "as_drafted_positions": len(tokens),
    }


def markdown(rep: dict[str, Any]) -> str:
    head = "| fast layer | base layer | target | agree fast | agree plain | cos fast | cos plain |"
    head += "".join(f" ARLA prec/cov @{t} |" for t in THRESHOLDS)
    lines = [head, "|" + "---|" * (7 + len(THRESHOLDS))]
    for r in rep["layers"]:
        cells = [f"{r['layer']}{'*' if r['exit'] else ''}", r["base_layer"], r["target_layer"]]
        cells += [f"{r[n]:.3f}" for n in ("agree_fast", "agree_plain", "cos_fast", "cos_plain")]
        for t in THRESHOLDS:
            p = r[f"arla_precision@{t}"]
            cells.append(f"{'-' if p is None else f'{p:.2f}'} / {r[f'arla_coverage@{t}']:.2f}")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines.append(
        f"\n{rep['positions']} answer positions, draft block {rep['block']}; * = trained exit. Draft step costs "
        f"{rep['draft_cost_ratio']:.2f} of a full step; expected speculative speedup "
        f"{rep['expected_speedup']:.2f}x at gamma={rep['best_gamma']}."
    )
    return "\n".join(lines)


def eval_align(
    engine: Loaded,
    dataset: str,
    eval_root: Path,
    limit: int,
    max_new_tokens: int,
    batch: int,
    block: int = 1,
    adapters: Path | None = None,
    answers: Path | None = None,
    merged: bool = False,
) -> dict[str, Any]:
    """``m2r2 eval-align``: teacher-forced agreement on the base model's greedy answers to eval prompts.

    ``answers`` keeps those answers (JSONL) so that several adapters are compared on the same ones.
    """
    from m2r2 import weightfile
    from m2r2.decoding.eagle import is_head_file, load_head
    from m2r2.decoding.medusa import is_heads_file, load_heads
    from m2r2.decoding.two_model import DRAFT, load_draft
    from m2r2.multirate.io import load_default
    from m2r2.multirate.seeded import SeededFastStream
    from m2r2.training.distill import generate_batch
    from m2r2.training.draft_train import draft_trainee
    from m2r2.training.eagle_train import eagle_trainee
    from m2r2.training.seeded_train import held_out_agreement, medusa_trainee, seeded_trainee

    if adapters is not None and is_heads_file(adapters):
        stream = load_heads(adapters, engine.model, engine.fingerprint)
        trainee = medusa_trainee(stream)
    elif adapters is not None and is_head_file(adapters):  # EAGLE: depths 1..4 on its own features
        stream = load_head(adapters, engine.model, engine.fingerprint)
        trainee = eagle_trainee(stream)
    elif adapters is not None and weightfile.is_kind(adapters, DRAFT):  # a draft model: next-token agreement
        stream = load_draft(adapters, engine.model, engine.fingerprint)
        trainee = draft_trainee(stream)
    else:
        stream = load_default(engine.model, engine.fingerprint, adapters)
        trainee = seeded_trainee(stream, chain=4) if isinstance(stream, SeededFastStream) else None
    if trainee is None:
        stream.to(engine.model.device).freeze(merge=merged)
    prompts = eval_prompts(dataset, eval_root, limit)
    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    records: list[dict[str, Any]] = []
    if answers is not None and answers.is_file():  # the base model's answers, reused across adapters
        records = [json.loads(x) for x in answers.read_text().splitlines() if x.strip()]
        if [r["prompt_ids"] for r in records] != ids:
            raise InputError(f"{answers} holds answers to other prompts; delete it or pick another path")
    with torch.inference_mode():
        for i in range(0 if not records else len(ids), len(ids), batch):
            out = generate_batch(engine.model, ids[i : i + batch], max_new_tokens, engine.tokenizer.eos_ids)
            records += [{"prompt_ids": p, "answer_ids": a} for p, a in zip(ids[i : i + batch], out, strict=True)]
        if answers is not None and not answers.is_file():
            atomic_text(answers, "".join(json.dumps(r) + "\n" for r in records))
        if trainee is not None:  # per draft position, the training form (float32) over the same answers
            seqs = [(r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"])) for r in records]
            seeded = isinstance(stream, SeededFastStream)
            keys = ("agree", "agree_exact") if seeded else ("agree",)
            agree, *exact = held_out_agreement(engine.model, trainee, seqs, keys)
            rep = {"kind": stream.cfg.kind, "agree_per_draft_position": agree}
            # the drafts that can be accepted: the model's own token, not its best guess in the draft vocabulary
            rep |= {"agree_exact_per_draft_position": exact[0]} if seeded else {}
            rep |= {"layers": stream.cfg.layers} if isinstance(stream, SeededFastStream) else {}
        else:
            rep = align_report(stream, records, block=block)
    rep["dataset"], rep["prompts"] = dataset, len(prompts)
    return rep
