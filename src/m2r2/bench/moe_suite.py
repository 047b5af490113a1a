"""``m2r2 bench --suite moe``: ahead-of-time expert loading policies on an MoE model with offloaded experts.

Grid: modelled slow-memory bandwidth (``measured`` = the real file reads only; e.g. ``2GB/s``
flash-like, ``25GB/s`` PCIe-like) x cache size (fraction of all experts) x policy
(:data:`m2r2.moe.policies.POLICIES`). For every prompt (first turn only, so every run answers the
same input), the all-resident model first answers it once, recording the routing (the oracle's
trace and the reference output); then every (bandwidth, cache, policy) answers it, interleaved
prompt by prompt after an untimed warm-up, so drifting machine load hits all settings alike.

Per setting: median tokens/s, paired speedup against ``on-demand`` at the same bandwidth and cache
(median of per-prompt ratios), decode-step hit rate / late rate, stall seconds and bytes loaded per
token, and prediction precision/recall per lookahead distance (layers between a prediction and the
layer that uses it) and source (``gate`` = a router on the slow residual one layer ahead, ``fast``
= a router on the M2R2 fast stream's state, ``oracle``). Every output is checked against the
all-resident output (``identical``). Figures marked ``modelled`` come from the bandwidth model;
all others are measured on this machine.
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from m2r2.bench.datasets import load_dataset
from m2r2.bench.quality import paired_speedup
from m2r2.bench.report import header_line
from m2r2.bench.results import BenchSettings, check_out_dir, environment, save_results
from m2r2.decoding.base import GenerationConfig
from m2r2.errors import SettingsError, WeightsError
from m2r2.moe.policies import POLICIES, moe_layers
from m2r2.moe.runtime import OffloadedMoE, expert_store, record_trace, store_path, total_experts

if TYPE_CHECKING:
    from m2r2.engine import Engine
    from m2r2.multirate.fast import FastStream

DEFAULT_BANDWIDTHS = ["measured", "2GB/s", "25GB/s"]
DEFAULT_FRACTIONS = [0.25, 0.5, 0.75]
BASELINE = "on-demand"
DEFAULT_DATASET = "mt_bench"
#: Warm-up budget (tokens) of the untimed runs.
WARMUP_TOKENS = 8
_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(text: str) -> float | None:
    """``measured`` -> None (no model); ``2GB/s``, ``500MB/s``, ``2e9`` -> bytes per second."""
    t = text.strip().lower()
    if t in ("measured", "none", "io"):
        return None
    m = re.fullmatch(r"([0-9.e+-]+)\s*([kmgt]?)(?:b/s|b)?", t)
    try:
        value = float(m.group(1)) * _UNITS[m.group(2)] if m else -1.0
    except ValueError:
        value = -1.0
    if value <= 0:
        raise SettingsError(f"bad bandwidth {text!r}: give 'measured' or e.g. 2GB/s, 500MB/s, 2e9 (bytes/s)")
    return value


def _fast_stream(engine: Engine, adapters: Path | None) -> FastStream:
    """Adapters for this MoE model: ``adapters``, else ``<model dir>/fast/adapters.safetensors``, else shipped."""
    from m2r2.multirate.io import load_default

    if adapters is None and (engine.model_dir / "fast" / "adapters.safetensors").is_file():
        adapters = engine.model_dir / "fast" / "adapters.safetensors"
    try:
        fast = load_default(engine.model, engine.fingerprint, adapters)
    except WeightsError as e:
        raise WeightsError(
            f"the m2r2 policy needs fast-stream adapters trained for this MoE model ({e}); train them with "
            f"`m2r2 train --model {engine.model_dir}` and copy adapters.safetensors/.json to "
            f"{engine.model_dir / 'fast'}, or leave m2r2 out of --policies"
        ) from e
    return fast.to(engine.model.device).freeze(merge=True)


def run_moe(engine: Engine, settings: BenchSettings) -> dict[str, Any]:
    """Run the grid; write results.json, results.md and moe.png to ``settings.out_dir``."""
    model = engine.model
    if not moe_layers(model):
        raise SettingsError(f"--suite moe needs an MoE model; {engine.model_dir.name} has no MoE layers")
    gen = GenerationConfig(max_new_tokens=settings.max_new_tokens).validate()
    bandwidths = list(getattr(settings, "bandwidths", None) or DEFAULT_BANDWIDTHS)
    fractions = list(getattr(settings, "cache_fractions", None) or DEFAULT_FRACTIONS)
    policies = list(getattr(settings, "policies", None) or POLICIES)
    bw = {b: parse_bandwidth(b) for b in bandwidths}
    if bad := [p for p in policies if p not in POLICIES]:
        raise SettingsError(f"unknown policy {', '.join(bad)}; choose from {', '.join(POLICIES)}")
    if BASELINE not in policies:
        policies.insert(0, BASELINE)
    if any(not 0 < f <= 1 for f in fractions):
        raise SettingsError(f"cache fractions must be in (0, 1], got {fractions}")
    data = load_dataset(settings.dataset or DEFAULT_DATASET, settings.limit)
    out = check_out_dir(settings)
    fast = _fast_stream(engine, getattr(settings, "adapters", None)) if "m2r2" in policies else None
    store = expert_store(model, store_path(engine.fingerprint, model.dtype))
    n_experts = total_experts(model)
    widest = max(model.layers[i].mlp.num_experts for i in moe_layers(model))
    runners = {
        f: OffloadedMoE(model, store, max(widest, round(f * n_experts)), engine.tokenizer.eos_ids) for f in fractions
    }
    eos, tok = engine.tokenizer.eos_ids, engine.tokenizer
    prompts = [(p.id, tok.encode_chat([{"role": "user", "content": p.turns[0]}])) for p in data.prompts]

    def run(f: float, b: str, policy: str, ids: list[int], g: GenerationConfig, trace: Any) -> Any:
        runner = runners[f]
        runner.bandwidth = bw[b]
        return runner.generate(ids, g, policy=policy, fast=fast, trace=trace)

    if settings.warmup and prompts:  # untimed: code paths, allocator, page cache of the expert file
        g = GenerationConfig(max_new_tokens=WARMUP_TOKENS)
        _, trace = record_trace(model, prompts[0][1], g, eos)
        for policy in policies:
            run(fractions[0], bandwidths[0], policy, prompts[0][1], g, trace)

    rows: list[dict[str, Any]] = []
    stamp = environment(engine, settings)
    for pid, ids in tqdm(prompts, desc=f"moe {data.name}", unit="prompt", file=sys.stderr):
        ref, trace = record_trace(model, ids, gen, eos)
        row: dict[str, Any] = {"id": pid, "prompt_tokens": len(ids), "new_tokens": len(ref.tokens)}
        row["resident_tokens_per_s"] = ref.tokens_per_s
        runs: dict[str, Any] = {}
        for b in bandwidths:
            for f in fractions:
                for policy in policies:
                    out = run(f, b, policy, ids, gen, trace)
                    runs[f"{b}|{f}|{policy}"] = {
                        "tokens_per_s": out.tokens_per_s,
                        "seconds": out.seconds,
                        "identical": out.tokens == ref.tokens,
                        **{k: v for k, v in out.stats.items() if k not in ("counts", "policy")},
                    }
        row["runs"] = runs
        rows.append(row)
        save_results(out, {"suite": "moe", "dataset": data.name, **stamp, "prompts": rows}, complete=False)

    moe = summarize(rows, bandwidths, fractions, policies)
    results: dict[str, Any] = {
        "suite": "moe",
        "dataset": data.name,
        "n_prompts": len(rows),
        "max_new_tokens": settings.max_new_tokens,
        "warmup": settings.warmup,
        **stamp,
        "experts": {
            "total": n_experts,
            "per_layer": widest,
            "top_k": model.layers[moe_layers(model)[0]].mlp.top_k,
            "moe_layers": len(moe_layers(model)),
            "expert_bytes": store.expert_bytes,
            "store": str(store.path),
            "capacities": {str(f): r.cache.capacity for f, r in runners.items()},
        },
        "bandwidths": {b: bw[b] for b in bandwidths},
        "fast_stream": None if fast is None else fast.cfg.to_dict(),
        "resident_tokens_per_s": statistics.median(r["resident_tokens_per_s"] for r in rows) if rows else 0.0,
        "moe": moe,
        "prompts": rows,
    }
    save_results(out, results, complete=True)
    text = f"{header_line(results)}\n\n{markdown(results)}\n"
    (out / "results.md").write_text(text, encoding="utf-8")
    plot(results, out / "moe.png")
    store.close()
    return {**results, "markdown": text}


def _merge_prediction(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Pool precision/recall counts over prompts: ``{source: {distance: {precision, recall, predicted}}}``."""
    tot: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0, 0]))
    for r in runs:
        for source, by_dist in r.get("prediction", {}).items():
            for dist, s in by_dist.items():
                t = tot[source][dist]
                t[0] += s["correct"]
                t[1] += s["predicted"]
                t[2] += s["actual"]
    return {
        source: {
            d: {"precision": tp / p if p else 0.0, "recall": tp / a if a else 0.0, "predicted": p}
            for d, (tp, p, a) in sorted(by.items(), key=lambda kv: int(kv[0]))
        }
        for source, by in tot.items()
    }


