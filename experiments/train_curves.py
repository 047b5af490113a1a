"""Training agreement of arms run side by side, in windows of steps, from their `train-seeded` progress logs.

    python experiments/train_curves.py LOG [LOG ...] [--window 50]

Arms with the same seed, store and batch size see identical batches step by step, so their per-step figures compare
directly (the logs are the runs' stderr: tqdm lines with ``ce=`` and ``agree=@1/@2/@3``).
"""

import argparse
import re
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("logs", nargs="+", type=Path)
parser.add_argument("--window", type=int, default=50)
args = parser.parse_args()

STEP = re.compile(r"(\d+)step \[[^\]]*ce=([\d.]+), agree=([\d.]+)/([\d.]+)/([\d.]+)")
arms = {}
for log in args.logs:
    arms[log.stem] = {int(m[1]): tuple(map(float, m.groups()[1:])) for m in STEP.finditer(log.read_text())}
common = sorted(set.intersection(*(set(d) for d in arms.values())))
for lo in range(0, common[-1] + 1 if common else 0, args.window):
    steps = [s for s in common if lo <= s < lo + args.window]
    if steps:
        cells = [f"steps {lo}-{lo + args.window - 1} ({len(steps)})"]
        for name, d in arms.items():
            mean = [sum(d[s][i] for s in steps) / len(steps) for i in range(4)]
            cells.append(f"{name}: ce {mean[0]:.3f} agree {mean[1]:.3f}/{mean[2]:.3f}/{mean[3]:.3f}")
        print(" | ".join(cells))
