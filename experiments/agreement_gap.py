"""Where the gap between the training store's hold-out agreement (~0.59 at draft 1) and MT-Bench's
(~0.45) comes from: the same stream, teacher-forced the same way, on the model's own answers to
training-pool prompts that no stream trained on against its answers to MT-Bench, by answer position,
and with the prompt's positions counted (as the store hold-out counts them) or not.

    python experiments/agreement_gap.py [ADAPTERS] [OWN_ANSWERS] [N]

OWN_ANSWERS: a `distill-data` JSONL whose last N (default 60) answers no stream trained on
(default runs/distill/answers-fresh-snap2.jsonl: streams so far saw its first 5,280).
Float32 training form, drafts 1-4, as `eval-align` reports them.
"""

import json
import sys
from pathlib import Path

from m2r2.engine import Engine
from m2r2.multirate.io import bundled_adapters, load_default
from m2r2.training.seeded_train import agreement, answers_store, seeded_trainee

adapters = Path(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "-" else None
own = Path(sys.argv[2] if len(sys.argv) > 2 else "runs/distill/answers-fresh-snap2.jsonl")
n = int(sys.argv[3]) if len(sys.argv) > 3 else 60
engine = Engine(dtype="fp32", kernel="plain", threads=int(__import__("os").environ.get("THREADS", "1")), quiet=True)
path = adapters or bundled_adapters(engine.fingerprint, "seeded")
trainee = seeded_trainee(load_default(engine.model, engine.fingerprint, path), chain=4)


def records(p: Path, last: int | None = None) -> list[tuple[list[int], list[int]]]:
    rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    rows = rows[-last:] if last else rows
    return [(r["prompt_ids"], r["answer_ids"]) for r in rows]


def measure(name: str, recs: list[tuple[list[int], list[int]]], lo: int, hi: int, with_prompt: bool = False) -> None:
    """Agreement over answer positions [lo, hi) (teacher-forced on prompt + answer[:hi])."""
    seqs = [(p + a[:hi], len(p) + lo) for p, a in recs if len(a) > lo]
    rows = answers_store(engine.model, [s for s, _ in seqs], len(trainee.kv_layers), trainee.taps)
    starts = None if with_prompt else [s for _, s in seqs]
    agree = agreement(trainee, rows, starts)
    tokens = sum(len(s) - st for s, st in seqs)
    print(
        f"| {name} | {lo}-{hi} | {'yes' if with_prompt else 'no'} | {len(seqs)} | {tokens} | "
        + " | ".join(f"{x:.3f}" for x in agree)
        + " |",
        flush=True,
    )


mt = records(Path("runs/eval/mt_bench-60-96-fp32.jsonl"))
mine = records(own, n)
print(f"{path}; MT-Bench 60 (runs/eval/mt_bench-60-96-fp32.jsonl) against the last {n} answers of {own}")
print("| answers | answer positions | prompt counted | sequences | tokens | @1 | @2 | @3 | @4 |")
print("|---|---|---|--:|--:|--:|--:|--:|--:|")
measure("MT-Bench", mt, 0, 96)
measure("MT-Bench", mt, 0, 32)
measure("MT-Bench", mt, 32, 96)
measure("own, held out", mine, 0, 96)
measure("own, held out", mine, 0, 32)
measure("own, held out", mine, 32, 96)
measure("own, held out", mine, 96, 256)
measure("own, held out", [(p, a[: 256 - len(p)]) for p, a in mine], 0, 256, with_prompt=True)
