"""Run decoding methods side by side on a prompt set and write results.json, results.md, speed.png.

Fairness rules: every method gets the same prompts, budget and engine; methods are warmed up
untimed; and runs are interleaved prompt by prompt (not method by method) so that drifting CPU
load, clocks or caches hit all methods alike. Speedups are medians of per-prompt ratios against
the first method, which is less sensitive to one slow outlier than a ratio of totals.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from m2r2.bench.datasets import Dataset, Prompt, load_dataset
from m2r2.bench.report import write_report
from m2r2.decoding import method_names
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine, cpu_name
from m2r2.errors import SettingsError, UnknownNameError

#: The self-speculative comparison of the paper: ours, its ablation, and every peer, vanilla first.
PAPER_METHODS = ["vanilla", "m2r2", "early-exit-spec", "lookahead", "hf", "hf-pld", "hf-early-exit"]
#: Suites with their own runner and report (see :func:`run_bench`).
SPECIAL_SUITES = ("dynamic", "moe")
#: Named suites: each is a list of (dataset, methods) runs merged into one report.
SUITES: dict[str, list[tuple[str, list[str]]]] = {
    "paper": [(d, PAPER_METHODS) for d in ("mt_bench", "koala", "self_instruct", "wizardlm")],
}


@dataclass
class BenchSettings:
    dataset: str
    methods: list[str]
    limit: int | None
    max_new_tokens: int
    out_dir: Path
    warmup: int = 1
    suite: str | None = None
    # --suite moe only (None = the suite's defaults): bandwidth labels, cache fractions, policies, adapters
    bandwidths: list[str] | None = None
    cache_fractions: list[float] | None = None
    policies: list[str] | None = None
    adapters: Path | None = None


def plan(settings: BenchSettings) -> list[tuple[str, list[str]]]:
    """The (dataset, methods) runs of ``settings``: one run, or the runs of a named suite."""
    if settings.suite is None:
        return [(settings.dataset, settings.methods)]
    if settings.suite not in SUITES:
        names = ", ".join([*SUITES, *SPECIAL_SUITES])
        raise UnknownNameError(f"unknown suite {settings.suite!r}; available: {names}")
    return SUITES[settings.suite]


def _check_methods(methods: list[str]) -> None:
    if not methods:
        raise SettingsError("no methods given")
    known = method_names()
    if bad := [m for m in methods if m not in known]:
        raise UnknownNameError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(known)}")
    if len(set(methods)) != len(methods):
        raise SettingsError(f"a method is listed twice: {', '.join(methods)}")


def answer(engine: Engine, prompt: Prompt, method: str, gen: GenerationConfig) -> dict[str, Any]:
    """All turns of ``prompt``; later turns see this method's own earlier answers, as in MT-Bench."""
    messages: list[dict[str, str]] = []
    ids: list[list[int]] = []
    texts: list[str] = []
    stats: list[dict[str, Any]] = []
    seconds = 0.0
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        out = engine.chat(messages, method=method, gen=gen)
        messages.append({"role": "assistant", "content": out.text})
        ids.append(out.result.tokens)
        texts.append(out.text)
        stats.append(out.result.stats)
        seconds += out.result.seconds
    tokens = sum(len(t) for t in ids)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "ids": ids,
        "text": texts,
        "stats": stats,
    }


def _mean_stats(stats: list[dict[str, Any]]) -> dict[str, float]:
    """Average every numeric stat over the turns that report it (strategies differ in what they report)."""
    keys = {k for s in stats for k, v in s.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    return {
        k: statistics.fmean(v for s in stats if isinstance(v := s.get(k), int | float) and not isinstance(v, bool))
        for k in sorted(keys)
    }


def run_one(
    engine: Engine, data: Dataset, methods: list[str], gen: GenerationConfig, warmup: int
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Warm up, then interleave: for each prompt, each method. Returns per-method summaries and rows."""
    for method in methods:
        engine.strategy(method)  # load models (e.g. transformers) before any timing
        for p in data.prompts[:warmup]:
            engine.chat([{"role": "user", "content": p.turns[0]}], method=method, gen=gen)
    rows: list[dict[str, Any]] = []
    for p in tqdm(data.prompts, desc=f"{data.name} ({', '.join(methods)})", unit="prompt", file=sys.stderr):
        runs = {m: answer(engine, p, m, gen) for m in methods}
        base = runs[methods[0]]
        for r in runs.values():
            r["identical"] = r["ids"] == base["ids"]
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] > 0 else None
        rows.append({"dataset": data.name, "id": p.id, "category": p.category, "turns": len(p.turns), "methods": runs})
    summary: dict[str, dict[str, Any]] = {}
    for m in methods:
        per = [row["methods"][m] for row in rows]
        speedups = [r["speedup"] for r in per if r["speedup"] is not None]
        summary[m] = {
            "dataset": data.name,
            "method": m,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in per),
            "speedup": statistics.median(speedups) if speedups else 0.0,
            "identical": sum(r["identical"] for r in per) / len(per),
            "mean_new_tokens": statistics.fmean(r["tokens"] for r in per),
            "total_seconds": sum(r["seconds"] for r in per),
            **_mean_stats([s for r in per for s in r["stats"]]),
        }
    return summary, rows


def environment(engine: Engine) -> dict[str, Any]:
    """What a reader needs to judge timings (hardware, precision, threads, versions); in every results.json."""
    import transformers

    return {
        "dtype": engine.dtype_name,
        "kernel": engine.kernel,
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "cpu": cpu_name(),
        "device": str(engine.device),
        "model": engine.model_dir.name,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }


def run_bench(engine: Engine, settings: BenchSettings) -> dict[str, Any]:
    """Run every (dataset, methods) of the plan and write one merged report to ``settings.out_dir``.

    ``methods`` is keyed by method name for a single dataset, by ``dataset/method`` for several.
    Everything is checked (names, settings, files) before the first token is generated.
    ``--suite dynamic`` (quality-vs-speedup sweeps of the lossy methods) and ``--suite moe`` (expert
    offloading policies) have their own runners.
    """
    if settings.suite == "dynamic":
        from m2r2.bench.dynamic_suite import run_dynamic

        return run_dynamic(engine, settings)
    if settings.suite == "moe":  # expert offloading policies on an MoE model: its own grid and report
        from m2r2.bench.moe_suite import run_moe

        return run_moe(engine, settings)
    gen = GenerationConfig(max_new_tokens=settings.max_new_tokens).validate()
    if settings.warmup < 0:
        raise SettingsError(f"warmup must be >= 0, got {settings.warmup}")
    runs = plan(settings)
    for _, methods in runs:
        _check_methods(methods)
    loaded = [(load_dataset(name, settings.limit), methods) for name, methods in runs]

    summaries: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    several = len({d.name for d, _ in loaded}) > 1
    for data, methods in loaded:
        summary, run_rows = run_one(engine, data, methods, gen, settings.warmup)
        summaries.update({(f"{data.name}/{m}" if several else m): s for m, s in summary.items()})
        rows += run_rows

    results: dict[str, Any] = {
        "dataset": ", ".join(dict.fromkeys(d.name for d, _ in loaded)),
        "suite": settings.suite,
        "n_prompts": len(rows),
        "max_new_tokens": settings.max_new_tokens,
        "warmup": settings.warmup,
        **environment(engine),
        "methods": summaries,
        "prompts": rows,
    }
    out = Path(settings.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False), encoding="utf-8")
    return {**results, "markdown": write_report(results, out)}
