"""What a draft step and a verify pass cost on this machine, and the draft length that pays best.

The self-speculative loop caps each draft at the length that maximises expected tokens per second
(:meth:`CostModel.best_length`) given measured costs. Measuring takes seconds, so the costs are
kept per machine and drafter shape in ``$M2R2_CACHE/costs`` for a day.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

import m2r2.model
from m2r2.files import atomic_text
from m2r2.machine import cpu_name
from m2r2.paths import cache_root

C = TypeVar("C")

if TYPE_CHECKING:
    from torch import nn

    from m2r2.decoding.base import Loaded
    from m2r2.model import Transformer


def expected_tokens(accept: float, drafts: int) -> float:
    """Tokens one round emits on average when each of ``drafts`` drafts is accepted with i.i.d.
    probability ``accept`` (Leviathan et al.): the accepted prefix plus the verifier's own token."""
    return (1 - accept ** (drafts + 1)) / (1 - accept) if accept < 1 else drafts + 1.0


@dataclass
class CostModel:
    """Measured seconds of one draft step and of verify passes over 1..k tokens."""

    draft: float
    verify: list[float]  # verify[k-1] = cost of a slow pass over k tokens

    def best_length(self, accept: float, cap: int) -> int:
        """Draft length g maximising expected emitted tokens ``(1 - a^(g+1)) / (1 - a)`` per second."""
        a = min(max(accept, 0.0), 0.99)
        best, best_rate = 0, 1.0 / self.verify[0]
        for g in range(1, min(cap, len(self.verify) - 1) + 1):
            rate = expected_tokens(a, g) / (g * self.draft + self.verify[g])
            if rate > best_rate:
                best, best_rate = g, rate
        return best


def measure_costs(model: Transformer, drafter_factory: Callable[[Any], Any], k_max: int, repeats: int = 5) -> CostModel:
    """Time one draft step and verify passes of 1..k_max+1 tokens at a 128-token context.

    Done once per strategy: these costs are machine-specific (on a CPU bf16 a verify pass of 8
    tokens costs little more than one, in fp32 far more), which is why the cap is measured. The
    timings are interleaved (draft, verify 1, ..., verify k+1, again) and the minimum is kept, so
    a burst of load from elsewhere cannot make one of them look cheap relative to the others.
    """
    ctx = 128
    cache = model.new_cache(ctx + k_max + 2)
    ids = torch.arange(ctx, device=model.device)[None] % model.cfg.vocab_size
    drafter = drafter_factory(cache)
    drafter.observe(ids[0].tolist())  # a drafter with its own cache catches up on the context once (warm-up)

    def one_draft() -> None:
        drafter.start(ctx)
        drafter.step(1)

    calls: list[Callable[[], object]] = [one_draft]
    for k in range(1, k_max + 2):
        block = torch.ones(1, k, dtype=torch.long, device=model.device)
        calls.append(lambda block=block: model(block, cache, ctx))
    best = [float("inf")] * len(calls)
    with torch.inference_mode():
        model(ids, cache, 0, last_only=True)
        for f in calls:  # warm-up
            f()
        for _ in range(repeats):
            for i, f in enumerate(calls):
                t = time.perf_counter()
                f()
                best[i] = min(best[i], time.perf_counter() - t)
    return CostModel(draft=best[0], verify=best[1:])


#: Cached cost measurements older than this are measured again (machine load drifts).
COST_CACHE_MAX_AGE_S = 24 * 3600


