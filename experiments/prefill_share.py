"""What a faster prefill could lift a bench run's per-prompt speedups by, replayed from its results.json (no clock):
each prompt's prefill is estimated at 0.41 ms per prompt token plus 2 ms a turn (a 71-token SmolLM2 prompt took 29.5 ms
on the int8 loops, 2 threads, `experiments/prefill_sizes.py`), taken out of both methods' seconds and put back at a
third of its size.

    python experiments/prefill_share.py RESULTS_JSON [METHOD]

Prints per dataset the median speedup now, with the prefill three times faster, and the prefill's median share of
the baseline's time. (Second turns prefill only their new message; their estimate counts the user's turns only.)
"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from m2r2.bench.datasets import load_dataset
from m2r2.engine import resolve_model
from m2r2.tokenizer import ChatTokenizer

run = json.loads(Path(sys.argv[1]).read_text())
method = sys.argv[2] if len(sys.argv) > 2 else "m2r2"
tokenizer = ChatTokenizer(resolve_model(None, quiet=True))
by_dataset = defaultdict(list)
for row in run["prompts"]:
    by_dataset[row["dataset"]].append(row)
for dataset, rows in by_dataset.items():
    texts = {p.id: p for p in load_dataset(dataset, 0).prompts}
    now, faster, share = [], [], []
    for row in rows:
        base, other = row["methods"]["vanilla"]["seconds"], row["methods"][method]["seconds"]
        turns = texts[row["id"]].turns
        prefill = 0.41e-3 * sum(len(tokenizer.encode_chat([{"role": "user", "content": t}])) for t in turns)
        prefill += 2e-3 * len(turns)
        now.append(base / other)
        faster.append((base - prefill * 2 / 3) / (other - prefill * 2 / 3))
        share.append(prefill / base)
    print(
        f"{dataset}: speedup {statistics.median(now):.3f}, with a prefill 3x faster {statistics.median(faster):.3f}; "
        f"the prefill's share of vanilla's time "
        f"{statistics.median(share):.3f}"
    )
