"""Run decoding methods side by side on a prompt set and write results.json, results.md, speed.png.

Fairness rules: every method gets the same prompts, budget and engine; methods are warmed up
untimed; and runs are interleaved prompt by prompt (not method by method) so that drifting CPU
load, clocks or caches hit all methods alike. Speedups are medians of per-prompt ratios against
the first method, which is less sensitive to one slow outlier than a ratio of totals.
"""

from __future__ import annotations

import importlib
import statistics
import sys
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from m2r2.bench.datasets import Dataset, Prompt, load_dataset
from m2r2.bench.intervals import median_interval
from m2r2.bench.report import write_report
from m2r2.bench.results import BenchSettings, check_out_dir, environment, save_results
from m2r2.cache import Conversation
from m2r2.decoding import check_options, method_names
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine
from m2r2.errors import SettingsError, UnknownNameError

#: The self-speculative comparison of the paper: ours, its ablations (without prompt lookup; drafting by
#: plain early exit), and every lossless peer, vanilla first (transformers' plain and lossy early-exit
#: `generate` run with --methods: they are not peers, and a 100-second `hf-early-exit` turn slowed
#: whatever ran next).
PAPER_METHODS = [
    "vanilla",
    "m2r2",
    "m2r2@nolookup",
    "eagle",
    "medusa",
    "two-model",
    "deed",
    "early-exit-spec",
    "lookahead",
    "hf-pld",
]
#: Suites with their own runner and report: name -> "module:function" (imported when run).
RUNNERS = {"dynamic": "m2r2.bench.dynamic_suite:run_dynamic", "moe": "m2r2.bench.moe_suite:run_moe"}
SPECIAL_SUITES = tuple(RUNNERS)
#: Named suites: each is a list of (dataset, methods) runs merged into one report.
SUITES: dict[str, list[tuple[str, list[str]]]] = {
    "paper": [(d, PAPER_METHODS) for d in ("mt_bench", "koala", "self_instruct", "wizardlm")],
}
#: Options of the ablation rows a run may name (``--option`` of the same entry overrides them).
VARIANT_OPTIONS: dict[str, dict[str, Any]] = {"m2r2@nolookup": {"lookup": 0}}
#: The dataset and methods of a plain run (no --suite, no --dataset / --methods).
DEFAULT_DATASET = "mt_bench"
DEFAULT_METHODS = ["vanilla", "hf", "hf-pld"]


def plan(settings: BenchSettings) -> list[tuple[str, list[str]]]:
    """The (dataset, methods) runs of ``settings``: one run, or the runs of a named suite (whose
    methods ``settings.methods`` replaces when given)."""
    if settings.suite is None:
        return [(settings.dataset or DEFAULT_DATASET, settings.methods or DEFAULT_METHODS)]
    if settings.suite not in SUITES:
        names = ", ".join([*SUITES, *SPECIAL_SUITES])
        raise UnknownNameError(f"unknown suite {settings.suite!r}; available: {names}")
    return [(dataset, settings.methods or methods) for dataset, methods in SUITES[settings.suite]]


def method_of(entry: str) -> str:
    """The method an entry of ``--methods`` runs: ``NAME@LABEL`` is method NAME under options of its
    own (``--option NAME@LABEL:KEY=VALUE``), so one run can hold an ablation row beside the default."""
    return entry.partition("@")[0]


def _check_methods(methods: list[str]) -> None:
    if not methods:
        raise SettingsError("no methods given")
    known = method_names()
    if bad := [m for m in methods if method_of(m) not in known]:
        raise UnknownNameError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(known)}")
    if len(set(methods)) != len(methods):
        raise SettingsError(f"a method is listed twice: {', '.join(methods)}")


def run_options(options: dict[str, dict[str, Any]], runs: list[tuple[str, list[str]]]) -> dict[str, dict[str, Any]]:
    """Per-method options of the runs (a named ablation row's own, :data:`VARIANT_OPTIONS`, under what
    ``--option`` gives it), typed and range-checked; options for a method no run has are a mistake."""
    used = {m for _, methods in runs for m in methods}
    if bad := sorted(set(options) - used):
        raise SettingsError(f"--option for method(s) not in this run: {', '.join(bad)}")
    merged = {m: {**VARIANT_OPTIONS.get(m, {}), **options.get(m, {})} for m in used}
    return {m: check_options(method_of(m), opts) for m, opts in merged.items() if opts}


