"""Fast memory: a bounded cache of expert slots with pins, LRU and prediction-aware eviction.

The cache owns ``capacity`` preallocated slots (one ``w13`` and one ``w2`` tensor each, in the
model's dtype on the compute device), so its memory never grows: loading an expert means choosing
a slot, evicting whatever lived there. One :class:`threading.Condition` guards all state and is
shared with the loader thread; every method below must be called with ``cache.cond`` held.

Eviction rule (the same for every policy; only the predictions differ):

1. never a pinned expert (in use by the layer being computed, or awaited by it) nor one whose
   copy has not finished;
2. first the least recently used expert that no pending prediction claims (plain LRU, which is
   all that ``on-demand`` ever sees; a prefetched expert counts as used only once the slow stream
   uses it, see :meth:`ExpertCache.complete`);
3. then, for a demand load only, or for a prefetch needed *sooner* than the victim, the
   predicted expert whose predicted use is the latest (Belady's rule on the predicted future);
4. otherwise nothing: a prefetch is dropped rather than evict an expert needed no later than it.

A prediction claims an expert until the slow stream reaches the predicted layer ("need time",
``step * num_layers + layer``); after that it is stale and the expert is LRU-ranked again.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict

import torch
from torch import Tensor

from m2r2.errors import SettingsError

Key = tuple[int, int]  # (layer, expert)


class ExpertCache:
    """``capacity`` expert slots; see the module docstring for the eviction rule."""

    def __init__(
        self,
        capacity: int,
        w13_shape: tuple[int, ...],
        w2_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if capacity < 1:
            raise SettingsError(f"the expert cache needs a capacity >= 1, got {capacity}")
        self.capacity = capacity
        self.device = torch.device(device)
        self.w13 = torch.empty((capacity, *w13_shape), dtype=dtype, device=self.device)
        self.w2 = torch.empty((capacity, *w2_shape), dtype=dtype, device=self.device)
        self.cond = threading.Condition()
        self.reset()

    def reset(self) -> None:
        """Empty the cache (a cold start); the slots' memory is kept."""
        self.slot_of: dict[Key, int] = {}  # resident or being copied
        self.ready_at: dict[Key, float] = {}  # copied; usable from this perf_counter() time on
        self.free = list(range(self.capacity - 1, -1, -1))
        self.lru: OrderedDict[Key, None] = OrderedDict()  # ready experts, least recently used first
        self.pins: Counter[Key] = Counter()
        self.need: dict[Key, int] = {}  # predicted need time of experts (resident or not)
        self.now = -1  # need time of the layer the slow stream is at
        self.evictions = 0
        self.max_resident = 0

    # ------------------------------------------------------------------ queries

    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def is_ready(self, key: Key, at: float | None = None) -> bool:
        """Copied and usable (at time ``at``; default: already finished, whatever the time)."""
        t = self.ready_at.get(key)
        return t is not None and (at is None or t <= at)

    def weights(self, key: Key) -> tuple[Tensor, Tensor]:
        slot = self.slot_of[key]
        return self.w13[slot], self.w2[slot]

    def resident(self) -> list[Key]:
        return list(self.lru)

    def claimed(self, key: Key) -> int | None:
        """The pending predicted need time of ``key`` (None if no prediction claims it)."""
        t = self.need.get(key)
        return t if t is not None and t > self.now else None

    # ------------------------------------------------------------------ updates

    def touch(self, key: Key) -> None:
        if key in self.lru:
            self.lru.move_to_end(key)

    def pin(self, key: Key) -> None:
        self.pins[key] += 1

    def unpin(self, key: Key) -> None:
        self.pins[key] -= 1
        if self.pins[key] <= 0:
            del self.pins[key]
        self.cond.notify_all()  # a demand load may be waiting for an evictable slot

    def predict(self, key: Key, need: int) -> None:
        """Claim ``key`` for need time ``need`` (the earliest pending claim wins)."""
        old = self.claimed(key)
        if old is None or need < old:
            self.need[key] = need

    def used(self, key: Key) -> None:
        """The slow stream used ``key`` now: its prediction is fulfilled."""
        self.need.pop(key, None)
        self.touch(key)

    def victim(self, need: int | None) -> Key | None:
        """The expert to evict for a copy needed at ``need`` (None = a demand load); None if none may go."""
        t = time.perf_counter()
        latest: tuple[int, Key] | None = None
        for key in self.lru:  # oldest first
            if self.pins.get(key) or self.ready_at[key] > t:
                continue
            claim = self.claimed(key)
            if claim is None:
                return key
            if (need is None or claim > need) and (latest is None or claim > latest[0]):
                latest = (claim, key)
        return None if latest is None else latest[1]

    def reserve(self, key: Key, need: int | None) -> int | None:
        """A slot for copying ``key`` in, evicting per the rule; None if no slot may be taken."""
        assert key not in self.slot_of, f"expert {key} is already resident or being copied"
        if self.free:
            slot = self.free.pop()
        else:
            out = self.victim(need)
            if out is None:
                return None
            slot = self.slot_of.pop(out)
            del self.ready_at[out]
            del self.lru[out]
            self.need.pop(out, None)
            self.evictions += 1
        self.slot_of[key] = slot
        self.max_resident = max(self.max_resident, len(self.slot_of))
        assert len(self.slot_of) + len(self.free) == self.capacity <= self.w13.shape[0], "expert cache overflow"
        return slot

    def complete(self, key: Key, ready_at: float) -> None:
        """The copy of ``key`` is done (usable from ``ready_at``, a perf_counter time).

        A demand copy (pinned) becomes the most recently used; a prefetch goes to the LRU *front*:
        its prediction protects it until its layer, and if that passes without a use it is the
        first to go. (At the back, wrong prefetches would look recently used and push useful
        experts out: with the cyclic layer-by-layer access of decoding that tips LRU over its
        cliff as soon as the cache is a little smaller than the working set.)
        """
        self.ready_at[key] = ready_at
        self.lru[key] = None
        if not self.pins.get(key):
            self.lru.move_to_end(key, last=False)
        self.cond.notify_all()

    def abort(self, key: Key) -> None:
        """Give back the slot of a copy that failed."""
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.ready_at.pop(key, None)
            self.lru.pop(key, None)
            self.free.append(slot)
        self.cond.notify_all()
