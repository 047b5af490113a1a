"""``m2r2 bench --suite dynamic``: quality-vs-speedup curves of the lossy dynamic-compute methods.

Each method sweeps one knob (:data:`SWEEPS`: one entry per method, so adding a method is adding a
line; methods that are not registered are skipped with a warning). On each of the paper's four
datasets, every prompt's first turn is answered by ``vanilla`` (the reference: the full model's own
greedy output) and by every (method, knob value), interleaved prompt by prompt after an untimed
warm-up (once, on the first dataset), as the main harness does. Only first turns are used so that
every method answers exactly the input the reference answered (a second turn would carry each
method's own first answer).

Per point: ROUGE-L / exact match / the full model's NLL of the output (:mod:`m2r2.bench.quality`),
paired speedup against vanilla (median of per-prompt tokens/s ratios), median tokens/s, mean layers
per token and exit rate. ``at_quality`` is the best speedup each curve reaches at ROUGE-L 0.95, 0.9
and 0.8 (linear interpolation between measured points; null where never reached).
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from m2r2.bench.datasets import load_dataset
from m2r2.bench.quality import mean_nll, paired_speedup, rouge_l, speedup_at
from m2r2.bench.report import header_line
from m2r2.bench.results import BenchSettings, check_out_dir, environment, save_results
from m2r2.decoding import method_names
from m2r2.decoding.base import GenerationConfig
from m2r2.errors import SettingsError

if TYPE_CHECKING:
    from m2r2.engine import Engine

#: method -> (knob, values swept, from conservative to aggressive: the order the curve is drawn in).
#: Settings that can never exit (threshold >= 1, min_layer = N) are left out: they are ``vanilla``
#: bit for bit (tested), so their timing would only measure noise. Values chosen from a wider
#: pilot sweep on MT-Bench (benchmarks/dynamic/NOTES.md) to cover each method's quality range.
FULL_SWEEPS: dict[str, tuple[str, list[Any]]] = {
    "m2r2-dynamic": ("threshold", [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]),
    "static-exit": ("layer", [29, 24]),
    "calm": ("threshold", [0.99, 0.9, 0.5]),
    "skip-decoding": ("min_layer", [29, 26]),
    "mod": ("threshold", [0.5, 0.8, 0.95]),  # shipped routers, 5 MT-Bench prompts: 29.3 / 24.0 / 15.2 layers
}
#: The default sweep (``--full`` runs :data:`FULL_SWEEPS`): the points of each curve that the full
#: sweep showed to span its quality range, so the suite runs in minutes at ``--limit 3 --max-new-tokens
#: 64`` on one dataset.
SWEEPS: dict[str, tuple[str, list[Any]]] = {
    # seeded stream (draft probability): 6 prompts x 64 tokens, ROUGE-L 1.0 at 0.8 and above, 0.7-1.0 at
    # 0.5-0.7, 0.1-0.9 at 0.3 (the prefix stream's ARLA sweep was 0.8 .. 0.2)
    "m2r2-dynamic": ("threshold", [0.9, 0.7, 0.5, 0.3]),
    "static-exit": ("layer", [29]),
    "calm": ("threshold", [0.99, 0.9]),
    "skip-decoding": ("min_layer", [29]),
    "mod": ("threshold", [0.5, 0.95]),
}
DATASETS = ("mt_bench", "koala", "self_instruct", "wizardlm")
LEVELS = (0.95, 0.9, 0.8)
#: Token budget of the untimed warm-up runs.
WARMUP_TOKENS = 8
REFERENCE = "vanilla"
#: The method whose curve the issue asks to lie above every baseline's (``margins``).
OURS = "m2r2-dynamic"

__all__ = ["DATASETS", "FULL_SWEEPS", "LEVELS", "SWEEPS", "margins", "run_dynamic", "speedup_at"]

Config = tuple[str, str | None, Any]  # (method, knob, value)


def default_sweeps(full: bool) -> dict[str, tuple[str, list[Any]]]:
    return FULL_SWEEPS if full else SWEEPS


def suite_datasets(settings: BenchSettings) -> list[str]:
    """``--dataset`` when given, else the paper's four."""
    return [settings.dataset] if settings.dataset else list(DATASETS)


