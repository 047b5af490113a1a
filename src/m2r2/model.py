"""A compact Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a preallocated KV cache.

Written in the style of gpt-fast: fused q/k/v and gate/up projections (fewer, larger matmuls are
what a memory-bound CPU or GPU decode step wants), RoPE tables computed once, and a forward that
takes any number of new tokens at any cache position, which is what prefill, decoding and
multi-token verification all need.

Each block exposes its pieces (:meth:`Attention.qkv`, :func:`attend`, :meth:`Attention.out`,
:meth:`MLP.forward`) and accepts low-rank deltas through ``lora`` so that the multi-rate fast
stream (``m2r2.multirate``) can reuse the same weights and code without this file knowing about it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m2r2 import amx
from m2r2.cache import CacheRows, KVCache, KVPool
from m2r2.config import ModelConfig, rope_inv_freq

#: Optional low-rank deltas keyed by projection name ("qkv", "o", "gate_up", "down"): each maps
#: the projection's input to a delta added to its output.
Lora = Mapping[str, Callable[[Tensor], Tensor]]


class Structure:
    """A count of the assignments of modules, parameters and tensors onto the model's own modules (a kernel swap,
    folded adapters, a replaced block or norm weight): what :meth:`Transformer.fused_stack` checks its kept stack
    against. Why: checking every block's modules by identity took ~85 us a pass on a 30-block model (3% of a
    one-token step on a fast 2-vCPU Xeon); an unchanged count means nothing a fused block reads was reassigned."""

    version = 0


class Tracked(nn.Module):
    """A module whose assignments of modules, parameters and tensors move :class:`Structure`'s count."""

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if isinstance(value, nn.Module | Tensor):  # counted once it is in place: a check that sees the count sees it
            Structure.version += 1

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        Structure.version += 1


class Blocks(Tracked, nn.ModuleList):
    """The model's blocks: a :class:`nn.ModuleList` whose item assignments move :class:`Structure`'s count."""


