"""The loader thread: copies experts from slow memory (:class:`ExpertStore`) into the cache while compute runs.

Requests sit in a priority queue ordered by need time (``step * num_layers + layer``): a demand
(the layer being computed waits for it) always goes before prefetches, and nearer prefetches before
farther ones. A prefetch whose layer has already passed is cancelled; one for which the cache has
no slot it may take is dropped (see :mod:`m2r2.moe.cache`).

Timing. The read itself is real I/O (``os.preadv`` from the expert file; on a GPU then a
pinned-host -> device copy on a side stream). With a modelled ``bandwidth`` (bytes/s) the copy
takes ``max(measured read time, bytes / bandwidth)``, and the modelled link is serial: a copy
starts when the previous one ended. Rather than sleeping after each copy (``time.sleep`` overshoots
by ~0.1 ms, more than a whole 300 kB copy at 25 GB/s), each expert gets a *ready time* and the
compute thread that needs it waits until then; the loader only sleeps when it runs more than
``RUN_AHEAD_S`` ahead of the modelled link. :class:`LoaderStats` keeps the measured and the
modelled seconds apart.

Shutdown: use as a context manager. Any exception in the thread is stored and re-raised in the
thread that waits for an expert (and at exit); leaving the ``with`` block (normally, on an error or
on KeyboardInterrupt) stops the thread and joins it with a timeout.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from m2r2.errors import M2R2Error
from m2r2.moe.cache import ExpertCache, Key
from m2r2.moe.store import ExpertStore

#: How far (seconds) the loader may run ahead of the modelled link before it sleeps.
RUN_AHEAD_S = 2e-3
JOIN_TIMEOUT_S = 10.0


@dataclass
class LoaderStats:
    loads: int = 0
    bytes: int = 0
    read_s: float = 0.0  # measured: wall time of the real reads (and device copies)
    modelled_s: float = 0.0  # modelled: bytes / bandwidth summed over copies (0 without a bandwidth)
    link_busy_s: float = 0.0  # what the copies took: max(measured, modelled) per copy
    cancelled: int = 0  # prefetches whose layer had passed before their turn
    dropped: int = 0  # prefetches with no slot they were allowed to take

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Loader:
    """One background thread serving copy requests for one :class:`ExpertCache`."""

    def __init__(self, store: ExpertStore, cache: ExpertCache, bandwidth: float | None = None) -> None:
        if bandwidth is not None and bandwidth <= 0:
            raise M2R2Error(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
        if (store.w13_shape, store.w2_shape) != (tuple(cache.w13.shape[1:]), tuple(cache.w2.shape[1:])):
            raise M2R2Error("the expert cache's slots do not match the store's expert shapes")
        self.store, self.cache, self.bandwidth = store, cache, bandwidth
        self.cond = cache.cond
        self.heap: list[tuple[int, int, Key]] = []
        self.queued: dict[Key, int] = {}  # key -> need time of its live heap entry
        self.seq = itertools.count()
        self.stats = LoaderStats()
        self.error: BaseException | None = None
        self.stopping = False
        self.link_free = 0.0  # perf_counter time at which the modelled link is free
        self.thread = threading.Thread(target=self._run, name="m2r2-expert-loader", daemon=True)
        self.device_copy = cache.device.type != "cpu"
        if self.device_copy:  # pinned staging buffers + a side stream (untested on this CPU-only machine)
            self.stage13 = torch.empty(store.w13_shape, dtype=store.dtype).pin_memory()
            self.stage2 = torch.empty(store.w2_shape, dtype=store.dtype).pin_memory()
            self.side = torch.cuda.Stream(device=cache.device)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Loader:
        self.thread.start()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()
        if exc_type is None:
            self.check()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(JOIN_TIMEOUT_S)
        if self.thread.is_alive():
            raise M2R2Error(f"the expert loader thread did not stop within {JOIN_TIMEOUT_S:.0f} s")

    def check(self) -> None:
        """Re-raise an error of the loader thread in the caller."""
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------------ requests (caller holds cond)

    def request(self, key: Key, need: int) -> None:
        """Ask for ``key`` by need time ``need`` (re-asking sooner raises its priority)."""
        if key in self.cache:
            return
        old = self.queued.get(key)
        if old is not None and old <= need:
            return
        self.queued[key] = need
        heapq.heappush(self.heap, (need, next(self.seq), key))
        self.cond.notify_all()

    def pending(self, key: Key) -> bool:
        return key in self.queued

    # ------------------------------------------------------------------ the thread

    def _next(self) -> tuple[Key, int] | None:
        """Pop the most urgent live request and reserve its slot (with cond held); None = stop."""
        cache = self.cache
        while True:
            while not self.heap and not self.stopping:
                self.cond.wait(0.1)
            if self.stopping:
                return None
            need, _, key = heapq.heappop(self.heap)
            if self.queued.get(key) != need:
                continue  # superseded by a more urgent request for the same expert
            del self.queued[key]
            if key in cache:
                continue
            demand = cache.pins.get(key, 0) > 0
            if not demand and need <= cache.now:
                self.stats.cancelled += 1
                continue
            slot = cache.reserve(key, None if demand else need)
            while slot is None and demand and not self.stopping:
                # every slot is pinned or in flight: wait for the compute thread to release one
                self.cond.wait(0.01)
                slot = cache.reserve(key, None)
            if slot is None:
                if self.stopping:
                    return None
                self.stats.dropped += 1
                continue
            return key, slot

    def _copy(self, key: Key, slot: int) -> int:
        w13, w2 = self.cache.w13[slot], self.cache.w2[slot]
        if not self.device_copy:
            return self.store.read_into(key, w13, w2)
        n = self.store.read_into(key, self.stage13, self.stage2)
        with torch.cuda.stream(self.side):
            w13.copy_(self.stage13, non_blocking=True)
            w2.copy_(self.stage2, non_blocking=True)
        self.side.synchronize()
        return n

    def _run(self) -> None:
        key: Key | None = None
        try:
            while True:
                with self.cond:
                    nxt = self._next()
                if nxt is None:
                    return
                key, slot = nxt
                t0 = time.perf_counter()
                nbytes = self._copy(key, slot)
                t1 = time.perf_counter()
                modelled = nbytes / self.bandwidth if self.bandwidth else 0.0
                start = max(t0, self.link_free)
                ready = max(t1, start + modelled)
                self.link_free = ready
                with self.cond:
                    self.cache.complete(key, ready)
                    s = self.stats
                    s.loads += 1
                    s.bytes += nbytes
                    s.read_s += t1 - t0
                    s.modelled_s += modelled
                    s.link_busy_s += max(t1 - t0, modelled)
                key = None
                with self.cond:  # stay at most RUN_AHEAD_S ahead of the modelled link (wakes on close)
                    while not self.stopping and (ahead := self.link_free - time.perf_counter()) > RUN_AHEAD_S:
                        self.cond.wait(ahead - RUN_AHEAD_S / 2)
        except BaseException as e:
            with self.cond:
                if key is not None:
                    self.cache.abort(key)
                self.error = e
                self.cond.notify_all()