def _key(cfg: Config) -> str:
    method, knob, value = cfg
    return method if knob is None else f"{method}@{knob}={value}"


def _options(cfg: Config) -> dict[str, Any]:
    return {} if cfg[1] is None else {cfg[1]: cfg[2]}


def configs(sweeps: dict[str, tuple[str, list[Any]]]) -> list[Config]:
    """The reference, then every registered (method, knob, value); unregistered methods are skipped."""
    known = method_names()
    out: list[Config] = [(REFERENCE, None, None)]
    for method, (knob, values) in sweeps.items():
        if method not in known:
            print(f"m2r2: warning: dynamic suite skips {method!r} (not a registered method)", file=sys.stderr)
            continue
        if not values:
            raise SettingsError(f"the dynamic sweep of {method!r} lists no {knob} values")
        out += [(method, knob, v) for v in values]
    return out


def _numeric(stats: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in stats.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _mean(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(vals) if vals else None


def run_dataset(
    engine: Engine,
    name: str,
    cfgs: list[Config],
    gen: GenerationConfig,
    limit: int | None,
    warmup: int,
    on_row: Callable[[dict[str, Any]], None] | None = None,
):
    """Interleaved runs of every config on one dataset; returns (dataset name, summary, rows)."""
    data = load_dataset(name, limit)
    tok = engine.tokenizer
    prompts = [(p.id, tok.encode_chat([{"role": "user", "content": p.turns[0]}])) for p in data.prompts]
    short = GenerationConfig(max_new_tokens=min(WARMUP_TOKENS, gen.max_new_tokens))
    for cfg in cfgs:  # untimed warm-up: code paths and allocator, so a few tokens do
        for _, ids in prompts[:warmup]:
            engine.generate_ids(ids, cfg[0], short, **_options(cfg))
    rows: list[dict[str, Any]] = []
    for pid, ids in tqdm(prompts, desc=f"dynamic {data.name} ({len(cfgs)} configs)", unit="prompt", file=sys.stderr):
        runs: dict[str, dict[str, Any]] = {}
        for cfg in cfgs:
            res = engine.generate_ids(ids, cfg[0], gen, **_options(cfg))
            runs[_key(cfg)] = {"ids": res.tokens, "seconds": res.seconds, "tokens_per_s": res.tokens_per_s,
                               "stats": _numeric(res.stats)}  # fmt: skip
        ref = runs[_key(cfgs[0])]
        ref_text = tok.decode(ref["ids"])
        scored: dict[tuple[int, ...], tuple[str, float, float]] = {}  # one scoring per distinct output
        for r in runs.values():  # quality after all timed runs of this prompt
            key = tuple(r["ids"])
            if key not in scored:
                text = tok.decode(r["ids"])
                scored[key] = (text, rouge_l(ref_text, text), mean_nll(engine.model, ids, r["ids"]))
            r["text"], r["rouge_l"], r["nll"] = scored[key]
            r["exact"] = r["ids"] == ref["ids"]
        rows.append({"dataset": data.name, "id": pid, "prompt_tokens": len(ids), "runs": runs})
        if on_row is not None:
            on_row(rows[-1])
    return data.name, summarize(cfgs, rows), rows


def _point(cfg: Config, rows: list[dict[str, Any]]) -> dict[str, Any]:
    key, ref = _key(cfg), _key((REFERENCE, None, None))
    runs = [row["runs"][key] for row in rows]
    stat = lambda k: _mean([r["stats"].get(k) for r in runs])  # noqa: E731
    return {
        "knob": cfg[2],
        "rouge_l": _mean([r["rouge_l"] for r in runs]),
        "exact": _mean([float(r["exact"]) for r in runs]),
        "nll": _mean([r["nll"] for r in runs]),
        "speedup": paired_speedup(
            [r["tokens_per_s"] for r in runs], [row["runs"][ref]["tokens_per_s"] for row in rows]
        ),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs) if runs else None,
        "layers_per_token": stat("layers_per_token"),
        "exit_rate": stat("exit_rate") or 0.0,
        "exit_precision": stat("exit_precision"),
        "head_calls_per_token": stat("head_calls_per_token"),
        "new_tokens": _mean([float(len(r["ids"])) for r in runs]),
    }


def summarize(cfgs: list[Config], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Reference numbers, per-method curves (in sweep order) and the speedups at fixed ROUGE-L."""
    curves: dict[str, list[dict[str, Any]]] = {}
    for cfg in cfgs[1:]:
        curves.setdefault(cfg[0], []).append(_point(cfg, rows))
    ref = _point(cfgs[0], rows)
    ref["layers_per_token"] = ref["layers_per_token"] or None
    at_quality = {m: {str(q): speedup_at(c, q) for q in LEVELS} for m, c in curves.items()}
    return {"reference": ref, "curves": curves, "at_quality": at_quality, "margins": margins(curves)}


def margins(curves: dict[str, list[dict[str, Any]]], ours: str = OURS) -> list[dict[str, Any]]:
    """Every baseline point against ``ours`` at the same quality: the issue's "curve above" test.

    ``ours`` is the speedup our curve reaches at ROUGE-L >= the baseline point's (interpolated, as
    in ``at_quality``; None where our curve never reaches that quality), ``margin`` ours minus the
    baseline's speedup: positive where our curve lies above that point.
    """
    if ours not in curves:
        return []
    out = []
    for method, points in curves.items():
        if method == ours:
            continue
        for p in points:
            if p["rouge_l"] is None or p["speedup"] is None:
                continue
            s = speedup_at(curves[ours], p["rouge_l"])
            margin = None if s is None else s - p["speedup"]
            out.append(
                {"method": method, "knob": p["knob"], "rouge_l": p["rouge_l"], "speedup": p["speedup"]}
                | {"ours": s, "margin": margin}
            )
    return out


def run_dynamic(
    engine: Engine,
    settings: BenchSettings,
    sweeps: dict[str, tuple[str, list[Any]]] | None = None,
    datasets: list[str] | None = None,
) -> dict[str, Any]:
    """Sweep every method's knob on each dataset; write results.json, results.md and one PNG per dataset."""
    gen = GenerationConfig(max_new_tokens=settings.max_new_tokens).validate()
    if settings.warmup < 0:
        raise SettingsError(f"warmup must be >= 0, got {settings.warmup}")
    sweep = default_sweeps(settings.full) if sweeps is None else sweeps
    cfgs = configs(sweep)
    names = list(datasets or suite_datasets(settings))
    for name in names:  # unknown names fail before any work
        load_dataset(name, settings.limit)
    for cfg in cfgs:  # so do bad knob values and missing adapters
        engine.strategy(cfg[0], **_options(cfg))
    out = check_out_dir(settings)
    results: dict[str, Any] = {
        "suite": "dynamic",
        "dataset": "",
        "n_prompts": 0,
        "max_new_tokens": settings.max_new_tokens,
        "warmup": settings.warmup,
        **environment(engine, settings),
        "reference": REFERENCE,
        "levels": [str(q) for q in LEVELS],
        "sweeps": {m: {"knob": k, "values": v} for m, (k, v) in sweep.items()},
        "datasets": {},
        "prompts": [],
    }

    def keep(row: dict[str, Any]) -> None:
        results["prompts"].append(row)
        results["n_prompts"] = len(results["prompts"])
        save_results(out, results, complete=False)

    for i, name in enumerate(names):  # warm-up once: the strategies persist across datasets
        label, summary, _ = run_dataset(engine, name, cfgs, gen, settings.limit, settings.warmup if i == 0 else 0, keep)
        results["datasets"][label] = summary
        results["dataset"] = ", ".join(results["datasets"])
    save_results(out, results, complete=True)
    text = f"{header_line(results)}\n\n{markdown(results)}\n"
    (out / "results.md").write_text(text, encoding="utf-8")
    for name, summary in results["datasets"].items():
        plot(name, summary, results, out / f"quality_{_slug(name)}.png")
    return {**results, "complete": True, "markdown": text}


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name).strip("_")