class RMSNorm(Tracked):
    """Root-mean-square norm computed in float32 and cast back before the weight, as HF Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:  # reference mode: HF's exact order of operations
            return self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)
        if (
            x.dtype == torch.bfloat16
            and self.weight.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
            and (ext := amx.row_helpers()) is not None
        ):  # inference on a CPU: one C++ call (csrc/rms_norm.cpp), ~16 us less than torch's per call
            return ext.rms_norm(x.contiguous(), self.weight, self.eps)
        # low precision: one fused kernel (it accumulates in float32 internally)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (``[B, H, T, D]``) by position tables ``cos`` and sign-folded ``sin`` (``[T, D]``).

    ``sin`` carries the minus sign of rotate-half in its first half, so the rotation is
    ``x * cos + roll(x, D/2) * sin``: the same numbers as the textbook form with fewer ops.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


#: Up to this many query rows, attention runs each row as its own batch item (see :func:`attend`).
ROW_INVARIANT_MAX_ROWS = 32


class GappedMask:
    """A verification mask whose rows see cache slots with gaps between them, left-packed per row.

    Lookahead (and tree) verification writes each candidate branch at slots after the others, so
    a branch row sees the verified prefix, a gap, then its own branch. The attention kernel's
    reductions depend on where the keys sit, so such a row would not get the bits a decoding step
    at the same position gets (measured: 1 in ~10 branches of SmolLM2 / Qwen2.5 rows differed, and
    lookahead's output drifted from plain greedy). :func:`attend` therefore shows each row its
    visible keys moved to the front, in slot order: exactly the layout decoding sees.

    Rows are grouped so that one gathered copy of the keys serves a whole branch (a row's visible
    slots, in order, are the first ones of its group's order); rows that already see a prefix of
    the cache (the Jacobi window, a plain verify block) need no copy at all.
    """

    def __init__(self, mask: Tensor, packed: Tensor) -> None:
        t = mask.shape[0]
        self.mask = mask  # [t, s]: what the C++ row attention reads instead (:func:`row_kernel`)
        self.shape = mask.shape  # [t, s], like the mask it stands for
        self.packed = packed  # [t, s]: each row's visible slots moved to the front
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)  # visible slots first
        plain = (mask == packed).all(-1).tolist()
        counts = packed.sum(-1).tolist()
        reps: list[int] = []  # one representative row (the longest) per gathered layout
        members: dict[int | None, list[int]] = {None: []}
        for i in sorted(range(t), key=lambda r: -counts[r]):
            if plain[i]:
                members[None].append(i)
                continue
            c = counts[i]
            rep = next((r for r in reps if torch.equal(order[r, :c], order[i, :c])), None)
            if rep is None:
                reps.append(i)
                members[i] = []
                rep = i
            members[rep].append(i)
        #: (rows, slot order of their keys or None for the cache as it is, their left-packed masks)
        self.groups: list[tuple[Tensor, Tensor | None, Tensor]] = []
        for rep, rows in members.items():
            if rows:
                idx = torch.tensor(sorted(rows), device=mask.device)
                self.groups.append((idx, None if rep is None else order[rep], packed[idx]))
        perm = torch.cat([rows for rows, _, _ in self.groups])
        self.inverse = torch.argsort(perm)  # concatenated group outputs -> original row order

    @classmethod
    def over(cls, mask: Tensor) -> Tensor | GappedMask:
        """``mask`` itself when every row sees a prefix ``0..n-1`` of the cache, else its :class:`GappedMask`."""
        packed = torch.arange(mask.shape[-1], device=mask.device) < mask.sum(-1, keepdim=True)
        return mask if torch.equal(mask, packed) else cls(mask, packed)


def _one_row_each(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, gqa: bool) -> Tensor:
    """Attention with every query row of ``q`` (``[B, H, T, D]``) as its own batch item; ``[B, T, H, D]``."""
    b, h, t, d = q.shape
    s = k.shape[2]
    qf = q.transpose(1, 2).reshape(b * t, h, 1, d)
    kf = k.unsqueeze(1).expand(b, t, *k.shape[1:]).reshape(b * t, *k.shape[1:])
    vf = v.unsqueeze(1).expand(b, t, *v.shape[1:]).reshape(b * t, *v.shape[1:])
    mf = mask.expand(b, t, s).reshape(b * t, 1, 1, s) if mask.dim() <= 3 else mask.reshape(b * t, 1, 1, s)
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mf, enable_gqa=gqa)
    return out.reshape(b, t, h, d)


#: Fewest keys for which :func:`_row_math` stacks rows (see :func:`_stacked_rows_exact`).
STACKED_MIN_KEYS = 16


@functools.cache
def _stacked_rows_exact(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, threads: int) -> bool:
    """Whether :func:`_row_math` with rows stacked gives every row of a 2..:data:`ROW_INVARIANT_MAX_ROWS`-row
    pass the bits of a one-row call on this machine, probed once per head shape (and thread count) on random inputs.

    Measured: on an AMX Xeon SmolLM2's heads (9 query heads over 3 key heads) stack exactly, from
    :data:`STACKED_MIN_KEYS` keys on (with 1-2 keys the bits changed), while a tiny 4-over-2-head
    model did not; a CPU without AVX-512 bf16 changed bits. BLAS picks its blocking by shape, not by
    values, so a probe over row counts and key lengths decides; where it fails rows run one by one.
    """
    gen = torch.Generator().manual_seed(0)
    gqa = kv_heads != heads
    for s in (STACKED_MIN_KEYS, 37, 200, 1025):
        k = torch.randn(1, kv_heads, s, head_dim, generator=gen).to(dtype)
        v = torch.randn(1, kv_heads, s, head_dim, generator=gen).to(dtype)
        for t in range(2, min(s - 3, ROW_INVARIANT_MAX_ROWS) + 1):
            q = torch.randn(1, heads, t, head_dim, generator=gen).to(dtype)
            mask = torch.arange(s)[None, :] <= torch.arange(s - t - 3, s - 3)[:, None]
            whole = _row_math(q, k, v, mask, gqa, stack=True)
            if not torch.equal(whole, _row_math(q, k, v, mask, gqa, stack=False)):
                return False
    return True


def _row_math(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, gqa: bool, stack: bool | None = None) -> Tensor:
    """Attention of query rows ``q`` (``[B, H, T, D]``) in two float32 matmuls, each row getting the
    bits a one-row decoding step gets; ``[B, T, H, D]``. ``mask`` is ``[T, S]`` or ``[B, T, S]``.

    Why: on a CPU the fused SDPA kernel costs ~0.3 ms per query row per layer in bf16 (a third of a
    SmolLM2 decoding step) for ~0.2 MFLOP of work; two float32 matmuls over the keys cost ~0.02 ms.
    A row's query heads form a ``g``-row block of the matmul per key head; the T rows' blocks are
    stacked into one matmul (``stack``; by default where :func:`_stacked_rows_exact` finds that
    changes no bits: a k-row verify pass then costs one call per layer, not k), else each row runs
    alone.
    """
    b, h, t, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh if gqa else 1
    if t > 1 and stack is None:
        stack = s >= STACKED_MIN_KEYS and _stacked_rows_exact(h, kvh, d, q.dtype, torch.get_num_threads())
    if t > 1 and not stack:
        rows = [mask[..., i : i + 1, :] if mask.dim() > 2 else mask[i : i + 1] for i in range(t)]
        return torch.cat([_row_math(q[:, :, i : i + 1], k, v, rows[i], gqa) for i in range(t)], dim=1)
    qf = q.float().reshape(b, kvh, g, t, d).transpose(2, 3).reshape(b, kvh, t * g, d)
    scores = torch.matmul(qf, k.float().transpose(-1, -2)).mul_(d**-0.5).view(b, kvh, t, g, s)
    keep = mask.reshape(-1, 1, t, 1, s)
    p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).view(b, kvh, t * g, s)
    out = torch.matmul(p, v.float()).view(b, kvh, t, g, d)
    return out.permute(0, 2, 1, 3, 4).reshape(b, t, h, d).to(q.dtype)


def attends_in_float32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether passes of a few query rows attend through :func:`_row_math` (float32 matmuls): for
    low-precision tensors on a CPU. It may then be given float32 keys and values (a float32-stored
    ``KVCache``) with the same bits as a result."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def _few_rows(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, gqa: bool) -> Tensor:
    """Row-invariant attention for up to :data:`ROW_INVARIANT_MAX_ROWS` rows, ``[B, T, H, D]``:
    :func:`_row_math` for low-precision CPU tensors (faster there), else the fused kernel with every
    row as its own batch item (float32 keeps the kernel transformers uses, so the reference mode
    matches it exactly)."""
    if attends_in_float32(q.dtype, q.device):
        return _row_math(q, k, v, mask, gqa)
    return _one_row_each(q, k, v, mask, gqa)


def row_kernel(dtype: torch.dtype, device: torch.device) -> ModuleType | None:
    """The C++ row attention (``csrc/row_attention.cpp``) where passes of a few rows use it: for
    low-precision CPU tensors, where the extension builds (:mod:`m2r2.amx`). Its bits for a row do not
    depend on where the row's keys sit, so a tree pass needs no :class:`GappedMask` gathers."""
    return amx.row_helpers() if attends_in_float32(dtype, device) else None


#: key/value dtypes the C++ row attention reads in place (a bfloat16 cache is widened exactly as it is read)
_ROW_KEY_DTYPES = (torch.float32, torch.bfloat16)


def _dense32(x: Tensor) -> Tensor:
    return x.float().contiguous()


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | GappedMask | None) -> Tensor:
    """Scaled dot-product attention with grouped-query heads; ``mask`` is boolean (True = attend).

    A pass over a few rows (a speculative verify block, a lookahead step) must give each row the
    bits a one-token decoding step would give it, or greedy speculative decoding stops being
    lossless: the fused kernel's inner products differ in their last bits between 1 and k query
    rows. So up to :data:`ROW_INVARIANT_MAX_ROWS` rows are folded into the batch dimension and
    every row runs the same one-row kernel as decoding (keys are broadcast, not copied, for one
    sequence; a :class:`GappedMask` gathers each row's keys as decoding lays them out). Where the
    C++ row attention runs (:func:`row_kernel`: low-precision CPU tensors) it does this by
    construction, with no gathers and one call per layer, the rows of a pass sharing the loads of their
    common prefix: measured on SmolLM2 (9 query heads, 300 keys of a bfloat16 cache, read in place; 1
    thread, ``experiments/amx_micro.py``) ~20 us for one row and ~85 us for 8 against 127 and 225 us for
    the float32 matmuls, and a tree pass copies no cache per branch. Longer passes (prefill, training)
    use the fused kernel as is.
    """
    h, t = q.shape[1], q.shape[2]
    gqa = k.shape[1] != h
    if mask is not None and t <= ROW_INVARIANT_MAX_ROWS and (ext := row_kernel(q.dtype, q.device)) is not None:
        full = mask.mask if isinstance(mask, GappedMask) else mask
        keys, values = (x if x.dtype in _ROW_KEY_DTYPES and x.stride(-1) == 1 else _dense32(x) for x in (k, v))
        out = ext.row_attention(
            q.float().contiguous(), keys, values, full.reshape(-1, t, k.shape[2]).contiguous(), q.shape[-1] ** -0.5
        )
        return out.to(q.dtype).transpose(1, 2)
    if isinstance(mask, GappedMask):  # built only for passes of up to ROW_INVARIANT_MAX_ROWS rows
        outs = []
        for rows, order, packed in mask.groups:
            kk = k if order is None else k.index_select(2, order)
            vv = v if order is None else v.index_select(2, order)
            outs.append(_few_rows(q[:, :, rows], kk, vv, packed, gqa))
        return torch.cat(outs, dim=1)[:, mask.inverse].transpose(1, 2)
    if mask is None or t > ROW_INVARIANT_MAX_ROWS:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return _few_rows(q, k, v, mask, gqa).transpose(1, 2)


@functools.cache
def batches_requests_exactly(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str, threads: int
) -> bool:
    """Whether one :func:`attend` call over several sequences (one query row and one cache each, as
    batch items) gives every sequence the bits of its own one-row decoding step, probed once per head
    shape, dtype, device and thread count.

    Each batch item is the same small product as a lone step, but a BLAS may choose its blocking or
    threading by the batch size, so a probe over batch sizes and cache lengths decides (measured exact
    on the AMX Xeon for SmolLM2's and the tests' tiny models' heads). The batched call gets its keys
    and values as pooled caches store them (:meth:`Transformer.new_pool`). Where it fails, a batched
    step attends per sequence (:meth:`Transformer.step_groups`), as before batching.
    """
    gen = torch.Generator().manual_seed(0)
    store = torch.float32 if attends_in_float32(dtype, torch.device(device)) else dtype

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    for s in (STACKED_MIN_KEYS, 200, 1024):
        for b in (2, 3, 8):
            q, k, v = rand(b, heads, 1, head_dim), rand(b, kv_heads, s, head_dim), rand(b, kv_heads, s, head_dim)
            mask = torch.arange(s)[None, :] < torch.randint(1, s + 1, (b, 1), generator=gen)
            whole = attend(q, k.to(store), v.to(store), mask.to(device)[:, None])
            for i in range(b):
                alone = attend(q[i : i + 1], k[i : i + 1], v[i : i + 1], mask[i : i + 1].to(device))
                if not torch.equal(whole[i : i + 1], alone):
                    return False
    return True


class StepGroup(NamedTuple):
    """Sequences of a batched decoding step that attend in one call: their rows in the step (None:
    all rows, in order), their caches, and their masks ``[B, 1, max_len]``."""

    rows: Tensor | None
    cache: CacheRows
    mask: Tensor


class Attention(Tracked):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.wo = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        # OLMoE: RMSNorm over the whole q and k projections (all heads at once), then optional clipping.
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.clip = cfg.clip_qkv

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor, lora: Lora | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Project normed ``x`` (``[B, T, d]``) to rotated q and k and plain v, ``[B, heads, T, D]``."""
        y = self.wqkv(x)
        if lora is not None and "qkv" in lora:
            y = y + lora["qkv"](x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = y.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            y = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        if self.clip is not None:
            y = y.clamp(-self.clip, self.clip)
        b, t, _ = x.shape
        y = y.view(b, t, self.n_heads + 2 * self.n_kv, self.head_dim).transpose(1, 2)
        # q and k share one rotation call; v is the remaining heads.
        qk = apply_rope(y[:, : self.n_heads + self.n_kv], cos, sin)
        return qk[:, : self.n_heads], qk[:, self.n_heads :], y[:, self.n_heads + self.n_kv :]

    def out(self, o: Tensor, lora: Lora | None = None) -> Tensor:
        """Merge heads of ``o`` (``[B, H, T, D]``) and apply the output projection."""
        b, _, t, _ = o.shape
        o = o.transpose(1, 2).reshape(b, t, self.q_size)
        y = self.wo(o)
        if lora is not None and "o" in lora:
            y = y + lora["o"](o)
        return y


def swiglu(y: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``y = [gate | up]``. For bfloat16 inference on a CPU with the AVX2 build, one
    C++ call (``csrc_avx2/rows_avx2.cpp``, torch's two roundings, its own exp) that the fused decoder
    block shares, so the per-op path and the fused one give a row the same bits."""
    if (
        y.dtype == torch.bfloat16
        and y.device.type == "cpu"
        and not (torch.is_grad_enabled() and y.requires_grad)
        and (ext := amx.row_helpers()) is not None
        and hasattr(ext, "silu_mul")
    ):
        return ext.silu_mul(y.contiguous())
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(Tracked):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        m = intermediate_size or cfg.intermediate_size
        self.w13 = nn.Linear(cfg.hidden_size, 2 * m, bias=False)
        self.w2 = nn.Linear(m, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, lora: Lora | None = None, resid: Tensor | None = None) -> Tensor:
        """SwiGLU FFN of normed ``x``; ``resid`` is unused (same call signature as :class:`MoE`)."""
        y = self.w13(x)
        if lora is not None and "gate_up" in lora:
            y = y + lora["gate_up"](x)
        h = swiglu(y)
        out = self.w2(h)
        if lora is not None and "down" in lora:
            out = out + lora["down"](h)
        return out


class ExpertSource(Protocol):
    """Where an MoE layer gets expert weights when they are not resident in the module."""

    def fetch(self, layer: int, ids: list[int], resid: Tensor | None) -> dict[int, tuple[Tensor, Tensor]]:
        """Weights ``(w13 [2*F_e, d] gate|up fused, w2 [d, F_e])`` for the experts ``ids`` (unique, sorted)
        that layer ``layer`` needs for the rows of this pass. ``resid`` is the layer's residual input to
        the MoE (before its RMSNorm, ``[B, T, d]``), so prefetch policies can look ahead. May block (that
        is a stall). May return a SUBSET of ids: the MoE then drops the missing experts' terms (used for
        cheap 'cache-only' routing of the fast stream)."""
        ...


class MoE(Tracked):
    """Sparse Mixture-of-Experts FFN: a linear router picks ``top_k`` of ``E`` SwiGLU experts per token.

    Expert weights are stacked (``w13 [E, 2F, d]`` gate|up, ``w2 [E, d, F]``) so that one expert is one
    contiguous slice, which is the unit an offloading runtime copies. The compute loops over the
    experts that this pass selected and runs each on the rows routed to it: a decoding step has 1..k
    rows, and for one row this was faster here than one batched matmul over the gathered k experts
    (which first copies their weights).
    Contributions are summed in float32 in ascending expert order (as transformers does), so a row's
    result does not depend on which other rows share the pass.

    With ``source`` set, weights come from ``source.fetch`` instead of the resident tensors (which an
    offloading runtime may replace by empty ones). Experts the source does not return are dropped.
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.layer = layer
        self.num_experts, self.top_k, self.convention = e, cfg.num_experts_per_tok, cfg.router_weights
        self.router = nn.Linear(d, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * f, d))
        self.w2 = nn.Parameter(torch.empty(e, d, f))
        self.shared: MLP | None = None
        self.shared_gate: nn.Linear | None = None
        if cfg.shared_expert_intermediate_size:  # always-on expert, resident (not served by ``source``)
            self.shared = MLP(cfg, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gated:
                self.shared_gate = nn.Linear(d, 1, bias=False)
        self.source: ExpertSource | None = None

    def route(self, x_normed: Tensor) -> tuple[Tensor, Tensor]:
        """Expert ids ``[..., k]`` (long) and their float32 weights ``[..., k]`` under the config's convention.

        The top-k is taken over float32 softmax probabilities, as transformers does, so ids agree with
        it even where logits nearly tie; ``ones`` uses the same ranking with unit weights.
        """
        probs = torch.softmax(self.router(x_normed).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.convention == "softmax_topk_renorm":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        elif self.convention == "ones":
            weights = torch.ones_like(weights)
        return ids, weights

    def forward(self, x_normed: Tensor, lora: Lora | None = None, resid: Tensor | None = None) -> Tensor:
        """MoE output for normed ``x`` (``[B, T, d]``). ``lora`` is ignored: accelerator adapters of MoE
        blocks adapt attention only. ``resid`` (the un-normed residual) is passed to the expert source."""
        shape = x_normed.shape
        x = x_normed.reshape(-1, shape[-1])
        ids, weights = self.route(x)
        flat, flat_w = ids.flatten(), weights.flatten()
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the pass's one host sync
        needed = [e for e, c in enumerate(counts) if c]
        order = torch.argsort(flat, stable=True)  # (row, slot) pairs grouped by expert, ascending
        fetched = self.source.fetch(self.layer, needed, resid) if self.source is not None else None
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for e in needed:
            pairs = order[start : start + counts[e]]
            start += counts[e]
            if fetched is None:
                w13, w2 = self.w13[e], self.w2[e]
            elif e in fetched:
                w13, w2 = fetched[e]
            else:
                continue  # the source chose not to provide it: drop this expert's term
            if x.shape[0] == 1:  # decoding: no gather / scatter
                gate, up = F.linear(x, w13).chunk(2, dim=-1)
                out += F.linear(F.silu(gate) * up, w2).float() * flat_w[pairs, None]
                continue
            rows = pairs // self.top_k
            gate, up = F.linear(x[rows], w13).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2)
            out.index_add_(0, rows, y.float() * flat_w[pairs, None])
        if self.shared is not None:
            y = self.shared(x)
            if self.shared_gate is not None:
                y = torch.sigmoid(self.shared_gate(x)) * y
            out += y.float()
        return out.to(x_normed.dtype).view(shape)


#: Whether a block's passes of a few rows run as one C++ call where :meth:`Block.fused` applies (set
#: ``M2R2_NO_FUSED=1`` for the per-op path: the same bits, ~2x the Python and torch overhead per step).
FUSED_BLOCKS = os.environ.get("M2R2_NO_FUSED") != "1"

#: Whether a greedy step or verify pass runs its embeddings, blocks, norm, head and argmax as one C++ call where
#: :meth:`Transformer.greedy_parts` applies (set ``M2R2_NO_GREEDY_PASS=1`` for the op-by-op path: the same tokens).
GREEDY_PASS = FUSED_BLOCKS and os.environ.get("M2R2_NO_GREEDY_PASS") != "1"


#: the most rows a prefill runs on the fused C++ blocks at once (longer prompts go through them in pieces): each piece
#: streams every weight once, and its element-wise steps and attention run its rows on every thread. A row's numbers
#: never depend on the rows beside it: on the int8 loops a prefill's rows get the bits of passes of a few rows, and on
#: an AMX CPU's bfloat16 tiles (csrc_avx2/prefill_amx.cpp, passes of more than ROW_INVARIANT_MAX_ROWS rows) the bits
#: of any other split into such passes (tested); against the per-op path (torch's attention, one thread between the
#: linears) prefills took 0.82-0.94 of the time at 40-600 tokens (experiments/prefill_paths.py, 2 threads, Zen 4)
PREFILL_MAX_ROWS = 512


def fused_pass_fits(
    x: Tensor, cache: KVCache, pos: int, mask: Tensor | GappedMask, max_rows: int = ROW_INVARIANT_MAX_ROWS
) -> bool:
    """Whether a pass can run on the fused C++ blocks (given their weights): one inference sequence of up to
    ``max_rows`` bfloat16 rows under a plain 2-D mask, within the cache's capacity."""
    t = x.shape[1]
    return (
        FUSED_BLOCKS
        and x.shape[0] == 1
        and t <= max_rows
        and isinstance(mask, Tensor)
        and mask.dim() == 2
        and cache.k.shape[1] == 1
        and pos + t <= cache.max_len
        and x.dtype == torch.bfloat16
        and not torch.is_grad_enabled()
    )


def _fused_pass_args(cache: KVCache, pos: int, mask: Tensor, cos: Tensor, sin: Tensor) -> tuple:
    """What the fused C++ passes (``stack_forward``, ``greedy_pass``) take after their rows: the cache, the first
    slot, the mask and the RoPE rows, contiguous."""
    return cache.k, cache.v, pos, mask.contiguous(), cos.contiguous(), sin.contiguous()


#: the largest cache capacity whose square causal mask a model keeps (4 MB of booleans): masks of a pass are its rows
CAUSAL_KEPT_MAX = 2048

#: the AVX2 build's linear ops and their weight bits
AVX2_OPS = {"q4_linear_avx2": 4, "q8_linear_avx2": 8}


class Block(Tracked):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | MoE = MoE(cfg, layer) if cfg.is_sparse(layer) else MLP(cfg)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int, pos: int, mask: Tensor | GappedMask
    ) -> Tensor:
        """Slow-stream step: write this block's K/V at ``pos`` and attend over the first
        ``mask.shape[-1]`` cache slots under ``mask``."""
        if fused_pass_fits(x, cache, pos, mask) and (w := self.fused()) is not None:
            ext = amx.avx2_extension()
            rows = x[0].contiguous()
            k, v = cache.k[layer], cache.v[layer]
            out = ext.block_forward(w, rows, k, v, pos, mask.contiguous(), cos.contiguous(), sin.contiguous())  # type: ignore[union-attr]
            return out[None]
        q, k, v = self.attn.qkv(self.attn_norm(x), cos, sin)
        cache.write(layer, pos, k, v)
        keys, values = cache.view(layer, mask.shape[-1])
        a = x + self.attn.out(attend(q, keys, values, mask))
        return a + self.mlp(self.mlp_norm(a), resid=a)

    def fused_key(self) -> tuple[int, ...]:
        """What :meth:`fused`'s weights are built from (the modules and norm weights, by identity), read from
        the module dictionaries directly: through ``nn.Module.__getattr__`` this took ~20 us a block, and a
        pass asks every block."""
        mods = self._modules
        attn, mlp = mods["attn"], mods["mlp"]
        sub_a, sub_m = attn._modules, mlp._modules  # type: ignore[union-attr]
        return (
            id(attn),
            id(mlp),
            id(sub_a["wqkv"]),
            id(sub_a["wo"]),
            id(sub_m.get("w13")),
            id(sub_m.get("w2")),
            id(mods["attn_norm"]._parameters["weight"]),  # type: ignore[union-attr]
            id(mods["mlp_norm"]._parameters["weight"]),  # type: ignore[union-attr]
        )

    def fused(self) -> object | None:
        """This block's weights for the fused C++ block (``csrc_avx2/block_avx2.cpp``: the whole block over a
        few rows in one call, the per-op path's bits), or None where it does not apply: only the AVX2 build's
        4/8-bit linears, a plain SwiGLU MLP, no q/k norms or clipping. Built once and kept, keyed by the
        modules it was built from (a merged fast layer is a shallow copy with other linears)."""
        key = self.fused_key()
        kept = self.__dict__.get("_fused")
        if kept is not None and kept[0] == key:
            return kept[1]
        lins = (self.attn.wqkv, self.attn.wo, getattr(self.mlp, "w13", None), getattr(self.mlp, "w2", None))
        weights = None
        applies = (  # checked before the build is asked for: a model on other kernels (a GPU's) never builds it
            isinstance(self.mlp, MLP)
            and self.attn.q_norm is None
            and self.attn.clip is None
            and self.attn.head_dim % 16 == 0
            and self.attn_norm.weight.dtype == torch.bfloat16
            and self.mlp_norm.weight.dtype == torch.bfloat16
            and all(getattr(lin, "op", None) in AVX2_OPS and getattr(lin, "products", None) == "avx2" for lin in lins)
            and all(lin.bias is None or lin.bias.dtype == torch.bfloat16 for lin in lins)  # type: ignore[union-attr]
        )
        ext = amx.avx2_extension() if applies else None
        if ext is not None and hasattr(ext, "block_forward") and amx.row_helpers() is ext:
            none = torch.empty(0)
            weights = ext.make_block(
                self.attn_norm.weight.detach().contiguous(),
                self.mlp_norm.weight.detach().contiguous(),
                self.attn_norm.eps,
                [lin.qbytes for lin in lins],  # type: ignore[union-attr]
                [lin.scales for lin in lins],  # type: ignore[union-attr]
                [AVX2_OPS[lin.op] for lin in lins],  # type: ignore[union-attr]
                [none if lin.bias is None else lin.bias.detach().contiguous() for lin in lins],  # type: ignore[union-attr]
                self.attn.n_heads,
                self.attn.n_kv,
                self.attn.head_dim,
                lins[3].in_features,  # type: ignore[union-attr]
            )
        self.__dict__["_fused"] = (key, weights)
        return weights

    def step_rows(self, x: Tensor, cos: Tensor, sin: Tensor, groups: list[StepGroup], layer: int) -> Tensor:
        """One decoding step of several sequences (``x``: ``[B, 1, d]``, one row per sequence).

        Projections and the MLP see all rows at once; attention runs once per group of sequences
        whose caches share a capacity (:class:`StepGroup`), each row a batch item of the one-row
        computation :meth:`forward` runs for a lone sequence, so each row gets a lone step's bits.
        """
        q, k, v = self.attn.qkv(self.attn_norm(x), cos, sin)
        if len(groups) == 1 and groups[0].rows is None:  # one group in row order: no gather
            (g,) = groups
            o = attend(q, *g.cache.append(layer, k, v), g.mask)
        else:
            o = torch.empty_like(q)
            for g in groups:
                o[g.rows] = attend(q[g.rows], *g.cache.append(layer, k[g.rows], v[g.rows]), g.mask)
        a = x + self.attn.out(o)
        return a + self.mlp(self.mlp_norm(a), resid=a)


