"""``m2r2 bench --suite serve``: load on a loopback server, and a bounded soak test.

The server runs in this process (its scheduler and uvicorn in threads, the load in the main
thread's event loop), so the numbers include HTTP, JSON and streaming, as a client sees them.
Each level runs ``streams`` clients in parallel, each sending streamed greedy chat requests one
after another, for a bounded number of requests and seconds. Greedy answers do not depend on load,
so every answer is also compared with the same prompt's answer at one stream: ``identical``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from m2r2.bench.datasets import load_dataset
from m2r2.bench.results import stamp
from m2r2.errors import SettingsError
from m2r2.serve.app import background, build

if TYPE_CHECKING:
    from m2r2.engine import Engine

STREAMS = (1, 2, 4, 8)


@dataclass
class Outcome:
    """What one streamed request looked like from the client."""

    prompt: str
    start: float
    first: float | None = None  # first content chunk
    chunks: list[float] = field(default_factory=list)  # arrival times of content chunks
    text: str = ""
    tokens: int = 0  # completion tokens (from the final usage chunk)
    finish: str | None = None
    done: bool = False  # "[DONE]" arrived
    error: str | None = None
    end: float = 0.0

    @property
    def complete(self) -> bool:
        return self.error is None and self.done and self.finish is not None and self.tokens > 0


async def stream_chat(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, **extra: Any) -> Outcome:
    """One streamed chat request, timed chunk by chunk."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    out = Outcome(prompt, time.perf_counter())
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out.done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    out.error = obj["error"]["message"]
                    break
                if obj.get("usage"):
                    out.tokens = obj["usage"]["completion_tokens"]
                for c in obj.get("choices", []):
                    if c["delta"].get("content"):
                        now = time.perf_counter()
                        out.first = out.first or now
                        out.chunks.append(now)
                        out.text += c["delta"]["content"]
                    out.finish = c.get("finish_reason") or out.finish
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.end = time.perf_counter()
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def run_level(
    url: str, model: str, prompts: list[str], streams: int, requests: int, max_tokens: int, seconds: float
) -> tuple[dict[str, Any], list[Outcome]]:
    """``streams`` clients sending requests back to back until ``requests`` were sent or ``seconds`` passed."""
    outcomes: list[Outcome] = []
    next_prompt = 0
    t0 = time.perf_counter()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_prompt
        while next_prompt < requests and time.perf_counter() - t0 < seconds:
            p = prompts[next_prompt % len(prompts)]
            next_prompt += 1
            outcomes.append(await stream_chat(client, model, p, max_tokens))

    limits = httpx.Limits(max_connections=streams + 1)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(streams)))
    wall = time.perf_counter() - t0
    itl = [b - a for o in outcomes for a, b in zip(o.chunks, o.chunks[1:], strict=False)]
    ttft = [o.first - o.start for o in outcomes if o.first is not None]
    tokens = sum(o.tokens for o in outcomes)
    stats = {
        "streams": streams,
        "requests": len(outcomes),
        "seconds": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p95_s": _pct(ttft, 0.95),
        "itl_p50_s": _pct(itl, 0.5),
        "itl_p95_s": _pct(itl, 0.95),
        "errors": sum(o.error is not None for o in outcomes),
        "complete": sum(o.complete for o in outcomes) / len(outcomes) if outcomes else 0.0,
    }
    return stats, outcomes


