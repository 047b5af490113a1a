"""Preallocated KV cache with multi-token append and rollback, and a pool of them for serving.

One tensor per K and V for all layers, ``[layers, batch, kv_heads, max_len, head_dim]``, allocated
once per generation. Appending k tokens is a slice copy; rolling back after a rejected draft is
just lowering ``length`` (stale entries past it are never read and are overwritten by the next
append), which is what makes speculative decoding cheap.

A server decodes many sequences at once: :class:`KVPool` lends each one a batch item of a shared
cache per capacity, and :class:`CacheRows` gives a batched decoding step every layer's keys and
values of several such sequences as one tensor, so one attention call serves them all.
"""

from __future__ import annotations

import torch

from m2r2.config import ModelConfig
from m2r2.errors import InputError


class KVCache:
    """Keys and values of every verified position, for every layer.

    ``store`` is the dtype they are kept in (default ``dtype``, what :meth:`view` returns). A float32
    store for a low-precision model holds the same values exactly: attention over a few query rows
    computes in float32 on a CPU (``model._row_math``), and a batched step over several sequences
    then reads their caches as they are instead of converting them all every step (BENCHMARKS.md,
    "Serving"), at twice the memory.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        max_len: int,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        zero: bool = True,
        store: torch.dtype | None = None,
    ) -> None:
        if max_len <= 0:
            raise InputError(f"KV cache length must be positive, got {max_len}")
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        new = torch.zeros if zero else torch.empty
        self.k = new(shape, dtype=store or dtype, device=device)
        self.v = new(shape, dtype=store or dtype, device=device)
        self.dtype = dtype
        self.max_len = max_len
        self.length = 0
        #: the cache whose batch item ``item`` this one is, when lent by a :class:`KVPool` (else None)
        self.base: KVCache | None = None
        self.item = 0

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[batch, kv_heads, T, head_dim]``) at positions ``pos .. pos+T-1``."""
        end = pos + k.shape[2]
        if end > self.max_len:
            raise InputError(f"KV cache overflow: position {end} > capacity {self.max_len}")
        self.k[layer, :, :, pos:end] = k
        self.v[layer, :, :, pos:end] = v

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0 .. end-1`` at ``layer`` (views, no copy, unless stored in
        another dtype)."""
        k, v = self.k[layer, :, :, :end], self.v[layer, :, :, :end]
        return (k, v) if k.dtype == self.dtype else (k.to(self.dtype), v.to(self.dtype))

    def truncate(self, length: int) -> None:
        """Roll back to ``length`` verified positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def keep(self, slots: list[int], dst: int) -> None:
        """Move the entries at cache ``slots`` (ascending) to ``dst, dst+1, ...``; length = dst + n.

        Tree and lookahead verification write every candidate's K/V side by side; the accepted
        path is then compacted to follow the verified prefix without recomputing anything.
        """
        n = len(slots)
        if slots != list(range(dst, dst + n)):
            idx = torch.tensor(slots, device=self.k.device)
            self.k[:, :, :, dst : dst + n] = self.k.index_select(3, idx)
            self.v[:, :, :, dst : dst + n] = self.v.index_select(3, idx)
        self.length = dst + n

    def take_prefix(self, src: KVCache, n: int) -> None:
        """Copy ``src``'s first ``n`` positions (every layer) into this cache; length = n."""
        if not 0 <= n <= min(src.max_len, self.max_len) or src.batch != self.batch:
            raise ValueError(f"cannot take {n} positions of a cache of {src.max_len} into one of {self.max_len}")
        self.k[:, :, :, :n] = src.k[:, :, :, :n]
        self.v[:, :, :, :n] = src.v[:, :, :, :n]
        self.length = n

    def lend(self, item: int) -> KVCache:
        """A one-sequence cache over batch item ``item`` of this one (views: writes land here)."""
        c = object.__new__(KVCache)
        c.dtype, c.max_len, c.length, c.base = self.dtype, self.max_len, 0, self
        c.point(item)
        return c

    def point(self, item: int) -> None:
        """Make this lent cache batch item ``item`` of its base."""
        assert self.base is not None
        self.item = item
        self.k, self.v = self.base.k[:, item : item + 1], self.base.v[:, item : item + 1]


