"""Agreement at the first draft as ``m2r2`` runs it, for several seeded streams on the same answers.

    python experiments/first_draft.py ADAPTERS [ADAPTERS ...] [--prompts N] [--dataset NAME] [--threads N]
                                      [--model NAME] [--head-bits 4|8] [--dtype fp32 --kernel plain]

The model's greedy answers (``vanilla`` on the default decoding kernel, 96 new tokens) to the first N first
turns of an eval set; each stream in its inference form (folded layers, the draft head in ``--head-bits``
blocks, as ``m2r2`` builds it) teacher-forced on them (:func:`m2r2.training.evaluate.first_draft_agreement`):
the acceptance a tree's first level sees, on the states and tokens verification really uses. Also the share
of answer tokens inside each stream's draft vocabulary (a draft outside it can never be accepted).
"""

import argparse
import json

from m2r2.bench.datasets import shared_eval_dir
from m2r2.engine import Engine
from m2r2.training.evaluate import as_drafted, greedy_records

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("adapters", nargs="+", help="seeded stream files ('shipped' = the bundled one)")
parser.add_argument("--prompts", type=int, default=60)
parser.add_argument("--dataset", default="mt_bench")
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--model", default=None)
parser.add_argument("--head-bits", type=int, default=4)
parser.add_argument("--dtype", default="bf16", help="bf16 (default) or fp32 (with --kernel plain: the training form's)")
parser.add_argument("--kernel", default="auto", help="decoding kernel (default auto, what m2r2 runs)")
args = parser.parse_args()

engine = Engine(args.model, dtype=args.dtype, kernel=args.kernel, threads=args.threads, quiet=True)
rows = [json.loads(x) for x in (shared_eval_dir() / f"{args.dataset}.jsonl").open()][: args.prompts]
records = greedy_records(engine, [row["turns"][0] for row in rows], 96)
n = sum(len(a) for _, a in records)
print(f"{len(records)} {args.dataset} first turns, {n} answer tokens, kernel {engine.kernel}")
print("| stream | answer tokens in its draft vocabulary | agree @1 |")
print("|---|--:|--:|")
for path in args.adapters:
    rep = as_drafted(engine, records, None if path == "shipped" else path, args.head_bits)
    print(f"| {path} | {rep['answer_tokens_in_draft_vocab']:.3f} | {rep['first_draft_as_drafted']:.3f} |")
