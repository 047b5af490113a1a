"""Are `distill-data`'s answers the model's own greedy answers? Each answer of each file is set beside `vanilla`'s to
the same prompt (the same kernel, up to the file's longest answer, the end token left out as a record leaves it).

Why: the stream is trained on these answers and drafts, at inference, after the states plain decoding gives. Until
the forty-seventh round `distill-data` decoded left-padded batches op by op, whose rows do not carry a lone step's
bits, so an answer could leave the greedy path at a near-tie and stay off it; from then it decodes by continuous
batching with each row a lone step's bits (`m2r2.training.distill.answer_stream`).

    python experiments/distill_vs_vanilla.py ANSWERS.jsonl [ANSWERS.jsonl ...] [--limit N] [--threads N]
"""

import argparse
import json
from pathlib import Path

from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("files", nargs="+")
parser.add_argument("--limit", type=int, default=20)
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()

engine = Engine(threads=args.threads, quiet=True)
eos = engine.tokenizer.eos_ids
files = {f: [json.loads(line) for line in Path(f).read_text().splitlines() if line.strip()] for f in args.files}
ids = [r["id"] for r in files[args.files[0]]][: args.limit]
budget = max(len(r["answer_ids"]) for recs in files.values() for r in recs)
print(f"{engine.kernel} kernel; {len(ids)} prompts (the first file's first), vanilla up to {budget} tokens")
plain = {}
for recs in files.values():
    for r in recs:
        if r["id"] in ids and r["id"] not in plain:
            tokens = engine.generate_ids(r["prompt_ids"], "vanilla", GenerationConfig(max_new_tokens=budget)).tokens
            plain[r["id"]] = tokens[:-1] if tokens and tokens[-1] in eos else tokens
for name, recs in files.items():
    by_id = {r["id"]: r["answer_ids"] for r in recs}
    same = [by_id[i] == plain[i][: len(by_id[i])] and (len(by_id[i]) == budget or by_id[i] == plain[i]) for i in ids]
    first_off = [
        next((k for k, (a, b) in enumerate(zip(by_id[i], plain[i], strict=False)) if a != b), None)
        for i in ids
        if not same[ids.index(i)]
    ]
    where = f"; first different token at {sorted(k for k in first_off if k is not None)}" if first_off else ""
    print(f"{name}: {sum(same)} of {len(ids)} answers are vanilla's{where}")
