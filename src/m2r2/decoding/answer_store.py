"""An answer store: the base model's own phrasing, a third source of tree nodes beside the drafter and
prompt lookup (retrieval drafting in the manner of REST, He et al. 2024, from the model's own answers).

Why (measured, BENCHMARKS.md "Thirteenth round"): a 135M model's greedy answers reuse their phrasing
across prompts ("Here are some ...", list scaffolding, closing lines). An n-gram table of its answers
to *training* prompts proposes the next few tokens at no drafting cost: for each 4-, 3- and 2-gram
seen at least ``min_count`` times, the token that most often followed it and its *share* of what
followed (how sure the table is); a proposal follows the longest n-gram that ends the context, token
after token. The share predicts acceptance (replayed on MT-Bench answers: right 0.75-0.91 of the time
where it is >= 0.9, 0.02-0.31 where it is < 0.3; BENCHMARKS.md "Fourteenth round"), so the tree weighs
each proposed node by the product of the shares along its chain, calibrated per sequence, and the
verifier's cost model spends rows only where a chain is likely to hold. Greedy only, like prompt
lookup; outputs stay the plain greedy ones (every node is verified).

Built by ``m2r2 answer-store`` from ``distill-data`` files; stored as a bound weight file
(``NAME.safetensors`` + ``NAME.json``: base model fingerprint, checksum), refused for another model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from m2r2 import weightfile
from m2r2.errors import InputError, SettingsError

KIND = weightfile.Kind(
    format="m2r2-answer-store",
    name="answer store",
    title="an m2r2 answer store config",
    trains="`m2r2 answer-store --data ANSWERS.jsonl`",
    none_shipped="no answer store ships for this base model; build one with `m2r2 answer-store`",
)
VERSION = 2  # 2: follower shares stored beside the followers
#: n-gram orders, longest first: a proposal follows the longest that ends the context
ORDERS = (4, 3, 2)


#: a follower's share of what followed its n-gram is stored in 8 bits (k / 255)
SHARE_STEPS = 255


class AnswerStore:
    """``tables[n]``: n-gram (tuple of token ids) -> (the token that most often followed it, that token's
    share of the n-gram's followers, k / 255)."""

    def __init__(self, tables: dict[int, dict[tuple[int, ...], tuple[int, float]]]) -> None:
        self.tables = {n: tables.get(n, {}) for n in ORDERS}

    @classmethod
    def build(cls, answers: list[list[int]], min_count: int = 2) -> AnswerStore:
        if min_count < 1:
            raise SettingsError(f"min_count must be >= 1, got {min_count}")
        return cls.from_tensors(_tables(answers, min_count))

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> AnswerStore:
        tables = {}
        for n in ORDERS:
            grams, nxt, share = (tensors.get(f"{key}{n}") for key in ("grams", "next", "share"))
            if grams is None or nxt is None or grams.dim() != 2 or grams.shape[1] != n or len(grams) != len(nxt):
                raise InputError(f"answer store tensors grams{n}/next{n} are missing or malformed")
            if share is None or share.shape != nxt.shape:
                raise InputError(
                    "this answer store has no follower shares (built by an older m2r2): rebuild it with "
                    "`m2r2 answer-store`"
                )
            grams, nxt = _widen(grams), _widen(nxt)
            shares = (share.to(torch.float64) / SHARE_STEPS).tolist()
            tables[n] = dict(zip(map(tuple, grams.tolist()), zip(nxt.tolist(), shares, strict=True), strict=True))
        return cls(tables)

    def to_tensors(self) -> dict[str, Tensor]:
        """Token ids as int16 bit patterns where every id fits 16 bits (half the file), else int32."""
        out, shares = {}, {}
        for n, table in self.tables.items():
            out[f"grams{n}"] = torch.tensor(list(table), dtype=torch.int32).reshape(-1, n)
            out[f"next{n}"] = torch.tensor([t for t, _ in table.values()], dtype=torch.int32)
            shares[f"share{n}"] = torch.tensor([round(s * SHARE_STEPS) for _, s in table.values()], dtype=torch.uint8)
        if all(t.numel() == 0 or (int(t.max()) < 1 << 16 and int(t.min()) >= 0) for t in out.values()):
            out = {k: (t - (t >= 1 << 15).int() * (1 << 16)).to(torch.int16) for k, t in out.items()}
        return out | shares

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables.values())

    def propose(self, context: list[int], k: int) -> tuple[list[int], list[float]]:
        """Up to ``k`` tokens, each the most frequent follower of the longest n-gram ending the context
        (extended by the tokens proposed so far), and each one's share of its n-gram's followers."""
        tail, out, shares = list(context[-ORDERS[0] :]), [], []
        for _ in range(k):
            hit = None
            for n in ORDERS:
                if len(tail) >= n and (hit := self.tables[n].get(tuple(tail[-n:]))) is not None:
                    break
            if hit is None:
                break
            out.append(hit[0])
            shares.append(hit[1])
            tail = [*tail[1:], hit[0]]
        return out, shares


