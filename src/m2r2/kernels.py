"""Weight kernels: the frozen linear layers decoding runs on, and the choice among them.

As gpt-fast keeps its ``quantize.py`` next to ``model.py``: the transformer is written against
``nn.Linear``; :func:`use_kernels` swaps its layers, once loaded, for a oneDNN pre-packed bf16
layer, a weight-only int8 one, or the 4-bit one that runs the bundled GGUF's own Q4_1 weights.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m2r2 import amx, hugepages
from m2r2.model import ROW_INVARIANT_MAX_ROWS, MoE

if TYPE_CHECKING:
    from m2r2.model import Transformer


def row_by_row(f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``f(x)`` with each row of a ``[..., T, d]`` pass of 2..:data:`ROW_INVARIANT_MAX_ROWS` rows run alone."""
    rows = x.shape[-2] if x.dim() > 1 else 1
    if 1 < rows <= ROW_INVARIANT_MAX_ROWS:
        return torch.cat([f(x[..., i : i + 1, :]) for i in range(rows)], dim=-2)
    return f(x)


#: Row counts a batching probe compares against one-row calls (every count a verify pass or a
#: batched serving step may use follows the same GEMM blocking as one of these).
_PROBE_ROWS = (2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32)


@functools.cache
def batches_exactly(kind: str, out_features: int, in_features: int, dtype: torch.dtype, threads: int) -> bool:
    """Whether this machine's ``kind`` GEMM ("packed" oneDNN, "plain" ``F.linear``, "q4-amx" /
    "q4-avx512" :class:`AmxInt4Linear` or "q8-amx" / "q8-avx512" :class:`AmxInt8Linear`) gives each row of a
    2..:data:`ROW_INVARIANT_MAX_ROWS`-row pass the bits it gets alone, probed once per shape and
    thread count.

    Why a probe: oneDNN picks its algorithm by CPU and shape, not by values. With native bf16 (AMX)
    a multi-row pass was measured row-invariant and nearly as cheap as one row (so verification
    costs about one step); without it rows changed bits from ~20 rows and passes run row by row.
    The AMX kernels are row-invariant by construction; the probe guards the build on this machine.
    """
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_size=1) if kind == "packed" else None
    products = NATIVE_KERNELS.get(kind.replace("q8", "q4"))  # the C++ kernels' 4- and 8-bit layers
    if products is not None:
        lin = nn.Linear(in_features, out_features, bias=False)
        with torch.no_grad():
            lin.weight.copy_(w.float() * 0.05)
        native_layer = (AmxInt4Linear if kind.startswith("q4") else AmxInt8Linear)(lin, products=products)

    def run(x: Tensor) -> Tensor:
        if products is not None:
            return native_layer(x)
        if packed is None:
            return F.linear(x, w)
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    for rows in _PROBE_ROWS:
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        if not torch.equal(run(x), torch.cat([run(x[i : i + 1]) for i in range(rows)])):
            return False
    return True


class RowInvariantLinear(nn.Linear):
    """A plain low-precision linear layer that gives each row of a short pass the bits it gets alone.

    On a CPU without native bf16 instructions, oneDNN's bf16 GEMM was measured to change its
    algorithm with the number of rows (a 21-row lookahead pass gave some rows other bits than
    decoding), which would break lossless verification with ``--kernel plain`` in bf16. Where
    :func:`batches_exactly` finds that so, passes of up to :data:`ROW_INVARIANT_MAX_ROWS` rows run
    one row at a time, as decoding does; longer ones (prefill) run whole. Parameters and state-dict
    names are those of ``nn.Linear``.
    """

    @property
    def batches(self) -> bool:
        """Whether a multi-row pass already gives each row its one-row bits (probed per shape)."""
        return batches_exactly("plain", self.out_features, self.in_features, self.weight.dtype, torch.get_num_threads())

    def forward(self, x: Tensor) -> Tensor:
        if self.batches:
            return F.linear(x, self.weight, self.bias)
        return row_by_row(lambda r: F.linear(r, self.weight, self.bias), x)


class PackedLinear(nn.Module):
    """A frozen linear layer whose bf16 weight is pre-packed for oneDNN (AMX / AVX-512 on x86 CPUs).

    Measured on an AMX CPU (3072x576, bf16): 0.135 ms at 1 row vs 0.22 ms for ``F.linear``, and
    nearly flat up to 16 rows, and row-invariant. On a CPU without native bf16 instructions its
    results for a row were measured to change with the number of rows (from ~20 rows); there
    (:func:`batches_exactly` probes it) short passes run row by row (:func:`row_by_row`), so a
    verify pass sees exactly a one-token step's numbers.
    """

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        # Only the packed copy is kept: holding the unpacked weight too would double the memory.
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.bias = lin.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), batch_size=1)
        self.batches = batches_exactly(
            "packed", self.out_features, self.in_features, lin.weight.dtype, torch.get_num_threads()
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.batches:
            return self._rows(x)
        return row_by_row(self._rows, x)

    def _rows(self, x: Tensor) -> Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed, self.bias, "none", [], "")
        return y.view(*shape[:-1], y.shape[-1])