@functools.cache
def code_stamp() -> str:
    """A digest of m2r2's own source files (names, sizes, modification times): costs measured under
    other code (a faster verify pass, a cheaper drafter) must not outlive it, and the version number
    does not change with every edit. The C++ headers count: the 4-bit loop lives in one
    (``csrc_avx2/q4_rows.h``). Stats ~100 files once per process."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted([*root.rglob("*.py"), *root.rglob("*.cpp"), *root.rglob("*.h")]):
        st = f.stat()
        h.update(f"{f.relative_to(root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def cost_cache_path(engine: Loaded, fast: nn.Module, k_max: int) -> Path:
    """Where measured costs of this drafter on this machine are kept: ``$M2R2_CACHE/costs/<key>.json``.

    ``fast``: the drafter's module (a fast stream, seeded or not, or Medusa heads). The key holds
    everything the timings depend on (hardware, threads, versions, model, precision, kernel, the
    drafter's shape: its config, folded or not, draft-vocabulary size; m2r2's code, :func:`code_stamp`)
    and nothing they do not (the trained values), so retrained adapters or heads of the same shape reuse
    the measurement.
    """
    parts = {
        "cpu": cpu_name(),
        "device": str(engine.model.device),
        "gpu": torch.cuda.get_device_name(engine.model.device) if engine.model.device.type == "cuda" else "",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "code": code_stamp(),
        "model": engine.fingerprint,
        "dtype": engine.dtype_name,
        "kernel": engine.kernel,
        "fused_blocks": m2r2.model.FUSED_BLOCKS,  # read now: a run may switch it
        "fast": asdict(fast.cfg),
        "adapters": getattr(fast, "use_adapters", True),
        "folded": getattr(fast, "merged", None) is not None,
        "draft_vocab": 0 if fast.sub_head is None or fast.draft_vocab is None else len(fast.draft_vocab),
        "draft_head": type(fast.sub_head).__name__,
        "k_max": k_max,
    }
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root() / "costs" / f"{key}.json"


#: a pass over several rows timed below this fraction of a one-row pass: the machine was busy while measuring
#: (seen: 5.1 ms for 3 rows against 7.9 ms for 1, measured beside another job, where 1 row takes 4.5 ms alone).
#: Only against the one-row pass: some kernels legitimately run 4 rows faster than 2 or 3 (cached curves here)
BUSY_DIP = 0.85


def check_verify_curve(verify: list[float]) -> None:
    """A ValueError if a pass over several rows timed well below a one-row pass (within ``BUSY_DIP``),
    which does the least work of all."""
    for k in range(1, len(verify)):
        if verify[k] < BUSY_DIP * verify[0]:
            raise ValueError(f"a pass of {k + 1} rows timed cheaper than one of 1 row: measured on a busy machine")


def _cost_model(raw: dict[str, Any]) -> CostModel:
    costs = CostModel(draft=float(raw["draft"]), verify=[float(v) for v in raw["verify"]])
    if not (costs.draft > 0 and costs.verify and min(costs.verify) > 0):
        raise ValueError("non-positive cost")
    check_verify_curve(costs.verify)
    return costs


#: a sequence whose one-row verify passes ran below this fraction of the cached measurement's (the online fit's
#: intercept scale, averaged over at least ``LOADED_MIN_PASSES`` passes) shows that measurement was timed on a
#: busier machine (seen: costs timed while a store build held both cores, ~1.5x too high, shaped every tree of the
#: day on the quiet machine until the file was deleted); passes slower than measured prove nothing (a busy moment
#: now, or contexts longer than the measurement's 128 tokens)
LOADED_SCALE = 0.8
LOADED_MIN_PASSES = 16


def drop_loaded_costs(path: Path | None, scale: float | None, passes: int) -> bool:
    """Delete the cached costs at ``path`` when a sequence's own passes ran at ``scale`` (< ``LOADED_SCALE``, over
    ``passes`` >= ``LOADED_MIN_PASSES``) of their one-row cost, so that the next build measures again; this run has
    corrected them online already. Returns whether the file was dropped."""
    if path is None or scale is None or passes < LOADED_MIN_PASSES or scale >= LOADED_SCALE:
        return False
    with contextlib.suppress(OSError):  # another process dropped it first, or a read-only cache
        path.unlink()
        return True
    return False


def cached_costs(path: Path, measure: Callable[[], C], parse: Callable[[dict[str, Any]], C] = _cost_model) -> C:  # type: ignore[assignment]
    """The costs stored at ``path`` if fresh and well-formed (``parse`` raises otherwise), else
    ``measure()`` stored there atomically.

    Measuring takes ~2 s on the project's CPU, more than the rest of building the strategy; a
    one-shot ``m2r2 generate`` should not pay it every time. A damaged file is measured again. A
    measurement ``parse`` refuses (a busy machine: :func:`check_verify_curve`) is taken once more and,
    if still refused, used for this run only: kept, it would shape every tree of the day.
    """
    try:
        if time.time() - path.stat().st_mtime < COST_CACHE_MAX_AGE_S:
            return parse(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for _ in range(2):
        costs = measure()
        try:
            parse(json.loads(json.dumps(asdict(costs))))
        except ValueError:
            continue
        with contextlib.suppress(OSError):  # a read-only cache only costs the next run a measurement
            atomic_text(path, json.dumps(asdict(costs)))
        break
    return costs
