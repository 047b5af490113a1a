"""Turn a results dict into the markdown table and the PNG plot that the benchmark writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def header_line(results: dict[str, Any]) -> str:
    """Everything a reader needs to judge the numbers and rerun them: hardware, precision, threads,
    versions, the commit and the exact command."""
    r = results
    return (
        f"{r['model']} on {r['cpu']} ({r['device']}, {r['threads']} threads), dtype {r['dtype']}, "
        f"kernel {r['kernel']}; torch {r['torch_version']}, transformers {r['transformers_version']}; "
        f"{r['n_prompts']} prompts of {r['dataset']}, up to {r['max_new_tokens']} new tokens per turn; {r['date']}; "
        f"commit {r.get('commit', 'unknown')}; command `{r.get('command', '?')}`"
    )


def markdown_table(results: dict[str, Any]) -> str:
    """One row per (dataset, method); speedup and identical are against each run's first method. The
    noise-free counts of drafting methods sit beside the timings: tokens per verify pass (mean
    accepted), drafts accepted / drafted, tokens per generated token taken from prompt-lookup copies, the share of
    verify passes whose round drafted (token trees draft only where it pays, ``draft=pays``), and one draft level's
    cost in one-token steps as the method measured it."""
    rows = [
        "| dataset | method | tokens/s | speedup | identical | new tokens | mean accepted | acceptance "
        "| copied/token | drafted | draft cost | seconds |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]

    def cell(m: dict[str, Any], key: str) -> str:
        return "-" if m.get(key) is None else f"{m[key]:.2f}"

    for m in results["methods"].values():
        rows.append(
            f"| {m['dataset']} | {m['method']} | {m['tokens_per_s']:.1f} | {m['speedup']:.2f}x | "
            f"{m['identical']:.0%} | {m['mean_new_tokens']:.1f} | {cell(m, 'mean_accepted')} | "
            f"{cell(m, 'acceptance_rate')} | {cell(m, 'copied_accepted_per_token')} | {cell(m, 'drafting_share')} | "
            f"{cell(m, 'draft_cost')} | "
            f"{m['total_seconds']:.1f} |"
        )
    return "\n".join(rows)


def plot(results: dict[str, Any], path: Path, dataset: str | None = None) -> None:
    """Bar plots of median tokens/s and median speedup per method (Agg: no display needed); with
    ``dataset``, only that dataset's methods (a suite gets one plot per dataset)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    picked = [(k, m) for k, m in results["methods"].items() if dataset is None or m["dataset"] == dataset]
    labels = [m["method"] if dataset is not None else k for k, m in picked]
    stats = [m for _, m in picked]
    colors = [f"C{i % 10}" for i in range(len(labels))]
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(labels) + 4), 4.2))
    for ax, key, title, fmt in (
        (axes[0], "tokens_per_s", "median tokens/s", "{:.1f}"),
        (axes[1], "speedup", f"median speedup vs {stats[0]['method']}", "{:.2f}x"),
    ):
        values = [s[key] for s in stats]
        bars = ax.bar(labels, values, color=colors)
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], padding=2, fontsize=8)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax.set_ylim(0, max([*values, 1e-9]) * 1.18)
    axes[1].axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    fig.suptitle(
        f"{results['model']} · {dataset or results['dataset']} · {results['dtype']} · {results['threads']} threads "
        f"· {results['device']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: dict[str, Any], out_dir: Path) -> str:
    """Write results.md and speed.png (and speed_DATASET.png per dataset of a suite) to ``out_dir``; return
    the markdown (header + table)."""
    text = f"{header_line(results)}\n\n{markdown_table(results)}\n"
    (out_dir / "results.md").write_text(text, encoding="utf-8")
    plot(results, out_dir / "speed.png")
    datasets = dict.fromkeys(m["dataset"] for m in results["methods"].values())
    if len(datasets) > 1:  # a suite: one readable plot per dataset besides the overview
        for name in datasets:
            plot(results, out_dir / f"speed_{name}.png", name)
    return text