class Int8Linear(nn.Module):
    """Weight-only int8 linear layer (symmetric, one scale per output channel), bf16 activations.

    Halves the bytes a memory-bound decoding step reads compared with bf16, at a small accuracy
    cost (it is a different model numerically: outputs are compared against bf16 in BENCHMARKS.md).
    Its cost grows faster with the number of rows than oneDNN's bf16 kernel, so it suits plain
    decoding more than multi-token verification.
    """

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        w = lin.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.bias = lin.bias
        self.qweight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scales = scale.to(lin.weight.dtype)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], y.shape[-1])


class Int4Linear(nn.Module):
    """Weight-only 4-bit linear layer: asymmetric groups of 32 input weights, bf16 activations.

    Why it exists: the bundled model *is* 4-bit. Its GGUF stores every layer weight as Q4_1
    (blocks of 32 along the input dimension, ``w = d * q + m`` with ``q`` in 0..15), and a block's
    minimum and maximum always map to ``q = 0`` and ``q = 15``, so the min/max quantisation below
    recovers the file's own ``q``, ``d`` and ``m`` exactly from the de-quantized float32 weights
    (tested; :func:`m2r2.loading.load_model` passes those as ``source``, since bf16-rounded weights
    would not round-trip).
    The only rounding left is ``d`` and ``m + 8d`` to bf16, the same order as rounding each weight
    to bf16 in the ``mkldnn`` kernel. It reads a quarter of bf16's bytes per step, and each row's
    result does not depend on how many rows are batched (tested), so verification stays lossless.
    Multi-row passes cost more than with oneDNN bf16 (about 3.5x at 8 rows), which the speculative
    methods' measured cost model accounts for.

    Q4_K (the Qwen2.5-Coder-1.5B GGUF's layers) is the same thing per sub-block of 32
    (``w = d * sc * q - dmin * m``), but its quantiser may leave ``q = 15`` (or 0) unused in a block;
    such blocks are recovered on the grid that spans ``j < 15`` steps (:meth:`_on_grid`), so those
    layers are exact too. Any other weights (Q6_K, Q5_0, random) get plain 4-bit min/max
    quantisation (lossy); ``exact`` says which case a layer is.
    """

    GROUP = 32
    #: How far (in steps) a weight may sit off its grid point: float32 rounding of the de-quantisation
    #: is ~1e-6 of a step, a weight of another grid is typically a sizable fraction of one.
    TOL = 1e-3

    def __init__(self, lin: nn.Linear, source: Tensor | None = None) -> None:
        super().__init__()
        q, step, lo, self.exact = self.quantize(lin, source)
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.bias = lin.bias
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
        # the kernel computes (q - 8) * scale + zero
        self.scales_zeros = torch.stack([step.t(), (lo + 8.0 * step).t()], dim=-1).contiguous().to(torch.bfloat16)

    @classmethod
    def quantize(cls, lin: nn.Linear, source: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, bool]:
        """``(q [n, k] in 0..15, step [n, k/32], lo [n, k/32], exact)`` with ``w = q * step + lo`` per
        group of 32 inputs; ``exact`` says whether every group was on a 4-bit grid already."""
        w = (lin.weight if source is None else source).detach().float()
        n, k = w.shape
        g = cls.GROUP
        blocks = w.view(n, k // g, g)
        lo = blocks.amin(-1)
        step = (blocks.amax(-1) - lo) / 15.0
        r = (blocks - lo[..., None]) / step.clamp_min(1e-30)[..., None]  # in steps above the block's minimum
        q = r.round()
        off = (r - q).abs_().amax(-1) > cls.TOL
        del r
        q.clamp_(0, 15)
        exact = cls._on_grid(blocks, lo, step, q, off)
        return q.view(n, k), step, lo, exact

    @classmethod
    def _on_grid(cls, blocks: Tensor, lo: Tensor, step: Tensor, q: Tensor, off: Tensor, probe: int = 64) -> bool:
        """Whether every block lies on a 4-bit grid, moving the blocks ``off`` their min/max grid onto the
        grid of ``j`` steps between min and max (``j`` = 14..1) where that one fits (``step`` and ``q`` are
        updated in place).

        ``probe`` misfits are tried first, so a layer that is not 4-bit (Q6_K: every block off every
        grid) costs one cheap pass, not fourteen.
        """
        bad = off.nonzero(as_tuple=True)
        if bad[0].numel() == 0:
            return True
        b = blocks[bad] - lo[bad][:, None]
        span = step[bad] * 15.0
        left = torch.ones(b.shape[0], dtype=torch.bool)
        for limit in (probe, None):
            idx = left.nonzero().squeeze(1)[:limit]
            for j in range(14, 0, -1):
                st = span[idx] / j
                r = b[idx] / st[:, None]
                qj = r.round()
                ok = (r - qj).abs_().amax(-1) <= cls.TOL
                hit = idx[ok]
                step[bad[0][hit], bad[1][hit]] = st[ok]
                q[bad[0][hit], bad[1][hit]] = qj[ok]
                left[hit] = False
                idx = idx[~ok]
                if idx.numel() == 0:
                    break
            if idx.numel():
                return False
        return True

    @classmethod
    def fits(cls, lin: nn.Module) -> bool:
        return isinstance(lin, nn.Linear) and lin.in_features % cls.GROUP == 0 and lin.out_features % 8 == 0

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]), self.packed, self.GROUP, self.scales_zeros
        )
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], y.shape[-1])