def summarize(
    rows: list[dict[str, Any]], bandwidths: list[str], fractions: list[float], policies: list[str]
) -> dict[str, Any]:
    """``{bandwidth: {fraction: {policy: metrics}}}``; speedups are paired against on-demand per prompt."""
    out: dict[str, Any] = {}
    for b in bandwidths:
        out[b] = {}
        for f in fractions:
            cell: dict[str, Any] = {}
            base = [r["runs"][f"{b}|{f}|{BASELINE}"]["tokens_per_s"] for r in rows]
            for policy in policies:
                runs = [r["runs"][f"{b}|{f}|{policy}"] for r in rows]
                rates = [x["tokens_per_s"] for x in runs]

                def mean(key: str, runs: list[dict[str, Any]] = runs) -> float:
                    return statistics.fmean(x[key] for x in runs) if runs else 0.0

                cell[policy] = {
                    "tokens_per_s": statistics.median(rates) if rates else 0.0,
                    "speedup": paired_speedup(rates, base) or 0.0,
                    "hit_rate": mean("hit_rate"),
                    "late_rate": mean("late_rate"),
                    "stall_ms_per_token": 1e3 * mean("stall_s_per_token"),
                    "mb_per_token": mean("bytes_per_token") / 1e6,
                    "stalls_per_token": mean("stalls_per_token"),
                    "prefetch_dropped": mean("prefetch_dropped"),
                    "prefetch_cancelled": mean("prefetch_cancelled"),
                    "read_s_measured": mean("read_s_measured"),
                    "copy_s_modelled": mean("copy_s_modelled"),
                    "fast_expert_coverage": mean("fast_expert_coverage"),
                    "identical": statistics.fmean(x["identical"] for x in runs) if runs else 0.0,
                    "prediction": _merge_prediction(runs),
                }
            out[b][str(f)] = cell
    return out