def run_serve_suite(
    engine: Engine,
    out_dir: Path,
    streams: list[int] | None = None,
    requests: int = 16,
    max_new_tokens: int = 64,
    seconds: float = 300.0,
    method: str = "auto",
    dataset: str = "builtin",
) -> dict[str, Any]:
    """Load at each stream count; writes results.json, results.md and serve.png to ``out_dir``."""
    streams = streams or list(STREAMS)
    if min(streams) < 1 or requests < 1 or max_new_tokens < 1 or seconds <= 0:
        raise SettingsError("streams, requests, max_new_tokens and seconds must be positive")
    prompts = [p.turns[0] for p in load_dataset(dataset).prompts]
    name = engine.model_dir.name
    app = build(engine, name, method, max_batch=max(streams), max_queue=max(streams))
    levels: dict[str, Any] = {}
    answers: dict[str, str] = {}
    with background(app) as url:
        asyncio.run(run_level(url, name, prompts[:1], 1, 1, max_new_tokens, seconds))  # warm-up, untimed
        for s in streams:
            stats, outcomes = asyncio.run(run_level(url, name, prompts, s, max(requests, s), max_new_tokens, seconds))
            same = []
            for o in outcomes:
                if o.complete:
                    ref = answers.setdefault(o.prompt, o.text)
                    same.append(o.text == ref)
            stats["identical"] = sum(same) / len(same) if same else 0.0
            levels[str(s)] = stats
            print(_row(stats), flush=True)
        status = httpx.get(url + "/health").json()
    base = levels[str(streams[0])]["tokens_per_s"]
    for v in levels.values():
        v["speedup_vs_first"] = v["tokens_per_s"] / base if base else 0.0
    results = {
        **_machine(engine),
        "method": app.state.scheduler.method,
        "dataset": dataset,
        "requests_per_level": requests,
        "max_new_tokens": max_new_tokens,
        "server": status,
        "serve": levels,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    results["markdown"] = markdown(results)
    (out_dir / "results.md").write_text(results["markdown"] + "\n")
    plot(results, out_dir / "serve.png")
    return results


def _machine(engine: Engine) -> dict[str, Any]:
    import platform

    import torch

    from m2r2.machine import cpu_name

    return {
        "model": engine.model_dir.name,
        "cpu": cpu_name(),
        "cores": __import__("os").cpu_count(),
        "threads": torch.get_num_threads(),
        "dtype": engine.dtype_name,
        "kernel": engine.kernel,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        **stamp(),
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def _row(v: dict[str, Any]) -> str:
    return (
        f"| {v['streams']} | {v['requests']} | {v['tokens_per_s']:.1f} | {v.get('speedup_vs_first', 1.0):.2f}x | "
        f"{_ms(v['ttft_p50_s'])} | {_ms(v['ttft_p95_s'])} | {_ms(v['itl_p50_s'])} | {_ms(v['itl_p95_s'])} | "
        f"{v['errors']} | {v['complete']:.0%} | {v.get('identical', 0):.0%} |"
    )


def markdown(results: dict[str, Any]) -> str:
    r = results
    lines = [
        f"{r['model']} served by `m2r2 serve` ({r['method']}; {r['dtype']}, kernel {r['kernel']}) on {r['cpu']} "
        f"({r['cores']} cores, {r['threads']} torch threads), torch {r['torch_version']}; streamed greedy chat, "
        f"{r['dataset']} prompts, up to {r['max_new_tokens']} new tokens, {r['requests_per_level']} requests per "
        f"level; {r['date']}; commit {r.get('commit', 'unknown')}; command `{r.get('command', '?')}`",
        "",
        "| streams | requests | tokens/s | vs 1 stream | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | "
        "errors | complete | identical |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    lines += [_row(v) for v in r["serve"].values()]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lv = list(results["serve"].values())
    xs = [v["streams"] for v in lv]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [v["tokens_per_s"] for v in lv], "o-")
    a.set(xlabel="concurrent streams", ylabel="aggregate tokens/s", title="throughput", xticks=xs)
    for key, label in (("ttft_p50_s", "TTFT p50"), ("itl_p50_s", "ITL p50"), ("itl_p95_s", "ITL p95")):
        b.plot(xs, [1000 * (v[key] or 0) for v in lv], "o-", label=label)
    b.set(xlabel="concurrent streams", ylabel="ms", title="latency", xticks=xs)
    b.legend()
    fig.suptitle(f"m2r2 serve: {results['model']} ({results['method']}) on {results['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- soak


def rss_mb() -> float:
    """Resident memory of this process (server and load generator together), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


#: What a soak client sends (drawn uniformly): streamed and whole greedy chat, seeded sampling, a
#: streamed request hung up after 1-4 chunks, and a malformed request (bad JSON or parameters).
SOAK_KINDS = ("stream", "stream", "whole", "whole", "disconnect", "sampled", "malformed")
#: Kinds whose every request must get a whole answer: one that does not is a completion lost.
ANSWERED_KINDS = ("stream", "whole", "sampled")


async def _soak_load(
    url: str, model: str, prompts: list[str], minutes: float, streams: int, max_tokens: int, seed: int
) -> tuple[dict[str, dict[str, int]], list[str], list[tuple[float, float]]]:
    """Mixed traffic until the deadline: per kind, requests ``sent`` and ``answered`` (a whole answer;
    for a malformed request an OpenAI error object with a 4xx status; for a disconnect the stream
    began), failures, and RSS samples ``(seconds, MiB)``."""
    rng = random.Random(seed)
    deadline = time.monotonic() + 60 * minutes
    tally = {kind: {"sent": 0, "answered": 0} for kind in dict.fromkeys(SOAK_KINDS)}
    failures: list[str] = []
    refs: dict[str, str] = {}
    t0 = time.monotonic()
    rss: list[tuple[float, float]] = [(0.0, rss_mb())]

    def fail(kind: str, msg: str) -> None:
        if len(failures) < 50:
            failures.append(f"{kind}: {msg}")

    def check(prompt: str, text: str) -> None:
        """Greedy answers do not depend on load: each must equal the first answer to its prompt."""
        if text != refs.setdefault(prompt, text):
            fail("greedy", f"answer changed for {prompt[:40]!r}")

    async def one(client: httpx.AsyncClient, kind: str) -> bool:
        """Send one request of ``kind``; whether it was answered as it should be."""
        prompt = rng.choice(prompts)
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
        }
        if kind == "stream":
            o = await stream_chat(client, model, prompt, max_tokens)
            if o.complete:
                check(prompt, o.text)
            return o.complete
        if kind in ("whole", "sampled"):
            if kind == "sampled":
                body |= {"temperature": 0.8, "seed": 7}
            r = await client.post("/v1/chat/completions", json=body)
            whole = r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
            if whole and kind == "whole":
                check(prompt, r.json()["choices"][0]["message"]["content"])
            return whole
        if kind == "disconnect":
            async with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
                n = rng.randint(1, 4)
                async for line in r.aiter_lines():
                    n -= line.startswith("data: ")
                    if n <= 0:
                        break  # leaving the block closes the connection mid-stream
                return r.status_code == 200
        bad = rng.choice([b"{oops", b'{"model": "nope", "messages": []}', b'{"messages": [], "temperature": -3}'])
        r = await client.post("/v1/chat/completions", content=bad, headers={"content-type": "application/json"})
        return 400 <= r.status_code < 500 and "error" in r.json()

    async def worker() -> None:
        # a client per worker: a disconnect closes only its own connection
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
            while time.monotonic() < deadline:
                kind = rng.choice(SOAK_KINDS)
                tally[kind]["sent"] += 1
                try:
                    answered = await one(client, kind)
                except Exception as e:  # any client-side surprise is a failure of the server's answer
                    fail(kind, f"{type(e).__name__}: {e}")
                    continue
                tally[kind]["answered"] += answered
                if not answered:
                    fail(kind, "no proper answer")

    async def sampler() -> None:
        every = min(5.0, 6.0 * minutes)  # at least ten samples
        while time.monotonic() < deadline:
            await asyncio.sleep(every)
            rss.append((time.monotonic() - t0, rss_mb()))

    await asyncio.gather(sampler(), *(worker() for _ in range(streams)))
    rss.append((time.monotonic() - t0, rss_mb()))
    return tally, failures, rss


def run_soak(
    engine: Engine,
    out_dir: Path,
    minutes: float,
    streams: int = 8,
    max_new_tokens: int = 32,
    method: str = "auto",
    rss_bound_mb: float = 64.0,
    dataset: str = "builtin",
) -> dict[str, Any]:
    """Mixed traffic for ``minutes`` (:data:`SOAK_KINDS` from ``streams`` clients), then checks that
    no completion was lost (every request of :data:`ANSWERED_KINDS` answered whole, greedy answers
    unchanged), every request got its proper answer, the server failed none and is idle, and RSS
    stayed flat: after the first fifth of the run (allocator and caches warm up) it may grow at most
    ``rss_bound_mb``. Bounded: clients stop sending at the deadline and in-flight requests end within
    their ``max_new_tokens``. Writes ``soak.json`` to ``out_dir``.
    """
    if minutes <= 0:
        raise SettingsError(f"soak minutes must be positive, got {minutes}")
    prompts = [p.turns[0] for p in load_dataset(dataset).prompts]
    name = engine.model_dir.name
    app = build(engine, name, method, max_batch=streams, max_queue=streams)
    with background(app) as url:
        tally, failures, rss = asyncio.run(_soak_load(url, name, prompts, minutes, streams, max_new_tokens, 0))
        deadline = time.monotonic() + 30
        while (status := httpx.get(url + "/health").json())["active"] and time.monotonic() < deadline:
            time.sleep(0.1)
    lost = sum(tally[k]["sent"] - tally[k]["answered"] for k in ANSWERED_KINDS)
    if status["active"] or status["waiting"] or status["failed"]:
        failures.append(f"server not idle or failed requests after the soak: {status}")
    warm = [m for t, m in rss if t >= 12 * minutes] or [rss[-1][1]]
    growth = max(warm) - warm[0]
    if growth > rss_bound_mb:
        failures.append(f"RSS grew {growth:.0f} MiB after warm-up (bound {rss_bound_mb:.0f} MiB)")
    result = {
        **_machine(engine),
        "minutes": minutes,
        "streams": streams,
        "requests": tally,
        "sent": sum(t["sent"] for t in tally.values()),
        "completions_lost": lost,
        "all_answered": all(t["sent"] == t["answered"] for t in tally.values()),
        "server": status,
        "rss_mib": {"start": rss[0][1], "after_warmup": warm[0], "max_after_warmup": max(warm), "end": rss[-1][1]},
        "rss_growth_after_warmup_mib": growth,
        "rss_bound_mib": rss_bound_mb,
        "failures": failures,
    }
    result["ok"] = not failures and lost == 0 and result["all_answered"]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "soak.json").write_text(json.dumps(result, indent=2))
    return result
