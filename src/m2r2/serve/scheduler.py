"""Continuous batching over per-request KV caches, in one background thread.

Requests join the running batch at token boundaries (after their prefill) and leave when they
stop or their client goes away. Each step either

* runs one batched decoding step over every active request (all greedy: :meth:`Transformer.greedy_steps`, the
  step and each row's argmax in one C++ call where the kernel has it, 1.75-2.4x faster at 2-8 requests than per op,
  ``experiments/batched_steps.py``; else :meth:`Transformer.step_rows`: the linear layers see all rows at once,
  attention runs once per cache size class over the class's requests), or
* when a single request is active and nobody waits, runs one self-speculative round for it
  (draft with the fast stream, verify with the slow model), which is what ``m2r2`` buys at low load.

Both are lossless, so a greedy request gets exactly the tokens it would get alone, whatever else
is running (``tests/test_serve.py`` checks it against ``Engine.generate``). Why speculation only at
low load: a verify pass of k rows per request would multiply the rows of a batched step, and on
a CPU the 4-bit kernel's cost grows with rows (BENCHMARKS.md, "Serving"), so at two or more
streams batching already uses what a verify pass would have used.

Every request's cache is lent by one pool (:meth:`Transformer.new_pool`): capacities are rounded to
size classes of 64 tokens (``decoding.base.cache_capacity``, shared by every method, so the bits
match ``Engine.generate``), and the requests of a class are consecutive items of one cache, so a
batched step attends over them through a view, without copying caches.

Which kernel (``m2r2 serve --kernel auto``, :func:`serve_kernel`). One batched step (step_rows +
greedy head) of B requests with 190-235-token prompts, pooled caches, SmolLM2-135M bf16, 1 thread,
on the 2-core AMX Xeon (``benchmarks/serve/step_rows.py``, CPU ms, best of 12; the machine is
shared, runs differ by ~10%):

    B              1      2      4      8      16
    q4-amx (ms)   22     30     32     44      67
    q4 (ms)       26     33     44     94     152
    mkldnn (ms)   50     59     66    101     105

Then ``auto`` loaded q4-amx where it built (the 4-bit weights summed on AMX, flat in rows), the fastest at every
batch size; it now loads what :func:`m2r2.kernels.use_kernels` picks (``q4-avx2`` wherever its C++ build runs, AMX
CPUs included: there its batched steps of 10 rows or more sum on AMX tiles). Where no C++ kernel builds (no
compiler) the 4-bit ``q4`` kernel wins alone and oneDNN's bf16 GEMM from ~16 rows, so from ``--max-batch``
:data:`MKLDNN_FROM_BATCH` on an AMX CPU without q4-amx ``auto`` loads ``mkldnn`` (throughput at high load over
latency at low load). An explicit ``--kernel`` is kept.

The thread owns all torch work; the HTTP side only submits, cancels, and reads :class:`Update`s
delivered through each job's ``emit`` callback.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from m2r2 import amx
from m2r2.decoding.base import GenerationConfig, Sampler, Stopper, begin
from m2r2.decoding.speculative import SelfSpeculative
from m2r2.decoding.tree import TreeSpeculative
from m2r2.errors import M2R2Error, SettingsError
from m2r2.kernels import head_argmax
from m2r2.machine import cpu_has, default_device

if TYPE_CHECKING:
    from m2r2.cache import KVCache
    from m2r2.engine import Engine
    from m2r2.model import Transformer

log = logging.getLogger("m2r2.serve")

#: From this ``--max-batch`` on, ``--kernel auto`` serves with oneDNN bf16 on an AMX CPU without q4-amx
#: (module docstring).
MKLDNN_FROM_BATCH = 16


def serve_kernel(kernel: str, max_batch: int, dtype: str, device: str | None) -> str:
    """The ``--kernel`` to load for a server of ``max_batch`` concurrent requests: the user's choice,
    or for ``auto`` ``mkldnn`` where large batches are cheaper with it (bf16 on an AMX CPU where the
    q4-amx kernel does not run, at least :data:`MKLDNN_FROM_BATCH` requests), else ``auto`` (what
    :func:`m2r2.kernels.use_kernels` picks)."""
    if kernel != "auto" or max_batch < MKLDNN_FROM_BATCH or dtype != "bf16" or (device or default_device()) != "cpu":
        return kernel
    amx_gemm = torch.backends.mkldnn.is_available() and cpu_has("amx_bf16")
    return "mkldnn" if amx_gemm and not amx.amx_available() else kernel


class QueueFull(M2R2Error):
    """More requests wait for a batch slot than the server accepts; retry after ``retry_after`` s."""

    def __init__(self, waiting: int, retry_after: int) -> None:
        super().__init__(f"the server is busy: {waiting} requests are already waiting; retry in {retry_after} s")
        self.retry_after = retry_after


@dataclass
class Update:
    """What a job tells its client: new token ids, and at the end a summary or an error."""

    tokens: list[int] = field(default_factory=list)
    done: bool = False
    finish_reason: str | None = None  # Stopper's reason: eos, stop_string, max_new_tokens, context
    stats: dict[str, Any] | None = None
    error: Exception | None = None


@dataclass
class Job:
    """One request inside the scheduler. ``emit`` must be thread-safe (it is called from the loop thread)."""

    prompt: list[int]
    gen: GenerationConfig
    emit: Callable[[Update], None]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cancelled: bool = False
    finished: bool = False  # answered in full, or ended by an error
    # decoding state, set at admission
    stopper: Stopper | None = None
    cache: KVCache | None = None
    sampler: Sampler | None = None
    tok: int = 0  # newest token: emitted, not yet in the cache
    drafter: Any = None
    accept_rate: float = 0.5
    t0: float = 0.0
    rounds: int = 0  # speculative rounds
    accepted: int = 0
    batched_steps: int = 0
    tokens: list[int] = field(default_factory=list)

    def stats(self, method: str) -> dict[str, Any]:
        secs = time.perf_counter() - self.t0
        n = len(self.stopper.tokens) if self.stopper else 0
        return {
            "method": method,
            "mean_accepted": (self.accepted + self.rounds) / self.rounds if self.rounds else None,
            "speculative_rounds": self.rounds,
            "batched_steps": self.batched_steps,
            "seconds": secs,
            "tokens_per_s": n / secs if secs > 0 else 0.0,
        }


class Scheduler:
    """Admits jobs into a running batch and decodes them together in a background thread."""

    def __init__(self, engine: Engine, method: str = "auto", max_batch: int = 8, max_queue: int = 64) -> None:
        if max_batch < 1:
            raise SettingsError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 0:
            raise SettingsError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.model: Transformer = engine.model
        self.method = engine.resolve_method(method)
        self.spec: SelfSpeculative | TreeSpeculative | None = None
        if self.method != "vanilla":
            strategy = engine.strategy(self.method)
            if not isinstance(strategy, SelfSpeculative | TreeSpeculative):
                raise SettingsError(
                    f"the server decodes with vanilla or a self-speculative method (m2r2, early-exit-spec), "
                    f"not {self.method!r}"
                )
            self.spec = strategy
        self.max_batch, self.max_queue = max_batch, max_queue
        self.pool = self.model.new_pool(max_batch)
        self.eos, self.decode = engine.tokenizer.eos_ids, engine.tokenizer.decode
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []
        self.cond = threading.Condition()
        self.stopping = False
        self.counts = {
            "completed": 0,
            "cancelled": 0,
            "failed": 0,
            "batched_steps": 0,
            "speculative_rounds": 0,
            "peak_batch": 0,
        }
        self.recent_seconds: deque[float] = deque(maxlen=32)  # request durations, for Retry-After
        self.thread = threading.Thread(target=self._run, name="m2r2-scheduler", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ called from any thread

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.stopping:
                raise QueueFull(len(self.waiting), self.retry_after())
            if len(self.waiting) + len(self.active) >= self.max_batch + self.max_queue:
                raise QueueFull(len(self.waiting), self.retry_after())
            self.waiting.append(job)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """Mark ``job`` cancelled: it leaves the batch (and its cache is freed) at the next step."""
        with self.cond:
            job.cancelled = True
            self.cond.notify()

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: a recent request's duration, at least 1."""
        mean = sum(self.recent_seconds) / len(self.recent_seconds) if self.recent_seconds else 1.0
        return max(1, math.ceil(mean))

    def status(self) -> dict[str, Any]:
        with self.cond:
            return {
                "active": len(self.active),
                "waiting": len(self.waiting),
                "max_batch": self.max_batch,
                "max_queue": self.max_queue,
                "method": self.method,
                **self.counts,
            }

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=30)

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self.cond:
                    while not self.stopping and not self.waiting and not self.active:
                        self.cond.wait()
                    if self.stopping:
                        break
                    admit = []
                    while self.waiting and len(self.active) + len(admit) < self.max_batch:
                        job = self.waiting.popleft()
                        if job.cancelled:
                            self.counts["cancelled"] += 1
                        else:
                            admit.append(job)
                    self.active += admit  # counted as active (for admission) while they prefill
                    alone = not self.waiting
                for job in admit:
                    self._guard([job], self._start)
                with self.cond:
                    self.active = [j for j in self.active if self._keep(j)]
                    jobs = list(self.active)
                if not jobs:
                    continue
                if self.spec is not None and len(jobs) == 1 and alone:
                    self._guard(jobs, self._spec_round)
                else:
                    self._guard(jobs, self._batched_step)
            for job in [*self.waiting, *self.active]:
                job.emit(Update(done=True, error=M2R2Error("the server is shutting down")))

    def _keep(self, job: Job) -> bool:
        """False (and counted) for jobs that finished, failed or were cancelled: their cache is dropped."""
        if job.finished:
            return False
        if job.cancelled:
            self.counts["cancelled"] += 1
            self._release(job)
            return False
        return True

    def _release(self, job: Job) -> None:
        """Give the job's cache back to the pool (the last one of a capacity frees its memory)."""
        if job.cache is not None:
            self.pool.give(job.cache)
        job.cache = job.drafter = None

    def _guard(self, jobs: list[Job], step: Callable[..., None]) -> None:
        """Run ``step``; an unexpected failure ends these jobs with an error instead of the loop."""
        try:
            step(jobs)
        except Exception as e:  # the loop must survive anything one request does
            if not isinstance(e, M2R2Error):
                log.exception("decoding failed for %d request(s)", len(jobs))
            for job in jobs:
                self.counts["failed"] += 1
                job.emit(Update(done=True, error=e))
                job.finished = True
                self._release(job)

    def _start(self, jobs: list[Job]) -> None:
        """Prefill a job's prompt into a pooled cache (as every strategy does) and emit its first token."""
        (job,) = jobs

        def lend(capacity: int) -> KVCache:
            job.cache = self.pool.take(capacity)  # held by the job at once, so a failing prefill gives it back
            return job.cache

        hidden: list = []
        job.t0, job.stopper, _, logits = begin(self.model, job.prompt, job.gen, self.eos, self.decode, hidden, lend)
        job.sampler = Sampler(job.gen, self.model.device)
        if self.spec is not None:
            job.drafter = self.spec.make_drafter(job.cache)
            job.accept_rate = self.spec.prior_accept
            if hasattr(job.drafter, "h_last"):  # a tree drafter starts from the prompt's final slow state
                job.drafter.h_last = hidden[0]
                self.spec.prefilled(job.drafter, job.cache, hidden[1], job.prompt)  # type: ignore[union-attr]
            if hasattr(job.drafter, "observe"):  # a chain drafter (a draft model's own cache) sees the prompt
                job.drafter.observe(job.prompt)
        self._push(job, [job.sampler(logits[0, -1])])

    def _push(self, job: Job, new: list[int]) -> None:
        assert job.stopper is not None
        kept = job.stopper.push(new)
        job.tok = new[-1]
        if job.stopper.done:
            job.finished = True
            self.counts["completed"] += 1
            self.recent_seconds.append(time.perf_counter() - job.t0)
            job.emit(Update(new[:kept], True, job.stopper.reason, job.stats(self.method)))
            self._release(job)
        elif kept:
            job.emit(Update(new[:kept]))

    def _spec_round(self, jobs: list[Job]) -> None:
        (job,) = jobs
        assert self.spec is not None and job.cache is not None and job.stopper and job.sampler
        emitted, n, _, job.accept_rate = self.spec.round(
            job.drafter, job.cache, job.tok, job.stopper, job.accept_rate, job.gen, job.sampler
        )
        job.rounds += 1
        job.accepted += n
        self.counts["speculative_rounds"] += 1
        self._push(job, emitted)

    def _batched_step(self, jobs: list[Job]) -> None:
        model = self.model
        caches = [j.cache for j in jobs]
        tokens = [j.tok for j in jobs]
        # all greedy: one C++ call for the step and the argmax where the kernel has it (each row a lone step's bits)
        fused = model.greedy_steps(tokens, caches) if all(j.gen.greedy for j in jobs) else None  # type: ignore[arg-type]
        if fused is not None:
            greedy_ids, hidden = fused
        else:
            hidden = model.step_rows(tokens, caches)  # type: ignore[arg-type]
            # greedy rows: each row's lone-step argmax at one head's cost; sampled rows: their one-row logits
            greedy_ids = head_argmax(model, hidden[:, 0]).tolist() if any(j.gen.greedy for j in jobs) else []
        self.counts["batched_steps"] += 1
        self.counts["peak_batch"] = max(self.counts["peak_batch"], len(jobs))
        for b, job in enumerate(jobs):
            job.batched_steps += 1
            if hasattr(job.drafter, "h_last"):  # keep a tree drafter's seed (and memory) current across batched steps
                self.spec.stepped(job.drafter, job.cache, job.tok, hidden[b : b + 1])  # type: ignore[union-attr]
            if hasattr(job.drafter, "observe"):  # and a draft model's context
                job.drafter.observe([job.tok])
            assert job.sampler is not None
            tok = greedy_ids[b] if job.gen.greedy else job.sampler(model.head(hidden[b : b + 1])[0, 0])
            self._push(job, [tok])