def _pr_line(pred: dict[str, dict[str, float]], source: str) -> str:
    by = pred.get(source, {})
    return ", ".join(f"{d}: {s['precision']:.2f}/{s['recall']:.2f}" for d, s in by.items()) or "-"


def markdown(results: dict[str, Any]) -> str:
    ex = results["experts"]
    lines = [
        f"{ex['total']} experts ({ex['moe_layers']} MoE layers x {ex['per_layer']}, top-{ex['top_k']}), "
        f"{ex['expert_bytes'] / 1e3:.0f} kB each; all-resident median {results['resident_tokens_per_s']:.1f} tok/s. "
        "Bandwidth `measured` = real file reads only (page cache); others add a modelled link "
        "(copy time = max(measured, bytes/bandwidth)).",
        "",
        "| bandwidth | cache | policy | tok/s | speedup vs on-demand | hit rate | late | stall ms/tok | MB/tok "
        "| identical |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for b, by_f in results["moe"].items():
        for f, cell in by_f.items():
            for policy, m in cell.items():
                lines.append(
                    f"| {b} | {float(f):.0%} ({ex['capacities'][f]}) | {policy} | {m['tokens_per_s']:.1f} | "
                    f"{m['speedup']:.2f}x | {m['hit_rate']:.1%} | {m['late_rate']:.1%} | "
                    f"{m['stall_ms_per_token']:.2f} | {m['mb_per_token']:.1f} | {m['identical']:.0%} |"
                )
    lines += [
        "",
        "Prediction precision/recall by lookahead distance (layers ahead: precision/recall), pooled over prompts:",
        "",
        "| bandwidth | cache | policy | source | distance: precision/recall |",
        "|---|--:|---|---|---|",
    ]
    for b, by_f in results["moe"].items():
        for f, cell in by_f.items():
            for policy, m in cell.items():
                for source in m["prediction"]:
                    lines.append(
                        f"| {b} | {float(f):.0%} | {policy} | {source} | {_pr_line(m['prediction'], source)} |"
                    )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Hit rate and speedup vs cache size, one column per bandwidth, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe = results["moe"]
    bws = list(moe)
    fig, axes = plt.subplots(2, len(bws), figsize=(4.2 * len(bws), 7), squeeze=False)
    for c, b in enumerate(bws):
        fracs = list(moe[b])
        policies = list(moe[b][fracs[0]])
        for i, policy in enumerate(policies):
            xs = [100 * float(f) for f in fracs]
            for r, key in enumerate(("hit_rate", "speedup")):
                ys = [moe[b][f][policy][key] for f in fracs]
                axes[r][c].plot(xs, ys, marker="o", color=f"C{i}", label=policy)
        axes[0][c].set_title(f"bandwidth: {b}", fontsize=9)
        axes[0][c].set_ylim(0, 1.05)
        axes[0][c].set_ylabel("decode hit rate")
        axes[1][c].set_ylabel("speedup vs on-demand")
        axes[1][c].axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
        for r in range(2):
            axes[r][c].set_xlabel("cache size (% of all experts)")
            axes[r][c].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        f"{results['model']} · {results['dataset']} · {results['n_prompts']} prompts · {results['dtype']} · "
        f"{results['threads']} threads · {results['device']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