class _AmxLinear(nn.Module):
    """What the C++ integer kernels share: integer weights ``q`` packed per block of 64 columns in the
    VNNI pair layout (``qbytes``), float16 terms per column and group of 32 inputs (``scales``), and the
    C++ op ``OP`` that sums them, on AMX tiles (``products="amx"``) or with AVX512-BF16 dot products
    (``"avx512"``: CPUs without AMX, e.g. AMD Zen 4/5; other bits, the same weights), or, on CPUs with
    AVX2 only (``"avx2"``, e.g. AMD Zen 3), with byte dot products on inputs rounded to int8 per group of
    32 (blocks of 8 columns, its own layout: :meth:`pack_avx2`). A subclass gives the integers, the terms
    and how they pack to bytes."""

    BLOCK = 64
    GROUP = 32
    OP = ""

    #: columns per block of the ``avx2`` products (one register of eight float32 sums)
    AVX2_BLOCK = 8

    def __init__(self, lin: nn.Linear, q: Tensor, terms: list[Tensor], products: str = "amx") -> None:
        """``q`` ``[n, k]`` integers; ``terms`` the per-group factors (``[n, k/32]`` each)."""
        super().__init__()
        if products not in PRODUCTS:
            raise ValueError(f"products must be one of {', '.join(PRODUCTS)}, got {products!r}")
        self.products = products
        self.op = self.OP if products == "amx" else f"{self.OP}_{products}"
        n, k = q.shape
        block = self.AVX2_BLOCK if products == "avx2" else self.BLOCK
        nb = n // block
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.bias = lin.bias
        if products == "avx2":
            self.qbytes = self.pack_avx2(q.view(nb, block, k)).contiguous()
        else:
            # VNNI pairs: lane j of input pair p is column j // 2 at input 2p + j % 2
            lanes = q.view(nb, block, k // 2, 2).permute(0, 2, 1, 3).reshape(nb, k // 2, 2 * block)
            self.qbytes = self.pack(lanes, products).contiguous()
        per_block = [t.view(nb, block, k // self.GROUP).transpose(1, 2) for t in terms]
        self.scales = torch.stack(per_block, dim=2).half().contiguous()  # [nb, k/32, len(terms), block]
        if not torch.isfinite(self.scales).all():
            raise ValueError(f"q4-{products}: a step or minimum of a {type(self).__name__} does not fit float16")
        if products == "avx2":  # the op reads the blocks in pairs
            self.qbytes, self.scales = (
                interleave_pairs(self.qbytes, k // self.GROUP),
                interleave_pairs(self.scales, k // self.GROUP),
            )

    @staticmethod
    def pack(lanes: Tensor, products: str) -> Tensor:
        """The bytes the C++ op reads for integer ``lanes`` ``[blocks, k/2, 128]``."""
        raise NotImplementedError

    @staticmethod
    def pack_avx2(q: Tensor) -> Tensor:
        """The bytes the ``avx2`` op reads for integers ``q`` ``[blocks, 8, k]`` (``csrc_avx2/q4_avx2.cpp``)."""
        raise NotImplementedError

    @classmethod
    def fits(cls, lin: nn.Module) -> bool:
        return isinstance(lin, nn.Linear) and lin.in_features % cls.GROUP == 0 and lin.out_features % cls.BLOCK == 0

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        ext = amx.avx2_extension() if self.products == "avx2" else amx.extension()
        y = getattr(ext, self.op)(x.reshape(-1, shape[-1]).contiguous(), self.qbytes, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], y.shape[-1])


class AmxInt4Linear(_AmxLinear):
    """The same 4-bit weights as :class:`Int4Linear`, multiplied on AMX: up to 16 rows cost about one.

    Why: a verify pass (a token tree, a copied chain) runs several rows through every layer, and
    the stock 4-bit GEMM de-quantizes the weights again for every 4 rows (v(8) = 1.96 steps). This
    one (C++ in ``csrc/q4_amx.cpp``, built by :mod:`m2r2.amx`) never de-quantizes: per group of 32
    inputs a weight is ``q * step + lo``, so the group adds ``step * sum(q * x) + lo * sum(x)`` to an
    output. The integers ``q`` are exact in bf16, AMX sums ``q * x`` for all rows at once (16 at a
    time), and the steps and minima are applied to those float32 sums: less work per weight than
    de-quantizing (a one-row step is faster than the stock kernel's), and no bf16 rounding of the
    weights. A row's sums run in the same order whatever the number of rows, so a verify pass gives
    each row its one-token bits (tested, and probed once per shape at load:
    :func:`batches_exactly`). Steps and minima are kept in float16: exact for GGUF Q4_1 (its ``d``
    and ``m`` are float16), a 2^-11 relative rounding for Q4_K sub-block scales.
    """

    OP = "q4_linear"
    #: where each packed byte's low / high nibble lands among a pair's 128 VNNI lanes (the kernel's
    #: byte shuffles and interleaves place byte 16t+i at lane 8t+i, byte 16t+8+i at lane 32+8t+i)
    LOW_LANES = tuple(8 * (b // 16) + b % 8 + (32 if b % 16 >= 8 else 0) for b in range(64))
    HIGH_LANES = tuple(64 + lane for lane in LOW_LANES)

    def __init__(self, lin: nn.Linear, source: Tensor | None = None, products: str = "amx") -> None:
        q, step, lo, exact = Int4Linear.quantize(lin, source)
        super().__init__(lin, q.to(torch.uint8), [step, lo], products)
        self.exact = exact

    @staticmethod
    def pack(lanes: Tensor, products: str) -> Tensor:
        if products == "amx":
            return lanes[..., list(AmxInt4Linear.LOW_LANES)] | (lanes[..., list(AmxInt4Linear.HIGH_LANES)] << 4)
        # avx512: 32 little-endian words per pair, nibble n of word i = lane 32n + i (the kernel shifts a
        # word by 4n to reach it)
        words = sum(lanes[..., 32 * n : 32 * n + 32].to(torch.int32) << (4 * n) for n in range(4))
        return torch.stack([words & 0xFF, words >> 8], dim=-1).flatten(-2).to(torch.uint8)

    @staticmethod
    def pack_avx2(q: Tensor) -> Tensor:
        # per 8 inputs 8j..8j+7: byte 4c + i = column c's input 8j + i (low nibble), 8j + 4 + i (high)
        nb, cols, k = q.shape
        v = q.view(nb, cols, k // 8, 2, 4).permute(0, 2, 1, 3, 4)  # [nb, k/8, 8 columns, half, 4]
        return (v[..., 0, :] | (v[..., 1, :] << 4)).reshape(nb, k // 8, 32)


class AmxInt8Linear(_AmxLinear):
    """8-bit weights per group of 32 inputs (``w = q * step``, ``q`` in -127..127: GGUF Q8_0), summed on
    AMX like :class:`AmxInt4Linear`: the LM head of the ``q4-amx`` kernel.

    Why: the bundled model's head (tied to its Q8_0 embedding) is 49k x 576; read in bf16 it is 56 MB
    per step, about a fifth of a q4 step's time here. Here it is read as its own 8-bit blocks (half
    the bytes) and, like the 4-bit layers, summed as integers on AMX with the step applied to each
    group's sum: a Q8_0 head is then exact (bf16 would round every weight to 8 significant bits), rows
    stay independent of the pass (tested; :func:`batches_exactly` probes it), and 16 rows cost about
    one. Weights that are not 8-bit blocks (another GGUF type, trained ones) are quantised to them
    (``exact`` says which).
    """

    OP = "q8_linear"

    def __init__(self, lin: nn.Linear, source: Tensor | None = None, products: str = "amx") -> None:
        w = (lin.weight if source is None else source).detach().float()
        n, k = w.shape
        blocks = w.view(n, k // self.GROUP, self.GROUP)
        step = (blocks.abs().amax(-1) / 127.0).half().float()  # Q8_0's d is float16: exact for such blocks
        r = blocks / step.clamp_min(1e-30)[..., None]
        q = r.round().clamp_(-127, 127)
        exact = bool(((r - q).abs() <= Int4Linear.TOL).all())
        del r
        super().__init__(lin, q.view(n, k).to(torch.int8), [step], products)
        self.exact = exact

    @staticmethod
    def pack(lanes: Tensor, products: str) -> Tensor:
        return lanes

    @staticmethod
    def pack_avx2(q: Tensor) -> Tensor:
        # per 4 inputs 4j..4j+3: byte 4c + i = column c's input 4j + i
        nb, cols, k = q.shape
        return q.view(nb, cols, k // 4, 4).permute(0, 2, 1, 3).reshape(nb, k // 4, 32)


def interleave_pairs(packed: Tensor, groups: int) -> Tensor:
    """``packed`` (``[blocks, ...]``, each block's bytes or terms group by group) with the groups of blocks 2p
    and 2p + 1 interleaved (group g of the second right after group g of the first; an odd last block stays
    as it is), in the same shape: the order the ``q4-avx2`` op reads its weights in.

    Why: its AVX512-VNNI build multiplies a pair of blocks (16 columns) in one 512-bit register a row; read
    from one run of memory, a pair streams as fast as a block does, while two blocks a block apart ran at
    ~2/3 of the memory speed (``csrc_avx2/q4_rows.h``, experiments/q4_micro.cpp). 4- and 8-bit weights alike."""
    nb, paired = packed.shape[0], packed.shape[0] // 2 * 2
    flat = packed.reshape(nb, groups, -1)
    pairs = flat[:paired].view(nb // 2, 2, groups, -1).transpose(1, 2).reshape(paired, groups, -1)
    return torch.cat([pairs, flat[paired:]]).view(packed.shape).contiguous()


def _activation_dtype(lin: nn.Module) -> torch.dtype:
    """The input dtype a linear layer of any of our kernels takes."""
    if isinstance(lin, nn.Linear):
        return lin.weight.dtype
    if isinstance(lin, Int8Linear):
        return lin.scales.dtype
    return torch.bfloat16  # the packed bf16 / 4-bit kernels


def dense_weight(lin: nn.Module) -> Tensor:
    """The float32 weight ``[out, in]`` that a linear layer of any of our kernels applies.

    Packed kernels keep no unpacked copy, so the weight is read back by running the layer on the
    identity matrix: exact for the bf16 kernels, and the de-quantized weight (rounded to bf16) for
    the int8/q4 ones. Used to fold the accelerator adapters into private copies of the fast
    stream's layers (:meth:`m2r2.multirate.fast.FastStream.freeze`).
    """
    if isinstance(lin, nn.Linear):
        return lin.weight.detach().float()
    # packed kernels hold their weights as plain tensor attributes
    device = next((v.device for v in vars(lin).values() if isinstance(v, Tensor)), torch.device("cpu"))
    y = lin(torch.eye(lin.in_features, dtype=_activation_dtype(lin), device=device)).float()
    bias = getattr(lin, "bias", None)
    if bias is not None:
        y = y - bias.float()
    return y.t().contiguous()


def linear_like(lin: nn.Module, weight: Tensor, bits: int | None = None) -> nn.Module:
    """A frozen linear layer applying ``weight`` (float ``[out, in]``) with the same kernel as ``lin``; ``bits=4``
    takes that kernel's 4-bit blocks where ``lin`` is a C++ 8-bit one (a draft head: half the bytes a draft reads,
    its drafts only a little blurred; the verify pass never reads it)."""
    bias = getattr(lin, "bias", None)
    plain = nn.Linear(
        weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=_activation_dtype(lin)
    )
    with torch.no_grad():
        plain.weight.copy_(weight)
        if bias is not None:
            plain.bias.copy_(bias)
    plain.requires_grad_(False)
    if isinstance(lin, _AmxLinear):
        kind = AmxInt4Linear if bits == 4 else type(lin)
        return kind(plain, weight.float(), products=lin.products)
    if isinstance(lin, Int4Linear):
        return type(lin)(plain, weight.float())
    if isinstance(lin, PackedLinear):
        return PackedLinear(plain)
    if isinstance(lin, Int8Linear):
        return Int8Linear(plain)
    return plain


#: The C++ 4-bit kernels (``csrc/q4_amx.cpp``, ``csrc_avx2/q4_avx2.cpp``) and how each sums its products.
NATIVE_KERNELS = {"q4-amx": "amx", "q4-avx512": "avx512", "q4-avx2": "avx2"}
PRODUCTS = tuple(NATIVE_KERNELS.values())
KERNELS = ("auto", "plain", "mkldnn", "int8", "q4", *NATIVE_KERNELS)


@functools.cache
def mkldnn_bf16_runs() -> bool:
    """Whether oneDNN packs and multiplies bf16 weights on this CPU. torch builds it everywhere, but
    its bf16 linear needs AVX512-BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU (e.g. AMD Zen 3)
    packing raises, so it is tried once on a tiny weight instead of assumed."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), batch_size=1)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=torch.bfloat16), w, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def mkldnn_usable(model: Transformer) -> bool:
    return model.device.type == "cpu" and model.dtype == torch.bfloat16 and mkldnn_bf16_runs()


def q4_usable(model: Transformer) -> bool:
    """Whether the 4-bit kernel can run every dense layer of ``model`` (bf16 on a CPU)."""
    return (
        model.device.type == "cpu"
        and model.dtype == torch.bfloat16
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        and not model.cfg.is_moe
        and all(Int4Linear.fits(lin) for lin in _dense_layers(model))
    )


def q4_native_problem(model: Transformer, kernel: str = "q4-amx") -> str | None:
    """Why the C++ 4-bit ``kernel`` (``q4-amx`` or ``q4-avx512``) cannot run every dense layer of
    ``model`` here, or None where it can (builds the kernels on first call; probes per layer shape
    that a multi-row pass keeps each row's one-row bits)."""
    if not q4_usable(model):
        widths = f"layer widths divisible by {Int4Linear.GROUP}"
        return f"the {kernel} kernel needs bf16 on a CPU and a dense model with {widths}"
    layers = _dense_layers(model)
    if not all(AmxInt4Linear.fits(lin) for lin in layers):
        return f"the {kernel} kernel needs layer output widths divisible by {AmxInt4Linear.BLOCK}"
    if kernel == "q4-avx2":
        if amx.avx2_extension() is None:
            return "the q4-avx2 kernel needs a CPU with AVX2, FMA and F16C and a C++ compiler (use --kernel q4)"
    elif kernel == "q4-amx" and not amx.amx_cpu():  # said before building anything
        return "the q4-amx kernel needs a CPU with AMX (use --kernel q4-avx2, q4-avx512 or q4)"
    elif not amx.available():
        return f"the {kernel} kernel needs a CPU with AVX512-BF16 and a C++ compiler (use --kernel q4)"
    if kernel == "q4-amx" and not amx.amx_available():
        return "the q4-amx kernel needs a CPU with AMX (use --kernel q4-avx2, q4-avx512 or q4)"
    shapes = {(lin.out_features, lin.in_features) for lin in layers}
    if not all(batches_exactly(kernel, n, k, torch.bfloat16, torch.get_num_threads()) for n, k in shapes):
        return f"the {kernel} kernel changes a row's bits with the pass size on this machine (use --kernel q4)"
    return None


def q4_amx_usable(model: Transformer) -> bool:
    return q4_native_problem(model, "q4-amx") is None


def q4_avx512_usable(model: Transformer) -> bool:
    return q4_native_problem(model, "q4-avx512") is None


def q4_avx2_usable(model: Transformer) -> bool:
    return q4_native_problem(model, "q4-avx2") is None


def q8_native_head_fits(model: Transformer, kernel: str) -> bool:
    """Whether ``kernel``'s 8-bit head (:class:`AmxInt8Linear`) takes ``model``'s LM head here
    (vocabulary divisible by 64; rows probed at the head's input width: a column's sums do not depend
    on how many columns there are, so a 4,096-column probe stands for the whole head)."""
    head = model.lm_head
    n, k = head.out_features, head.in_features
    return (
        AmxInt8Linear.fits(head)
        and (amx.avx2_extension() if kernel == "q4-avx2" else amx.extension()) is not None
        and batches_exactly(kernel.replace("q4", "q8"), min(n, 4096), k, torch.bfloat16, torch.get_num_threads())
    )


def _dense_layers(model: Transformer) -> list[nn.Module]:
    return [lin for b in model.layers for lin in (b.attn.wqkv, b.attn.wo, b.mlp.w13, b.mlp.w2)]


def use_kernels(model: Transformer, kernel: str = "auto", source: Mapping[str, Tensor] | None = None) -> str:
    """Swap the model's linear layers for faster frozen kernels; returns the kernel used.

    ``source`` optionally maps our state-dict names to the float32 weights the model was cast from;
    the q4 kernel quantises those (see :class:`Int4Linear`), the others ignore it.

    ``plain`` keeps ``nn.Linear`` (needed for training, and the reference mode). ``auto`` picks
    ``q4-avx2`` for bf16 on an AVX2 CPU where it builds and every layer fits it (integer dot products on
    inputs rounded to int8 per group of 32; its blocks run as one C++ call per pass: on a Zen 4 a pass took
    0.45 of ``q4-avx512``'s, whose blocks run op by op from Python, "Twentieth round"; on a Sapphire Rapids
    class Xeon it decoded 2.3x faster than ``q4-amx`` and ran ``m2r2`` 1.9x faster, "Twenty-ninth round";
    there its passes of 10 rows or more sum on AMX tiles, same bits), else ``q4-amx`` on an AMX CPU, else
    ``q4-avx512`` (the AMX kernel with AVX512-BF16 dot products), else ``q4``, else ``mkldnn``, else ``plain``.
    Measured on the bundled Q4_1
    model (BENCHMARKS.md): q4 decodes ~1.7x faster than oneDNN bf16 with the same agreement with the
    fp32 reference, because it runs the GGUF's own 4-bit weights; q4-amx runs the same weights with a
    one-token step 0.85-0.87 of q4's and verify passes nearly flat in rows (8 rows 1.22-1.28 of q4's
    one-token step, "Sixth round"); q4-avx2 decodes 2.25x faster than q4 on a Zen 3 core ("Fifteenth round").
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose from {', '.join(KERNELS)}")
    if kernel == "auto":
        kernel = (
            (
                "q4-avx2"
                if q4_avx2_usable(model)
                else "q4-amx"
                if q4_amx_usable(model)
                else "q4-avx512"
                if q4_avx512_usable(model)
                else "q4"
            )
            if q4_usable(model)
            else "mkldnn"
            if mkldnn_usable(model)
            else "plain"
        )
    if kernel == "mkldnn" and not mkldnn_usable(model):
        raise ValueError("the mkldnn kernel needs bf16 weights on a CPU with oneDNN")
    if kernel in ("int8", "q4", *NATIVE_KERNELS) and (model.dtype != torch.bfloat16 or model.device.type != "cpu"):
        raise ValueError(f"the {kernel} kernel needs bf16 activations on a CPU")
    if kernel == "plain" and model.dtype != torch.float32 and model.device.type == "cpu":
        for lin in [model.lm_head, *(m for b in model.layers for m in b.modules() if type(m) is nn.Linear)]:
            _row_invariant(lin)
    wrap: Callable[..., nn.Module] | None = {"mkldnn": PackedLinear, "int8": Int8Linear, "q4": Int4Linear}.get(kernel)
    if kernel in NATIVE_KERNELS:
        if problem := q4_native_problem(model, kernel):
            raise ValueError(problem)
        wrap = functools.partial(AmxInt4Linear, products=NATIVE_KERNELS[kernel])
    head_wrap = wrap
    if kernel in ("q4", *NATIVE_KERNELS):
        # The bundled head/embedding is Q8_0 (8-bit): 4 bits would lose accuracy there, so the head
        # keeps oneDNN bf16 where available, or under the C++ kernels its own 8-bit blocks.
        head_wrap = PackedLinear if mkldnn_usable(model) else _row_invariant
        if kernel in NATIVE_KERNELS and q8_native_head_fits(model, kernel):
            head_wrap = functools.partial(
                AmxInt8Linear, source=(source or {}).get("lm_head.weight"), products=NATIVE_KERNELS[kernel]
            )
        if not q4_usable(model):
            raise ValueError(
                f"the q4 kernel needs a dense (non-MoE) model with layer widths divisible by {Int4Linear.GROUP}"
            )
    if wrap is not None:
        src = source or {}

        def swap(lin: nn.Module, name: str) -> nn.Module:
            return wrap(lin, src.get(name + ".weight")) if kernel in ("q4", *NATIVE_KERNELS) else wrap(lin)

        for i, block in enumerate(model.layers):
            block.attn.wqkv = swap(block.attn.wqkv, f"layers.{i}.attn.wqkv")
            block.attn.wo = swap(block.attn.wo, f"layers.{i}.attn.wo")
            if (mlp := _dense_mlp(block)) is not None:
                mlp.w13 = swap(mlp.w13, f"layers.{i}.mlp.w13")
                mlp.w2 = swap(mlp.w2, f"layers.{i}.mlp.w2")
    if head_wrap is not None:
        model.lm_head = head_wrap(model.lm_head)
    if kernel in NATIVE_KERNELS:  # every packed weight in one buffer on huge pages, in the order a pass reads them
        order: list[nn.Module] = []
        for b in model.layers:
            mlp = _dense_mlp(b)
            order += [b.attn.wqkv, b.attn.wo, *([] if mlp is None else [mlp.w13, mlp.w2])]
        place_on_huge_pages([*order, model.lm_head])
    return kernel


def place_on_huge_pages(modules: Iterable[nn.Module]) -> bool:
    """The packed weights of those ``modules`` that run a C++ kernel, in the order given (the order a pass reads
    them), copied into one buffer on huge pages (:func:`m2r2.hugepages.gather`); whether huge pages were advised."""
    return hugepages.gather(m for m in modules if isinstance(m, _AmxLinear))


def _dense_mlp(block: nn.Module) -> nn.Module | None:
    """A block's dense MLP: its own, or an MoE block's shared expert (None without one; plain experts stay stacked
    tensors, which an offloading runtime swaps per expert)."""
    return block.mlp.shared if isinstance(block.mlp, MoE) else block.mlp


def _row_invariant(lin: nn.Linear) -> nn.Linear:
    """``lin`` as a :class:`RowInvariantLinear`: the same parameters, only the forward changes (the
    ``plain`` kernel's layers in bf16, and a bf16 head on a CPU where oneDNN cannot run bf16)."""
    lin.__class__ = RowInvariantLinear
    return lin


def _mantissa_bits(dtype: torch.dtype) -> int:
    return {torch.bfloat16: 7, torch.float16: 10}.get(dtype, 23)


def _row_norm_max(lin: nn.Module) -> float:
    """Largest L2 norm of a weight row of ``lin`` (cached on the module; weights are frozen)."""
    cached = getattr(lin, "_row_norm_max", None)
    if cached is None:
        cached = float(dense_weight(lin).norm(dim=-1).max())
        object.__setattr__(lin, "_row_norm_max", cached)
    return cached


def widen_logits(sub: Tensor, ids: Tensor, vocab_size: int) -> Tensor:
    """Logits over a draft vocabulary (``[..., len(ids)]``) as logits over all ``vocab_size`` tokens,
    ``-inf`` elsewhere: every drafter that scores only the draft vocabulary's rows of a head still
    returns a proper distribution, so speculative sampling stays exact."""
    out = sub.new_full((*sub.shape[:-1], vocab_size), float("-inf"))
    return out.index_copy_(-1, ids.to(sub.device), sub)


def argmax_rows(logits: Tensor) -> Tensor:
    """``logits.argmax(-1)`` (the same tokens: the first of equal maxima, NaN counts as the maximum).

    Why: torch's CPU argmax over a 49k vocabulary takes ~0.1 ms a row on one thread, 0.7-0.8 ms for
    a verify pass of 8 rows (a third of the LM head's own time); the C++ sweep (``csrc/argmax.cpp``)
    takes 0.05 ms for those 8 rows and reads a bfloat16 head's output without a float32 copy.
    """
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and logits.shape[-1] > 0:
        ext = amx.row_helpers()
        if ext is not None:
            return ext.argmax_rows(logits.contiguous())
    return logits.argmax(-1)


def head_argmax(model: Transformer, h: Tensor) -> Tensor:
    """``model.head(row).argmax(-1)`` for every row of ``h`` (``[..., d]``: a verify pass's rows, or one
    row per sequence of a batched step) as if each ran alone, at about one head's cost.

    Why: lossless greedy decoding must pick, for each row, the token a one-row step would pick; the
    oneDNN bf16 head gives a row other bits in a multi-row pass on some CPUs, so exactness alone
    would cost one head per row (a 49k-word head is ~a sixth of a SmolLM2 step). Here the head runs
    once over all rows and a row's argmax is kept when its margin over the runner-up exceeds what a
    different summation order could change: both computations add the same exact float32 products
    ``w_k x_k`` in some order (each within ``K u sum|w_k x_k|`` of the exact sum, bounded by
    ``||W_j|| ||x||``) and round to the output dtype (half a unit in the last place each). Rows inside
    that band (rare) are recomputed alone.
    """
    x = model.norm(h)
    lin = model.lm_head
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= 1 or not isinstance(lin, PackedLinear | RowInvariantLinear) or lin.batches:
        return argmax_rows(model.lm_head(x))
    batched = (lin._rows(flat) if isinstance(lin, PackedLinear) else F.linear(flat, lin.weight, lin.bias)).float()
    top = batched.topk(2, dim=-1)
    k = flat.shape[-1]
    fp32_err = 2 * k * 2.0**-24 / (1 - k * 2.0**-24) * flat.float().norm(dim=-1) * _row_norm_max(lin)
    mag = top.values.abs().amax(-1).clamp_min(1e-30)
    ulp = 2.0 ** (torch.floor(torch.log2(mag)) - _mantissa_bits(flat.dtype))
    sure = (top.values[:, 0] - top.values[:, 1]) > 2 * (fp32_err + ulp)
    ids = top.indices[:, 0].clone()
    for i in (~sure).nonzero()[:, 0].tolist():
        ids[i] = argmax_rows(model.lm_head(flat[i : i + 1]))[0]
    return ids.view(x.shape[:-1])
