"""Ablation of the seeded fast stream at inference: chain vs token-tree shapes, side by side.

Every variant decodes the same prompts (interleaved prompt by prompt after a warm-up, as the bench
harness does) and is compared with `vanilla` on the same engine: median of per-prompt speedups,
share of identical outputs, mean tokens per verify pass, verify rows per pass. Writes a JSON and
a Markdown table.

    python experiments/tree_ablation.py --adapters src/m2r2/adapters/smollm2-135m-seeded.safetensors \
        --dataset mt_bench --limit 5 --max-new-tokens 128 --out benchmarks/tree-ablation
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

import torch

from m2r2.bench.datasets import load_dataset
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine
from m2r2.machine import cpu_name

#: (label, options of the m2r2 method): a chain (one branch), trees of growing size
#: "-all" variants verify every drafted node (no cost model): what the drafts could give per pass
VARIANTS = [
    ("chain-4", {"max_nodes": 4, "width": 1, "branch": 1, "max_depth": 4}),
    ("tree-8", {"max_nodes": 8, "width": 2, "branch": 2, "max_depth": 5}),
    ("chain-4-all", {"max_nodes": 4, "width": 1, "branch": 1, "max_depth": 4, "adaptive": False}),
    ("tree-8-all", {"max_nodes": 8, "width": 2, "branch": 2, "max_depth": 5, "adaptive": False}),
    ("tree-16-all", {"max_nodes": 16, "width": 3, "branch": 3, "max_depth": 6, "adaptive": False}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", required=True)
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench-out/tree-ablation")
    args = ap.parse_args()
    engine = Engine(threads=args.threads, quiet=True)
    prompts = load_dataset(args.dataset, args.limit).prompts
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    runs = [("vanilla", "vanilla", {})] + [(label, "m2r2", {"adapters": args.adapters, **o}) for label, o in VARIANTS]
    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}]) for p in prompts]
    for _, method, opts in runs:  # warm-up (and build each strategy once, measuring its costs)
        engine.generate_ids(ids[0][:16], method, GenerationConfig(max_new_tokens=8), **opts)
    res: dict[str, list[dict]] = {label: [] for label, _, _ in runs}
    for p in ids:
        for label, method, opts in runs:
            r = engine.generate_ids(p, method, gen, **opts)
            res[label].append({"tokens": r.tokens, "seconds": r.seconds, "stats": r.stats})
    base = res["vanilla"]
    rows = []
    for label, _, _ in runs:
        rs = res[label]
        rows.append(
            {
                "variant": label,
                "speedup": statistics.median(b["seconds"] / r["seconds"] for b, r in zip(base, rs, strict=True)),
                "identical": sum(r["tokens"] == b["tokens"] for b, r in zip(base, rs, strict=True)) / len(rs),
                "tokens_per_s": sum(len(r["tokens"]) for r in rs) / sum(r["seconds"] for r in rs),
                "mean_accepted": statistics.mean(r["stats"].get("mean_accepted", 1.0) for r in rs),
                "rows_per_pass": statistics.mean(r["stats"].get("verify_rows_per_pass", 1.0) for r in rs),
                "draft_cost": rs[0]["stats"].get("draft_cost"),
                "verify_cost": rs[0]["stats"].get("verify_cost"),
            }
        )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "commit": commit,
        "command": "python experiments/tree_ablation.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "kernel": engine.kernel,
        "dataset": args.dataset,
        "prompts": len(ids),
        "max_new_tokens": args.max_new_tokens,
    }
    (out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = [
        f"Commit {commit}; `{meta['command']}`; {meta['cpu']}, {meta['threads']} threads, kernel {engine.kernel}.",
        "",
        "| variant | speedup (median) | identical | tok/s | tokens per pass | verify rows per pass |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['speedup']:.2f}x | {r['identical']:.0%} | {r['tokens_per_s']:.1f} | "
            f"{r['mean_accepted']:.2f} | {r['rows_per_pass']:.2f} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