class KVPool:
    """Caches for up to ``items`` concurrent sequences per capacity, lent out and given back.

    Why: a batched decoding step over several sequences (``Transformer.step_rows``) attends over
    all their caches in one call when their keys form one tensor. Sequences of one capacity (a size
    class, see ``decoding.base.cache_capacity``) therefore live in batch items ``0..n-1`` of one
    shared cache: when one leaves, the last one moves into its place (one copy per departure, not
    per step), so the n items in use stay a contiguous view. A capacity's memory is allocated when
    its first sequence arrives and freed when its last one leaves; a lent item is zeroed, so it
    starts exactly like a fresh :class:`KVCache`. ``store``: see :class:`KVCache`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        items: int,
        dtype: torch.dtype,
        device: torch.device | str,
        store: torch.dtype | None = None,
    ) -> None:
        self.cfg, self.items, self.dtype, self.device, self.store = cfg, items, dtype, device, store
        self.lent: dict[int, list[KVCache]] = {}  # capacity -> lent caches, by batch item

    def take(self, max_len: int) -> KVCache:
        lent = self.lent.setdefault(max_len, [])
        if len(lent) >= self.items:
            raise InputError(f"all {self.items} caches of capacity {max_len} are lent out")
        if lent:
            cache = lent[0].base.lend(len(lent))  # type: ignore[union-attr]
        else:  # items are zeroed when lent: pages of items never lent are never touched
            base = KVCache(self.cfg, max_len, self.items, self.dtype, self.device, zero=False, store=self.store)
            cache = base.lend(0)
        cache.k.zero_()
        cache.v.zero_()
        lent.append(cache)
        return cache

    def give(self, cache: KVCache) -> None:
        lent = self.lent.get(cache.max_len, [])
        if cache.item >= len(lent) or lent[cache.item] is not cache:
            raise ValueError("this cache is not lent by this pool")
        last = lent.pop()
        if last is not cache:  # keep the items in use contiguous: the last one moves into the gap
            old_k, old_v = last.k, last.v
            last.point(cache.item)
            last.k.copy_(old_k)
            last.v.copy_(old_v)
            lent[cache.item] = last
        if not lent:
            del self.lent[cache.max_len]  # the last reference to the base: its memory is freed

    def __len__(self) -> int:
        return sum(len(lent) for lent in self.lent.values())


class CacheRows:
    """One new token per sequence for a batched decoding step over caches of one capacity.

    :meth:`append` writes every sequence's keys and values of a layer at its own length and returns
    the layer's whole caches as ``[B, kv_heads, max_len, head_dim]`` in their store's dtype: a view
    where the caches are consecutive items of one base (what :class:`KVPool` keeps them; a lone cache
    is too), else a stacked copy (measured in BENCHMARKS.md, "Serving").
    """

    def __init__(self, caches: list[KVCache]) -> None:
        first = caches[0]
        if any(c.batch != 1 or c.max_len != first.max_len for c in caches):
            raise ValueError("batched steps need one-sequence caches of one capacity")
        if any(c.length >= c.max_len for c in caches):
            raise InputError(f"KV cache overflow: capacity {first.max_len} is full")
        self.caches = caches
        self.k: torch.Tensor | None = None  # [layers, B, kv_heads, max_len, head_dim] views, where one base
        self.v: torch.Tensor | None = None
        base = first.base or first
        if all((c.base or c) is base and c.item == first.item + i for i, c in enumerate(caches)):
            items = slice(first.item, first.item + len(caches))
            self.k, self.v = base.k[:, items], base.v[:, items]
            self.batch = torch.arange(len(caches), device=first.k.device)
            self.pos = torch.tensor([c.length for c in caches], device=first.k.device)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write row b of ``k``/``v`` (``[B, kv_heads, 1, head_dim]``) at ``caches[b].length``; the layer's K, V."""
        if self.k is None or self.v is None:
            for b, c in enumerate(self.caches):
                c.write(layer, c.length, k[b : b + 1], v[b : b + 1])
            return torch.cat([c.k[layer] for c in self.caches]), torch.cat([c.v[layer] for c in self.caches])
        self.k[layer, self.batch, :, self.pos] = k[:, :, 0].to(self.k.dtype)
        self.v[layer, self.batch, :, self.pos] = v[:, :, 0].to(self.v.dtype)
        return self.k[layer], self.v[layer]


class Conversation:
    """What one conversation carries from a turn to the next: the KV cache of the tokens it has seen.

    A chat's next prompt repeats the whole history (prompt, answer, new user message), and a CPU
    prefills ~2-3 ms a token (SmolLM2, one Zen 3 core): 196 of a second MT-Bench turn's 242 prompt tokens
    had run before, ~0.35 s a conversation (``experiments/turn_reuse.py``, ``second_turns.py``).
    :func:`m2r2.decoding.base.begin` copies the reusable prefix from here and prefills only the rest.
    What is reusable is one rule for every method, so that their outputs stay bit-identical to each
    other: the positions every method has verified (the prompt and every new token but the last, whose
    K/V no method has computed yet), one short of the common prefix with the new prompt (a drafter's
    memory of (state, next token) pairs, EAGLE's, then holds only pairs whose next token is still right),
    and never the new prompt's last token (its logits are needed).
    """

    def __init__(self) -> None:
        self.cache: KVCache | None = None
        self.owner: object | None = None  # the model that computed ``cache`` (another model's K/V are not reused)
        self.reused = 0  # prompt positions the last turn took from here
        self._prompt: list[int] = []
        self._emitted: list[int] = []  # the last turn's new tokens (its stopper's list, read when needed)

    @property
    def tokens(self) -> list[int]:
        """The tokens at positions 0.. of :attr:`cache` that every method has verified."""
        return self._prompt + self._emitted[:-1]

    def reusable(self, prompt: list[int], owner: object) -> int:
        """Positions of ``prompt`` whose K/V this conversation already holds for the model ``owner``."""
        held = self.tokens
        if self.cache is None or self.owner is not owner or self.cache.length < len(held):
            return 0  # nothing held, another model's, or a cache rolled back under its tokens
        n = 0
        for a, b in zip(held, prompt, strict=False):
            if a != b:
                break
            n += 1
        return max(0, min(n - 1, len(prompt) - 1))

    def started(self, cache: KVCache, prompt: list[int], reused: int, emitted: list[int], owner: object) -> None:
        """A turn of the model ``owner`` over ``prompt`` prefilled ``cache`` (``reused`` positions taken
        from here); ``emitted`` is the list its new tokens are appended to. A method that ignores the
        conversation never calls this, and the earlier cache stays what it was."""
        self.cache, self._prompt, self.reused, self._emitted = cache, list(prompt), reused, emitted
        self.owner = owner

    def reset(self) -> None:
        self.cache, self.owner, self.reused, self._prompt, self._emitted = None, None, 0, [], []