class Transformer(Tracked):
    """Embedding, ``num_layers`` blocks, final norm and LM head (tied or untied)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = Blocks(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)compute the RoPE tables in float32, e.g. after building the model on the meta device.

        Computed in float32 and cast once to the weights' dtype, which is what transformers does
        per forward, so reference-mode outputs match it exactly. Call again after a dtype change.
        """
        cfg = self.cfg
        device = self.embed.weight.device
        if device.type == "meta":
            device = torch.device("cpu")
        inv, scale = rope_inv_freq(cfg)
        inv_t = torch.tensor(inv, dtype=torch.float32, device=device)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_t)
        sin = freqs.sin() * scale
        dtype = self.embed.weight.dtype
        self.rope_cos = (freqs.cos() * scale).repeat(1, 2).to(dtype)
        self.rope_sin = torch.cat((-sin, sin), dim=-1).to(dtype)  # sign of rotate_half folded in

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        return KVCache(self.cfg, max_len, batch, dtype=self.dtype, device=self.device)

    def new_pool(self, items: int) -> KVPool:
        """Caches for up to ``items`` sequences per capacity that a batched step attends over together: stored in
        float32 where attention computes in float32 op by op, but as a lone sequence's cache stores them (the
        model's dtype) where the fused C++ blocks run the passes. Why: there a bfloat16 cache's attention takes AMX
        tiles from 448 keys, whose sums a float32 cache does not take, and a served request's answer left the lone
        one's from ~600-token contexts (``experiments/serve_long_contexts.py``: of four prompts of 438-622 tokens, the
        two longest)."""
        fused = self.fused_stack() is not None
        store = torch.float32 if attends_in_float32(self.dtype, self.device) and not fused else None
        return KVPool(self.cfg, items, self.dtype, self.device, store)

    def rope(self, pos: int, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        cos, sin = self.rope_cos[pos : pos + length], self.rope_sin[pos : pos + length]
        if cos.dtype != dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    def causal_mask(self, pos: int, t: int, kv_len: int) -> Tensor:
        """Mask ``[t, kv_len]`` for queries at ``pos..pos+t-1`` over cache slots ``0..kv_len-1``.

        Attention always spans the same ``kv_len`` (the cache capacity) whatever ``t`` is: the
        attention kernel's reductions then see identical lengths for a one-token decoding step
        and for a k-token verification pass, so each row gets bit-identical results. With exact
        lengths (``pos + t``) a bf16 verify pass differs from decoding in the last bits, which
        flips near-tied argmaxes and breaks lossless speculative decoding.

        Up to a capacity of ``CAUSAL_KEPT_MAX`` the mask is rows of a kept square (a view: never write into it).
        """
        kept, key = self.__dict__.get("_causal"), (kv_len, self.cfg.sliding_window, self.device)
        if kept is not None and kept[0] == key and pos + t <= kv_len:
            return kept[1][pos : pos + t]  # rows of the kept square: a contiguous view, no work per pass
        full = kv_len <= CAUSAL_KEPT_MAX and pos >= 0 and pos + t <= kv_len
        q_pos = torch.arange(0 if full else pos, kv_len if full else pos + t, device=self.device)[:, None]
        k_pos = torch.arange(kv_len, device=self.device)[None, :]
        mask = k_pos <= q_pos
        if self.cfg.sliding_window is not None:
            mask &= k_pos > q_pos - self.cfg.sliding_window
        if not full:
            return mask
        self.__dict__["_causal"] = (key, mask)
        return mask[pos : pos + t]

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        return self.embed(tokens)

    def fused_stack(self) -> object | None:
        """Every block's fused weights as one C++ stack (``stack_forward``: a pass's blocks in one call), or
        None where a block has none (other kernels, MoE blocks). Kept, keyed by the blocks' own keys, which are
        read again only after something was assigned onto the model's modules (:class:`Structure`)."""
        kept = self.__dict__.get("_stack")
        if kept is not None and kept[0] == Structure.version:
            return kept[2]
        version = Structure.version
        blocks = list(self.layers)
        key = tuple(b.fused_key() for b in blocks)  # type: ignore[operator]
        if kept is not None and kept[1] == key:
            stack = kept[2]
        else:
            weights = [b.fused() for b in blocks]  # type: ignore[operator]
            stack = None
            if weights and all(w is not None for w in weights):  # else nothing to build the extension for (a GPU)
                ext = amx.avx2_extension()
                stack = ext.make_stack(weights) if hasattr(ext, "make_stack") else None  # type: ignore[union-attr]
        self.__dict__["_stack"] = (version, key, stack)
        return stack

    def run_layers(
        self,
        x: Tensor,
        cache: KVCache,
        pos: int,
        hidden: list[Tensor] | None = None,
        stop: int | None = None,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        """Run blocks ``0..stop-1`` on embeddings ``x`` written at cache slots ``pos..``.

        Each block's output is appended to ``hidden`` when given. By default token t sits at
        position ``pos + t`` under a causal mask; tree and Jacobi-style verification passes
        instead give explicit RoPE ``positions`` (``[T]``) and a boolean ``mask``
        (``[T, pos + T]``, True = attend) over the cache slots.
        """
        t = x.shape[1]
        prefill = mask is None and positions is None and t > ROW_INVARIANT_MAX_ROWS
        if prefill and t > PREFILL_MAX_ROWS:
            # a long prompt piece by piece (each on the fused blocks where they run), in pieces of equal size: none
            # as short as a verify pass, so every row of a prompt takes a prefill's kernels (their own bits)
            pieces = -(-t // PREFILL_MAX_ROWS)
            size = -(-t // pieces)
            outs, layers = [], [] if hidden is not None else None
            for s0 in range(0, t, size):
                piece: list[Tensor] | None = [] if hidden is not None else None
                outs.append(self.run_layers(x[:, s0 : s0 + size], cache, pos + s0, piece, stop))
                if layers is not None:
                    layers.append(piece)
            if layers:
                hidden.extend(torch.cat(parts, dim=1) for parts in zip(*layers, strict=True))
            return torch.cat(outs, dim=1)
        # a long pass (a prefill) runs the fused kernel, never a decoding step's bits, so it attends only the
        # filled slots: 1.5-2.5x faster attention on 67-300-token prompts
        kv_len = pos + t if mask is None and t > ROW_INVARIANT_MAX_ROWS else cache.max_len
        cos, sin, mask = self.pass_tables(pos, t, x.dtype, positions, mask, kv_len)
        layer_mask: Tensor | GappedMask = mask
        if (
            positions is not None
            and mask.dim() == 2
            and t <= ROW_INVARIANT_MAX_ROWS
            and row_kernel(x.dtype, x.device) is None
        ):
            layer_mask = GappedMask.over(mask)  # analysed once per pass, used by every layer
        n = len(self.layers) if stop is None else min(stop, len(self.layers))
        rows = PREFILL_MAX_ROWS if prefill else ROW_INVARIANT_MAX_ROWS
        stack = self._stack_for(x, cache, pos, layer_mask, rows) if n > 0 else None
        if stack is not None:  # every block in one C++ call: the per-block path's bits without its Python
            ext = amx.avx2_extension()
            args = _fused_pass_args(cache, pos, mask, cos, sin)
            outs = ext.stack_forward(stack, x[0].contiguous(), *args, n, hidden is not None)  # type: ignore[union-attr]
            if hidden is not None:
                hidden.extend(o[None] for o in outs)
            x = outs[-1][None]
        else:
            for i, layer in enumerate(self.layers[:stop]):
                x = layer(x, cos, sin, cache, i, pos, layer_mask)
                if hidden is not None:
                    hidden.append(x)
        if stop is None or stop >= len(self.layers):
            cache.length = pos + t
        return x

    def greedy_parts(self) -> tuple[object, ...] | None:
        """What :meth:`greedy_pass` hands ``csrc_avx2``'s ``greedy_pass`` besides a pass's rows: the fused stack, the LM
        head's weights, the final norm's weight and epsilon and the embedding table; None where a pass cannot run
        there (the stack missing, a head other than the AVX2 build's 4/8-bit one, a bias, norm or embedding weights
        not in bfloat16). Kept as :meth:`fused_stack` keeps its stack, until something is assigned onto the model's
        modules (:class:`Structure`): a pass reads no module attribute for them."""
        kept = self.__dict__.get("_greedy")
        if kept is not None and kept[0] == Structure.version:
            return kept[1]
        version = Structure.version
        stack = self.fused_stack()
        head, norm = self.lm_head, self.norm
        ext = amx.avx2_extension() if stack is not None else None
        parts = None
        if (
            stack is not None
            and hasattr(ext, "greedy_pass")
            and getattr(head, "op", None) in AVX2_OPS
            and getattr(head, "products", None) == "avx2"
            and head.bias is None
            and norm.weight.dtype == torch.bfloat16
            and self.embed.weight.dtype == torch.bfloat16
        ):
            none = torch.empty(0)
            bits = AVX2_OPS[head.op]  # type: ignore[index]
            lm = ext.make_linear(head.qbytes, head.scales, bits, none, head.in_features, head.out_features)  # type: ignore[union-attr]
            parts = (stack, lm, norm.weight, norm.eps, self.embed.weight)
        self.__dict__["_greedy"] = (version, parts)
        return parts

    def greedy_pass(
        self, tokens: list[int], cache: KVCache, pos: int, positions: Tensor | None = None, mask: Tensor | None = None
    ) -> tuple[list[int], Tensor] | None:
        """Each row's greedy token and the rows' final states ``[1, T, d]`` for ``tokens`` written at cache slots
        ``pos..`` (``positions`` and ``mask`` as :meth:`run_layers` takes them), in one C++ call; None where the
        fused path does not apply (the caller then runs :meth:`run_layers` and the head).

        The same tokens and states as ``argmax_rows(self.head(self.run_layers(...)))`` (tested): the same kernels in
        the same order. Why one call: after a pass has streamed the weights through the caches, each op that follows
        runs cold (``experiments/cold_ops.py``); a step paid five of them around its kernels."""
        t = len(tokens)
        if (
            not GREEDY_PASS
            or t > ROW_INVARIANT_MAX_ROWS
            or cache.k.shape[1] != 1
            or pos + t > cache.max_len
            or torch.is_grad_enabled()
        ):
            return None
        parts = self.greedy_parts()
        if parts is None:
            return None
        if positions is not None and row_kernel(torch.bfloat16, self.device) is None:
            return None  # run_layers would analyse the mask for the per-op attention instead
        cos, sin, mask = self.pass_tables(pos, t, torch.bfloat16, positions, mask, cache.max_len)
        ext = amx.avx2_extension()
        ids, h = ext.greedy_pass(*parts, tokens, *_fused_pass_args(cache, pos, mask, cos, sin))  # type: ignore[union-attr]
        cache.length = pos + t
        return ids, h[None]

    def greedy_steps(self, tokens: list[int], caches: list[KVCache]) -> tuple[list[int], Tensor] | None:
        """One greedy decoding step of several sequences in one C++ call: each sequence's next token and final state
        ``[B, 1, d]`` for its new token ``tokens[b]``, appended to its own cache (lone or lent by a pool, of any
        capacity); None where the fused path does not apply (the caller then runs :meth:`step_rows` and the head), or
        for more than ``ROW_INVARIANT_MAX_ROWS`` sequences.

        Row b has the bits of sequence b's lone :meth:`greedy_pass` step (tested): its linears are row-invariant up to
        that many rows, its attention reads its own keys under its lone step's mask. Why: through :meth:`step_rows`
        and the head a batched step cost 2.3-2.7x the one call's time at 2-4 sequences and ~1.6 ms a row against
        ~1.2 at 32 (``experiments/batched_steps.py``)."""
        if not GREEDY_PASS or not caches or len(caches) > ROW_INVARIANT_MAX_ROWS or torch.is_grad_enabled():
            return None
        if any(c.k.shape[1] != 1 or c.length >= c.max_len for c in caches):
            return None
        parts = self.greedy_parts()
        if parts is None:
            return None
        slots = [c.length for c in caches]
        mask = torch.zeros(len(caches), max(c.max_len for c in caches), dtype=torch.bool, device=self.device)
        for b, c in enumerate(caches):  # each row's lone-step mask over its own cache
            mask[b, : c.max_len] = self.causal_mask(c.length, 1, c.max_len)[0]
        at = torch.tensor(slots, device=self.device)
        cos, sin = self.rope_cos[at].to(torch.bfloat16), self.rope_sin[at].to(torch.bfloat16)
        ext = amx.avx2_extension()
        ks, vs = [c.k for c in caches], [c.v for c in caches]
        ids, h = ext.greedy_steps(*parts, tokens, ks, vs, slots, mask, cos, sin)  # type: ignore[union-attr]
        for c in caches:
            c.length += 1
        return ids, h[:, None]

    def pass_tables(
        self, pos: int, t: int, dtype: torch.dtype, positions: Tensor | None, mask: Tensor | None, kv_len: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """A pass's RoPE rows (``cos``, ``sin``: ``[t, D]`` in ``dtype``) and its mask over ``kv_len`` cache slots: the
        causal one at positions ``pos..pos+t-1``, or the given ``positions`` and ``mask`` (padded to ``kv_len``)."""
        if positions is None:
            cos, sin = self.rope(pos, t, dtype)
        else:
            if mask is None:
                raise ValueError("explicit positions need an explicit mask")
            cos, sin = self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)
        if mask is None:
            mask = self.causal_mask(pos, t, kv_len)
        elif mask.shape[-1] < kv_len:  # pad a custom mask to the cache capacity (see causal_mask)
            mask = torch.cat([mask, mask.new_zeros(t, kv_len - mask.shape[-1])], dim=-1)
        return cos, sin, mask

    def _stack_for(
        self, x: Tensor, cache: KVCache, pos: int, mask: Tensor | GappedMask, max_rows: int = ROW_INVARIANT_MAX_ROWS
    ) -> object | None:
        """The fused stack where a pass can run it (what :meth:`Block.forward` asks of the fused block)."""
        return self.fused_stack() if fused_pass_fits(x, cache, pos, mask, max_rows) else None

    def step_rows(self, tokens: list[int], caches: list[KVCache]) -> Tensor:
        """Last hidden states ``[B, 1, d]`` (before :meth:`head`) of one new token per sequence, each
        appended to its own cache.

        Continuous batching: sequences of different lengths and capacities decode together. The
        layers' kernels are row-invariant and attention runs once per capacity over the sequences'
        caches, each a batch item of a lone step's computation (:func:`batches_requests_exactly`
        checks that this keeps bits on this machine, else each sequence attends alone), so row b is
        bit-identical to the hidden state of ``self(tokens[b:b+1], caches[b])`` alone. The head is
        left to the caller: oneDNN's bf16 head gives one row other bits than several rows.
        """
        x = self.embed_tokens(torch.tensor(tokens, device=self.device)[:, None])
        ropes = [self.rope(c.length, 1, x.dtype) for c in caches]
        cos = torch.stack([c for c, _ in ropes])[:, None]  # [B, 1, 1, D]: each row at its own position
        sin = torch.stack([s for _, s in ropes])[:, None]
        groups = self.step_groups(caches)
        for i, layer in enumerate(self.layers):
            x = layer.step_rows(x, cos, sin, groups, i)
        for c in caches:
            c.length += 1
        return x

    def step_groups(self, caches: list[KVCache]) -> list[StepGroup]:
        """The sequences of a batched step grouped by cache capacity (each alone where batching attention
        would change bits), in cache order within a group so that pooled caches are one view."""
        cfg = self.cfg
        together = len(caches) > 1 and batches_requests_exactly(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.dtype, str(self.device), torch.get_num_threads()
        )
        by_key: dict[int, list[int]] = {}
        for b, c in enumerate(caches):
            by_key.setdefault(c.max_len if together else b, []).append(b)
        groups = []
        for rows in by_key.values():
            rows.sort(key=lambda b: (id(caches[b].base or caches[b]), caches[b].item))
            group = [caches[b] for b in rows]
            mask = torch.stack([self.causal_mask(c.length, 1, c.max_len) for c in group])  # [B, 1, S]
            in_order = rows == list(range(len(caches)))
            groups.append(
                StepGroup(None if in_order else torch.tensor(rows, device=self.device), CacheRows(group), mask)
            )
        return groups

    def head(self, h: Tensor, float_logits: bool = True) -> Tensor:
        """Final norm and LM head; logits are returned in float32 for exact argmax and sampling
        (``float_logits=False``: in the head's own dtype, for a greedy argmax, which picks the same token from
        them, since widening to float32 is exact, without a float32 copy of the vocabulary)."""
        logits = self.lm_head(self.norm(h))
        return logits.float() if float_logits else logits

    def forward(
        self,
        tokens: Tensor,
        cache: KVCache,
        pos: int | None = None,
        last_only: bool = False,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
        float_logits: bool = True,
    ) -> Tensor:
        """Logits for ``tokens`` (``[B, T]``) appended at ``pos`` (default: the cache length); ``float_logits``
        as :meth:`head` takes it."""
        pos = cache.length if pos is None else pos
        h = self.run_layers(self.embed_tokens(tokens), cache, pos, positions=positions, mask=mask)
        if last_only:
            h = h[:, -1:]
        return self.head(h, float_logits)