def _widen(ids: Tensor) -> Tensor:
    """Token ids stored as int16 bit patterns (ids up to 65,535) back to their values."""
    return ids.to(torch.int32) & 0xFFFF if ids.dtype == torch.int16 else ids


def _tables(answers: list[list[int]], min_count: int) -> dict[str, Tensor]:
    """Per order n: every (n-gram, next) pair of ``answers`` counted, and per n-gram the follower seen
    most often (ties: the smaller token id), kept where it was seen at least ``min_count`` times, with
    its share of all the n-gram's followers in 8 bits."""
    out = {}
    for n in ORDERS:
        rows = [torch.tensor(a, dtype=torch.long).unfold(0, n + 1, 1) for a in answers if len(a) > n]
        if not rows:
            out[f"grams{n}"], out[f"next{n}"] = torch.zeros(0, n, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
            out[f"share{n}"] = torch.zeros(0, dtype=torch.uint8)
            continue
        pairs, counts = torch.unique(torch.cat(rows), dim=0, return_counts=True)  # sorted by (n-gram, next)
        new_gram = torch.ones(len(pairs), dtype=torch.bool)
        new_gram[1:] = (pairs[1:, :n] != pairs[:-1, :n]).any(dim=1)
        group = new_gram.cumsum(0)
        # within each n-gram's run, the pair with the highest count (stable: the smaller id on ties)
        order = torch.sort(-counts, stable=True).indices
        order = order[torch.sort(group[order], stable=True).indices]
        first = torch.ones(len(order), dtype=torch.bool)
        first[1:] = group[order][1:] != group[order][:-1]
        best = order[first]
        best = best[counts[best] >= min_count]
        totals = torch.zeros(int(group[-1]) + 1, dtype=counts.dtype).index_add_(0, group, counts)
        share = counts[best].double() / totals[group[best]].double()
        out[f"grams{n}"] = pairs[best, :n].to(torch.int32).contiguous()
        out[f"next{n}"] = pairs[best, n].to(torch.int32).contiguous()
        out[f"share{n}"] = (share * SHARE_STEPS).round().to(torch.uint8)
    return out


def read_answers(paths: list[Path]) -> list[list[int]]:
    """``answer_ids`` of ``m2r2 distill-data`` files (the base model's own answers to training prompts)."""
    from m2r2.paths import refuse_eval

    answers = []
    for path in paths:
        refuse_eval(path)
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise InputError(f"cannot read answers {path}: {e}") from e
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["answer_ids"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise InputError(f"{path}:{i + 1}: not a distill-data record (no answer_ids)") from None
            answers.append([int(t) for t in ids])
    if not answers:
        raise InputError("no answers in " + ", ".join(map(str, paths)))
    return answers


def save_answer_store(path: Path, store: AnswerStore, fingerprint: str, **info: object) -> Path:
    sizes = {str(n): len(t) for n, t in store.tables.items()}
    return weightfile.save(
        path, store.to_tensors(), KIND, fingerprint, VERSION, {"orders": list(ORDERS)}, entries=sizes, **info
    )


def load_answer_store(path: Path, fingerprint: str) -> AnswerStore:
    tensors, _ = weightfile.load(Path(path), KIND, fingerprint)
    return AnswerStore.from_tensors(tensors)


def answer_store_for(fingerprint: str, answers: str | None) -> AnswerStore | None:
    """A tree method's ``answers`` option: None = the store shipped for this base model (if any),
    ``none`` = off, else a store file."""
    if answers is not None and answers.lower() in ("none", "off", "0"):
        return None
    path = Path(answers) if answers else weightfile.bundled(KIND, fingerprint)
    return load_answer_store(path, fingerprint) if path is not None else None