def _fmt(v: Any, spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def markdown(results: dict[str, Any]) -> str:
    """The speedup at each quality level, then every measured point."""
    levels = results["levels"]
    lines = [
        f"Speedup over `{results['reference']}` reached at ROUGE-L >= level (interpolated; - = never reached; "
        f"`{results['reference']}` itself is 1.00x at every level):",
        "",
        "| dataset | method | " + " | ".join(f"@{q}" for q in levels) + " |",
        "|---|---|" + "--:|" * len(levels),
    ]
    for name, d in results["datasets"].items():
        for method, at in d["at_quality"].items():
            lines.append(f"| {name} | {method} | " + " | ".join(_fmt(at[q], ".2f", "x") for q in levels) + " |")
    rows = [(name, m) for name, d in results["datasets"].items() for m in d.get("margins", [])]
    if rows:
        above = sum(m["margin"] is not None and m["margin"] > 0 for _, m in rows)
        lines += [
            "",
            f"`{OURS}` against every baseline point at the same ROUGE-L (its speedup interpolated on its curve; "
            f"margin > 0 = above): above at {above} of {len(rows)} points.",
            "",
            f"| dataset | baseline | knob | ROUGE-L | baseline speedup | {OURS} | margin |",
            "|---|---|---|--:|--:|--:|--:|",
        ]
        for name, m in rows:
            knob = results["sweeps"][m["method"]]["knob"]
            lines.append(
                f"| {name} | {m['method']} | {knob}={m['knob']} | {m['rouge_l']:.3f} | {m['speedup']:.2f}x | "
                f"{_fmt(m['ours'], '.2f', 'x')} | {_fmt(m['margin'], '+.2f')} |"
            )
    lines += [
        "",
        "| dataset | method | knob | ROUGE-L | exact | NLL | speedup | tokens/s | layers/token | exit rate "
        "| exit prec. |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name, d in results["datasets"].items():
        ref = d["reference"]
        lines.append(
            f"| {name} | {results['reference']} | - | 1.000 | 1.00 | {_fmt(ref['nll'], '.3f')} | 1.00x | "
            f"{_fmt(ref['tokens_per_s'], '.1f')} | {_fmt(ref['layers_per_token'], '.1f')} | 0.00 | - |"
        )
        for method, points in d["curves"].items():
            knob = results["sweeps"][method]["knob"]
            for p in points:
                lines.append(
                    f"| {name} | {method} | {knob}={p['knob']} | {_fmt(p['rouge_l'], '.3f')} | "
                    f"{_fmt(p['exact'], '.2f')} | {_fmt(p['nll'], '.3f')} | {_fmt(p['speedup'], '.2f', 'x')} | "
                    f"{_fmt(p['tokens_per_s'], '.1f')} | {_fmt(p['layers_per_token'], '.1f')} | "
                    f"{_fmt(p['exit_rate'], '.2f')} | {_fmt(p['exit_precision'], '.2f')} |"
                )
    return "\n".join(lines)


def plot(name: str, summary: dict[str, Any], results: dict[str, Any], path: Path) -> None:
    """ROUGE-L against speedup, one line per method (points in sweep order), quality levels dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (method, points) in enumerate(summary["curves"].items()):
        pts = [p for p in points if p["speedup"] is not None and p["rouge_l"] is not None]
        ax.plot([p["speedup"] for p in pts], [p["rouge_l"] for p in pts], "o-", color=f"C{i % 10}", label=method)
        for p in pts:
            ax.annotate(f"{p['knob']}", (p["speedup"], p["rouge_l"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")  # fmt: skip
    ax.plot([1.0], [1.0], "k*", markersize=10, label=results["reference"])
    for q in LEVELS:
        ax.axhline(q, color="gray", linewidth=0.7, linestyle="--")
    ax.axvline(1.0, color="gray", linewidth=0.7, linestyle=":")
    ax.set_xlabel(f"paired speedup vs {results['reference']} (median of per-prompt ratios)")
    ax.set_ylabel(f"ROUGE-L vs {results['reference']}'s output")
    ax.set_title(
        f"{name}: quality vs speedup · {results['model']} · {results['dtype']} · {results['threads']} threads",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
