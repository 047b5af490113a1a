"""Turn a results dict into what the benchmark writes: the markdown table, the head-to-head table of the method under
test against its peers, and the PNG plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from m2r2.bench.intervals import median_interval


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


def _span(ci: Any, digits: int) -> str:
    """An interval's cell: ``lo-hi``, or "-" where there is none."""
    return "-" if not ci else f"{ci[0]:.{digits}f}-{ci[1]:.{digits}f}"


def markdown_table(results: dict[str, Any]) -> str:
    """One row per (dataset, method); speedup and identical are against each run's first method, the speedup with
    its 95% interval (:func:`~m2r2.bench.intervals.median_interval`; "-" under 6 prompts). The
    noise-free counts of drafting methods sit beside the timings: tokens per verify pass (mean
    accepted), drafts accepted / drafted, tokens per generated token taken from prompt-lookup copies, the share of
    verify passes whose round drafted (token trees draft only where it pays, ``draft=pays``), and one draft level's
    cost in one-token steps as the method measured it."""
    rows = [
        "| dataset | method | tokens/s | speedup | 95% CI | identical | new tokens | mean accepted | acceptance "
        "| copied/token | drafted | draft cost | seconds |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]

    def cell(m: dict[str, Any], key: str) -> str:
        return "-" if m.get(key) is None else f"{m[key]:.2f}"

    for m in results["methods"].values():
        rows.append(
            f"| {m['dataset']} | {m['method']} | {m['tokens_per_s']:.1f} | {m['speedup']:.2f}x | "
            f"{_span(m.get('speedup_ci'), 2)} | "
            f"{m['identical']:.0%} | {m['mean_new_tokens']:.1f} | {cell(m, 'mean_accepted')} | "
            f"{cell(m, 'acceptance_rate')} | {cell(m, 'copied_accepted_per_token')} | {cell(m, 'drafting_share')} | "
            f"{cell(m, 'draft_cost')} | "
            f"{m['total_seconds']:.1f} |"
        )
    return "\n".join(rows)


def head_to_head(results: dict[str, Any]) -> str:
    """Where a run has two or more methods besides its baseline: the first of them (the method under test) against
    each later one (peers, ablations), prompt by prompt on each dataset: the median ratio of their tokens/s with its
    95% interval, and on how many prompts the first was faster. Why: two medians against the baseline, each with
    its own spread, cannot say which of two methods is ahead; their ratio on the same prompt, timed side by side, can.
    Empty where there is nothing to compare."""
    by_dataset: dict[str, list[dict[str, Any]]] = {}
    for row in results.get("prompts") or []:
        by_dataset.setdefault(row["dataset"], []).append(row)
    lines = []
    for dataset, rows in by_dataset.items():
        names = list(rows[0]["methods"])
        for other in names[2:]:
            pairs = [(r["methods"][names[1]]["tokens_per_s"], r["methods"][other]["tokens_per_s"]) for r in rows]
            ratios = [a / b for a, b in pairs if b > 0]
            if not ratios:
                continue
            lines.append(
                f"| {dataset} | {names[1]} | {other} | {statistics.median(ratios):.3f} | "
                f"{_span(median_interval(ratios), 3)} | {sum(r > 1 for r in ratios)} of {len(ratios)} |"
            )
    if not lines:
        return ""
    head = (
        "| dataset | method | against | median ratio of tokens/s | 95% CI | prompts where it was faster |\n"
        "|---|---|---|--:|--:|--:|"
    )
    return head + "\n" + "\n".join(lines)


def plot(results: dict[str, Any], path: Path, dataset: str | None = None) -> None:
    """Bar plots of median tokens/s and median speedup per method, the speedup with its 95% interval as an error bar
    (Agg: no display needed); with
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
        spans = [s.get(f"{key}_ci") or (v, v) for s, v in zip(stats, values, strict=True)]
        errors = [
            [v - lo for v, (lo, _) in zip(values, spans, strict=True)],
            [hi - v for v, (_, hi) in zip(values, spans, strict=True)],
        ]
        shown = errors if any(s.get(f"{key}_ci") for s in stats) else None
        bars = ax.bar(labels, values, color=colors, yerr=shown, capsize=3, error_kw={"linewidth": 0.8})
        # inside the bars where error bars stand on their tops
        where = {"label_type": "center", "color": "white"} if shown else {"padding": 2}
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=8, **where)
        ax.set_title(title + (", 95% interval" if shown else ""))
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax.set_ylim(0, max([*values, *(hi for _, hi in spans), 1e-9]) * 1.18)
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
    versus = head_to_head(results)
    text = f"{header_line(results)}\n\n{markdown_table(results)}\n"
    if versus:
        text += f"\nHead to head (prompt by prompt, timed side by side):\n\n{versus}\n"
    (out_dir / "results.md").write_text(text, encoding="utf-8")
    plot(results, out_dir / "speed.png")
    datasets = dict.fromkeys(m["dataset"] for m in results["methods"].values())
    if len(datasets) > 1:  # a suite: one readable plot per dataset besides the overview
        for name in datasets:
            plot(results, out_dir / f"speed_{name}.png", name)
    return text