def answer(
    engine: Engine,
    prompt: Prompt,
    method: str,
    gen: GenerationConfig,
    options: dict[str, Any] | None = None,
    fresh_turns: bool = False,
) -> dict[str, Any]:
    """All turns of ``prompt``; later turns see this method's own earlier answers, as in MT-Bench, and
    reuse the K/V cache of the earlier turns (one :class:`Conversation` per prompt and method) unless
    ``fresh_turns``."""
    session = None if fresh_turns else Conversation()
    messages: list[dict[str, str]] = []
    ids: list[list[int]] = []
    texts: list[str] = []
    stats: list[dict[str, Any]] = []
    seconds = 0.0
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        out = engine.chat(messages, method=method_of(method), gen=gen, session=session, **(options or {}))
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
    engine: Engine,
    data: Dataset,
    methods: list[str],
    gen: GenerationConfig,
    warmup: int,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    fresh_turns: bool = False,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Warm up, then interleave: for each prompt, each method, starting one method later each prompt
    (whatever runs after a slow method or first after a prompt switch is not always the same one;
    ``on_row`` sees each prompt's row as it is measured; ``options`` per method). Returns per-method
    summaries and rows (methods in the given order)."""
    options = options or {}
    for method in methods:
        name, opts = method_of(method), options.get(method, {})
        engine.strategy(name, **opts)  # load models (e.g. transformers) before any timing
        for p in data.prompts[:warmup]:
            engine.chat([{"role": "user", "content": p.turns[0]}], method=name, gen=gen, **opts)
    rows: list[dict[str, Any]] = []
    for i, p in enumerate(
        tqdm(data.prompts, desc=f"{data.name} ({', '.join(methods)})", unit="prompt", file=sys.stderr)
    ):
        order = methods[i % len(methods) :] + methods[: i % len(methods)]  # rotated: no method always runs first
        runs = {m: answer(engine, p, m, gen, options.get(m), fresh_turns) for m in order}
        runs = {m: runs[m] for m in methods}
        base = runs[methods[0]]
        for r in runs.values():
            r["identical"] = r["ids"] == base["ids"]
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] > 0 else None
        rows.append({"dataset": data.name, "id": p.id, "category": p.category, "turns": len(p.turns), "methods": runs})
        if on_row is not None:
            on_row(rows[-1])
    summary: dict[str, dict[str, Any]] = {}
    for m in methods:
        per = [row["methods"][m] for row in rows]
        speedups = [r["speedup"] for r in per if r["speedup"] is not None]
        summary[m] = {
            "dataset": data.name,
            "method": m,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in per),
            "speedup": statistics.median(speedups) if speedups else 0.0,
            "speedup_ci": median_interval(speedups),  # 95%, distribution-free (None under 6 prompts)
            "identical": sum(r["identical"] for r in per) / len(per),
            "mean_new_tokens": statistics.fmean(r["tokens"] for r in per),
            "total_seconds": sum(r["seconds"] for r in per),
            **_mean_stats([s for r in per for s in r["stats"]]),
        }
    return summary, rows


def run_bench(engine: Engine, settings: BenchSettings) -> dict[str, Any]:
    """Run every (dataset, methods) of the plan and write one merged report to ``settings.out_dir``.

    ``methods`` is keyed by method name for a single dataset, by ``dataset/method`` for several.
    Everything is checked (names, settings, files, the output folder) before the first token is
    generated, and results.json is saved after every prompt, so an interrupted run keeps what it
    measured. Suites in :data:`RUNNERS` (``dynamic``, ``moe``) have their own runner and report.
    """
    if settings.suite in RUNNERS:
        module, func = RUNNERS[settings.suite].split(":")
        return getattr(importlib.import_module(module), func)(engine, settings)
    gen = GenerationConfig(max_new_tokens=settings.max_new_tokens).validate()
    if settings.warmup < 0:
        raise SettingsError(f"warmup must be >= 0, got {settings.warmup}")
    runs = plan(settings)
    for _, methods in runs:
        _check_methods(methods)
    options = run_options(settings.options, runs)
    loaded = [(load_dataset(name, settings.limit), methods) for name, methods in runs]
    out = check_out_dir(settings)

    results: dict[str, Any] = {
        "dataset": ", ".join(dict.fromkeys(d.name for d, _ in loaded)),
        "suite": settings.suite,
        "n_prompts": 0,
        "max_new_tokens": settings.max_new_tokens,
        "warmup": settings.warmup,
        "fresh_turns": settings.fresh_turns,
        "options": options,
        **environment(engine, settings),
        "methods": {},
        "prompts": [],
    }

    def keep(row: dict[str, Any]) -> None:
        results["prompts"].append(row)
        results["n_prompts"] = len(results["prompts"])
        save_results(out, results, complete=False)

    several = len({d.name for d, _ in loaded}) > 1
    for data, methods in loaded:
        summary, _ = run_one(engine, data, methods, gen, settings.warmup, keep, options, settings.fresh_turns)
        results["methods"].update({(f"{data.name}/{m}" if several else m): s for m, s in summary.items()})
    save_results(out, results, complete=True)
    return {**results, "complete": True, "markdown": write_report(results, out)}
