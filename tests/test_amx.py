"""The C++ 4-bit kernels (``q4-amx``: AMX tiles, ``q4-avx512``: AVX512-BF16 dot products, ``q4-avx2``:
AVX2 integer dot products on int8-rounded inputs): the same weights as ``q4``, rows independent of the
pass size; and the per-row helpers (row attention, RMSNorm, argmax) of each build."""

from __future__ import annotations

import itertools
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from m2r2 import amx
from m2r2.errors import SettingsError
from m2r2.kernels import AmxInt4Linear, AmxInt8Linear, Int4Linear, PackedLinear, argmax_rows
from m2r2.loading import load_model
from m2r2.machine import cpu_has
from m2r2.model import RMSNorm

needs_amx = pytest.mark.skipif(not amx.amx_available(), reason="no AMX CPU or no C++ compiler here")
#: each way the C++ linears sum their products, where this CPU runs it
PRODUCTS = [
    pytest.param("amx", marks=needs_amx),
    pytest.param("avx512", marks=pytest.mark.skipif(not amx.available(), reason="no AVX512-BF16 CPU or compiler")),
]
needs_avx2 = pytest.mark.skipif(amx.avx2_extension() is None, reason="no AVX2 CPU or no C++ compiler here")


def q4_1_layer(n: int, k: int, seed: int) -> tuple[torch.nn.Linear, torch.Tensor]:
    """A linear layer whose weights are GGUF Q4_1 blocks (``d * q + m``, min and max at q = 0 and 15),
    with ``d`` and ``m`` chosen so every weight is exact in bf16."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0.0, 15.0
    d = 2.0 ** -torch.randint(4, 8, (n, k // 32, 1), generator=g).float()
    m = -torch.randint(0, 64, (n, k // 32, 1), generator=g).float() / 64
    w = (q * d + m).view(n, k)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = w.to(torch.bfloat16)
    return lin, w


@pytest.mark.parametrize("products", PRODUCTS)
def test_q4_native_runs_the_q4_weights_and_rounds_like_bf16(products: str) -> None:
    """One-hot rows read the exact 4-bit weights back; a random pass is x @ W^T in float32 rounded once
    to bf16 (within half a bf16 step of the float32 product of the same bf16 inputs, plus the float32
    summation-order error)."""
    lin, w = q4_1_layer(192, 96, seed=0)
    layer = AmxInt4Linear(lin, products=products)
    assert layer.exact
    assert torch.equal(layer(torch.eye(96, dtype=torch.bfloat16)).float(), w.t())
    assert torch.equal(layer(torch.eye(96, dtype=torch.bfloat16)), Int4Linear(lin)(torch.eye(96, dtype=torch.bfloat16)))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = x.float() @ w.t()
    tol = ref.abs() * 2.0**-8 + 1e-5 * ref.abs().max()
    assert ((layer(x).float() - ref).abs() <= tol).all()


def q8_0_layer(n: int, k: int, seed: int) -> tuple[torch.nn.Linear, torch.Tensor]:
    """A linear layer whose weights are GGUF Q8_0 blocks (``d * q``, ``q`` in -127..127 reaching +-127,
    ``d`` float16): most such weights are not exact in bf16."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127.0
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
    w = (q * d).view(n, k)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = w.clone()
    return lin, w


@pytest.mark.parametrize("products", PRODUCTS)
def test_q8_native_runs_q8_0_weights_exactly(products: str) -> None:
    """The 8-bit head kernel recovers Q8_0 blocks from their float32 values and applies them without
    rounding a weight: one-hot rows give each weight rounded once to bf16, a random pass is x @ W^T in
    float32 rounded once to bf16; other weights are quantised to 8-bit blocks (``exact`` False)."""
    lin, w = q8_0_layer(192, 96, seed=4)
    layer = AmxInt8Linear(lin, products=products)
    assert layer.exact
    assert torch.equal(layer(torch.eye(96, dtype=torch.bfloat16)), w.t().to(torch.bfloat16))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ref = x.float() @ w.t()
    tol = ref.abs() * 2.0**-8 + 1e-5 * ref.abs().max()
    assert ((layer(x).float() - ref).abs() <= tol).all()
    lin.weight.data = torch.randn(192, 96, generator=torch.Generator().manual_seed(6))
    assert not AmxInt8Linear(lin).exact


@pytest.mark.parametrize("products", [*PRODUCTS, pytest.param("avx2", marks=needs_avx2)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits", [4, 8])
def test_native_rows_do_not_depend_on_the_pass(products: str, threads: int, bits: int) -> None:
    """Every row of a pass of 2..40 rows (several 16-row passes over the weights; 4-row groups and
    their remainders on AVX512) has the bits it gets alone,
    with a bias, on 1 and 2 threads, for the 4-bit layers and the 8-bit head: what lossless
    verification needs."""
    lin, _ = (q4_1_layer if bits == 4 else q8_0_layer)(320, 128, seed=2)
    lin.bias = torch.nn.Parameter(torch.randn(320).to(torch.bfloat16))
    layer = (AmxInt4Linear if bits == 4 else AmxInt8Linear)(lin, products=products)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
        for rows in (2, 3, 5, 6, 7, 8, 15, 16, 17, 33, 40):
            assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"
        assert torch.equal(layer(x[:6].view(2, 3, 128)).view(6, -1), alone[:6])  # batch dims flatten
    finally:
        torch.set_num_threads(before)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the ``avx2`` products see it: each row rounded per group of 32 to int8 steps of max|x| / 127."""
    g = x.float().view(x.shape[0], -1, 32)
    top = g.abs().amax(-1, keepdim=True)
    q = torch.where(top > 0, (g * (127 / top)).round(), torch.zeros_like(g))
    return (q * (top / 127)).view(x.shape)


@needs_avx2
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("outputs", [192, 200])
def test_avx2_products_are_the_weights_times_int8_rounded_inputs(bits: int, outputs: int) -> None:
    """The ``avx2`` products apply the same integers, steps and minima as the other kernels to inputs
    rounded per group of 32 to int8 (llama.cpp's Q8 rounding): x @ W^T of those inputs in float32,
    rounded once to bf16 (within a bf16 step), and close to the bf16 product (int8 steps of ~0.4%).
    200 outputs: 4-bit blocks in pairs and an odd last block alone (``interleave_pairs``)."""
    lin, w = q4_1_layer(outputs, 96, seed=12) if bits == 4 else q8_0_layer(outputs, 96, seed=13)
    layer = (AmxInt4Linear if bits == 4 else AmxInt8Linear)(lin, products="avx2")
    assert layer.exact and layer.op == f"q{bits}_linear_avx2"
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    got = layer(x).float()
    ref = int8_rows(x) @ w.t()
    assert ((got - ref).abs() <= ref.abs() * 2.0**-8 + 1e-5 * ref.abs().max()).all()
    plain = x.float() @ w.t()
    assert (got - plain).abs().max() <= 0.02 * plain.abs().max()
    eye = torch.eye(96, dtype=torch.bfloat16)  # one-hot rows round exactly: the weights come back
    assert torch.allclose(layer(eye).float(), w.t(), rtol=2.0**-8, atol=1e-6)


@needs_avx2
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("outputs", [192, 200])
def test_avx2_vnni_loop_gives_the_avx2_loop_s_bits(bits: int, outputs: int) -> None:
    """On a CPU with AVX512-VNNI the AVX2 build sums byte products with VPDPBUSD (``q4_vnni.cpp``): the same
    integers as VPMADDUBSW + VPADDW + VPMADDWD, so every row of 1-9-row passes gets the same bits either way,
    inputs at the int8 extremes included (every product at its bound). Its 4-bit pairs of blocks in 512-bit
    registers too: 200 outputs end in an odd block, which runs alone."""
    ext = amx.avx2_extension()
    if not ext.set_vnni(True):
        ext.set_vnni(False)
        pytest.skip("no AVX512-VNNI on this CPU")
    lin, _ = q4_1_layer(outputs, 96, seed=21) if bits == 4 else q8_0_layer(outputs, 96, seed=22)
    layer = (AmxInt4Linear if bits == 4 else AmxInt8Linear)(lin, products="avx2")
    g = torch.Generator().manual_seed(23)
    extreme = torch.where(torch.rand(9, 96, generator=g) < 0.5, -3.0, 3.0)  # every input rounds to +-127
    try:
        for x in (torch.randn(9, 96, generator=g) * 4, extreme):
            for rows in range(1, 10):
                xb = x[:rows].to(torch.bfloat16)
                ext.set_vnni(True)
                on = layer(xb)
                ext.set_vnni(False)
                assert torch.equal(on, layer(xb))
    finally:
        ext.set_vnni(True)


def test_the_cpp_kernels_build_wherever_the_cpu_and_a_compiler_allow() -> None:
    """Dozens of tests skip where a C++ build is missing, so a build broken on a machine that should build it would
    pass the suite with them all skipped (65 skipped instead of 16 once, unnoticed). Where the CPU has a build's
    flags and torch finds a C++ compiler (and ``M2R2_NO_AMX=1`` does not keep the kernels off), the build must load."""
    if os.environ.get(amx.DISABLE_ENV) == "1":
        pytest.skip("the C++ kernels are turned off (M2R2_NO_AMX=1)")
    from torch.utils.cpp_extension import get_cxx_compiler

    if shutil.which(get_cxx_compiler()) is None:
        pytest.skip("no C++ compiler here")
    if all(cpu_has(f) for f in amx.AVX2_CPU_FLAGS):
        assert amx.avx2_extension() is not None, "the AVX2 build (csrc_avx2/) failed on a CPU that runs it"
    if all(cpu_has(f) for f in amx.CPU_FLAGS):
        assert amx.extension() is not None, "the AVX-512 build (csrc/) failed on a CPU that runs it"


@needs_avx2
@pytest.mark.parametrize("bits", [4, 8])
def test_avx2_amx_tile_sums_give_the_vnni_loop_s_bits(bits: int) -> None:
    """On an AMX-INT8 CPU passes of 10 rows or more sum their byte products on AMX tiles (``q4_amx_rows.cpp``,
    16 rows a tile, 16 groups of 32 inputs staged at a time): the same integers as the VNNI loop, so every row
    gets the same bits either way, inputs at the int8 extremes included. 1,536 inputs: 48 groups, three staged
    runs; 40 rows: two full tiles and one of 8."""
    ext = amx.avx2_extension()
    if not ext.set_amx_rows(True):
        ext.set_amx_rows(False)
        pytest.skip("no AMX-INT8 on this CPU")
    lin, _ = q4_1_layer(192, 1536, seed=31) if bits == 4 else q8_0_layer(192, 1536, seed=32)
    layer = (AmxInt4Linear if bits == 4 else AmxInt8Linear)(lin, products="avx2")
    g = torch.Generator().manual_seed(33)
    extreme = torch.where(torch.rand(40, 1536, generator=g) < 0.5, -3.0, 3.0)  # every input rounds to +-127
    try:
        for x in (torch.randn(40, 1536, generator=g) * 4, extreme):
            for rows in (1, 9, 10, 11, 16, 17, 40):
                xb = x[:rows].to(torch.bfloat16)
                ext.set_amx_rows(True)
                on = layer(xb)
                ext.set_amx_rows(False)
                assert torch.equal(on, layer(xb))
                assert torch.equal(on[:1], layer(xb[:1]))  # and the first row's one-row bits
    finally:
        ext.set_amx_rows(True)


@pytest.mark.parametrize("products", PRODUCTS)
def test_amx_and_avx512_sum_the_same_weights(products: str) -> None:
    """The two ways of summing agree to float32 summation order: both apply the same integers, steps
    and minima (a different summation order may move a bf16 output by a unit in its last place)."""
    if not amx.amx_available():
        pytest.skip("needs both kernels (an AMX CPU)")
    lin, _ = q4_1_layer(192, 96, seed=7)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    a, b = (AmxInt4Linear(lin, products=p)(x).float() for p in ("amx", products))
    assert ((a - b).abs() <= a.abs() * 2.0**-7 + 1e-6).all()


@needs_amx
def test_on_an_amx_cpu_auto_takes_q4_avx2_and_q4_amx_runs_where_asked(tiny_model, monkeypatch) -> None:
    """On a Sapphire Rapids class Xeon the fused AVX2 build decoded 2.3x faster than ``q4-amx`` (BENCHMARKS.md,
    "Twenty-ninth round"), so ``auto`` takes it there too; ``q4-amx`` runs where asked, and is ``auto``'s choice
    only where the AVX2 build is missing."""
    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320)
    loaded = load_model(d, torch.bfloat16, kernel="q4-amx")
    assert loaded.kernel == "q4-amx" and isinstance(loaded.model.layers[0].mlp.w2, AmxInt4Linear)
    assert isinstance(loaded.model.lm_head, AmxInt8Linear)  # the head as 8-bit blocks
    odd = load_model(tiny_model(hidden_size=64, intermediate_size=128, vocab_size=300), torch.bfloat16, kernel="q4-amx")
    assert isinstance(odd.model.lm_head, PackedLinear)  # a vocabulary not in blocks of 64: bf16 head
    if amx.avx2_extension() is not None:
        assert load_model(d, torch.bfloat16, kernel="auto").kernel == "q4-avx2"
    with monkeypatch.context() as m:
        m.setattr(amx, "avx2_extension", lambda: None)
        assert load_model(d, torch.bfloat16, kernel="auto").kernel == "q4-amx"
    monkeypatch.setattr(amx, "available", lambda: False)  # no AVX512-BF16 and no AVX2 build: q4
    monkeypatch.setattr(amx, "amx_available", lambda: False)
    monkeypatch.setattr(amx, "avx2_extension", lambda: None)  # no compiler at all: auto falls back to q4
    loaded = load_model(d, torch.bfloat16, kernel="auto")
    assert loaded.kernel == "q4" and isinstance(loaded.model.lm_head, PackedLinear)


@pytest.mark.skipif(not amx.available(), reason="no AVX512-BF16 CPU or no C++ compiler here")
def test_without_amx_auto_takes_q4_avx2_then_q4_avx512(tiny_model, monkeypatch) -> None:
    """A CPU with AVX512-BF16 but no AMX (AMD Zen 4/5): ``auto`` runs the AVX2 build (its blocks fused, the
    faster path measured on a Zen 4); without that build, the AVX-512 kernel's dot-product path, the head on
    its 8-bit blocks too; ``q4-amx`` says why it cannot run."""
    monkeypatch.setattr(amx, "amx_available", lambda: False)
    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320)
    if amx.avx2_extension() is not None:
        assert load_model(d, torch.bfloat16, kernel="auto").kernel == "q4-avx2"
    monkeypatch.setattr(amx, "avx2_extension", lambda: None)
    loaded = load_model(d, torch.bfloat16, kernel="auto")
    assert loaded.kernel == "q4-avx512"
    w2, head = loaded.model.layers[0].mlp.w2, loaded.model.lm_head
    assert isinstance(w2, AmxInt4Linear) and w2.op == "q4_linear_avx512"
    assert isinstance(head, AmxInt8Linear) and head.op == "q8_linear_avx512"
    with pytest.raises(SettingsError, match="needs a CPU with AMX"):
        load_model(d, torch.bfloat16, kernel="q4-amx")


@pytest.mark.parametrize("kernel", ["q4-amx", "q4-avx512", "q4-avx2"])
def test_without_the_cpp_kernels_q4_native_says_why(tiny_model, monkeypatch, kernel: str) -> None:
    monkeypatch.setattr(amx, "available", lambda: False)
    monkeypatch.setattr(amx, "avx2_extension", lambda: None)
    d = tiny_model(hidden_size=64, intermediate_size=128)
    with pytest.raises(
        SettingsError, match="needs a CPU with AVX2" if kernel == "q4-avx2" else "needs a CPU with (AMX|AVX512-BF16)"
    ):
        load_model(d, torch.bfloat16, kernel=kernel)


@needs_avx2
def test_without_avx512_auto_takes_q4_avx2(tiny_model, monkeypatch) -> None:
    """A CPU with AVX2 but no AVX-512 (AMD Zen 3): ``auto`` runs the AVX2 kernels, the head on its 8-bit
    blocks too, and greedy decoding with them is lossless for every speculative method (other tests)."""
    monkeypatch.setattr(amx, "available", lambda: False)
    monkeypatch.setattr(amx, "amx_available", lambda: False)
    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320)
    loaded = load_model(d, torch.bfloat16, kernel="auto")
    assert loaded.kernel == "q4-avx2"
    w2, head = loaded.model.layers[0].mlp.w2, loaded.model.lm_head
    assert isinstance(w2, AmxInt4Linear) and w2.op == "q4_linear_avx2"
    assert isinstance(head, AmxInt8Linear) and head.op == "q8_linear_avx2"


def test_q4_amx_refuses_widths_it_does_not_take(tiny_model) -> None:
    """A layer of 32 output columns (the kernel works in blocks of 64): a clear error, not a crash."""
    d = tiny_model(hidden_size=32, intermediate_size=64)
    with pytest.raises(SettingsError, match="divisible by 64"):
        load_model(d, torch.bfloat16, kernel="q4-amx")


#: each build of the per-row helpers, where this CPU runs it (AVX-512 ``csrc/``, AVX2 ``csrc_avx2/``)
HELPERS = [
    pytest.param(
        amx.extension, id="avx512", marks=pytest.mark.skipif(amx.extension() is None, reason="no AVX-512 build here")
    ),
    pytest.param(amx.avx2_extension, id="avx2", marks=needs_avx2),
]


@pytest.mark.parametrize("ext", HELPERS)
@pytest.mark.parametrize("threads", [1, 2])
def test_row_attention_bits_do_not_depend_on_where_keys_sit(threads: int, ext) -> None:
    """A row that sees the prefix and a few keys scattered after it (a tree row) gets the bits it gets
    with those keys packed right after the prefix (decoding's layout); values match float32 SDPA."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, d, s, prefix = 6, 2, 64, 96, 70
    k = torch.randn(1, kv_heads, s, d, generator=g)
    v = torch.randn(1, kv_heads, s, d, generator=g)
    q = torch.randn(1, heads, 5, d, generator=g)
    slots = [[], [72], [72, 75], [71, 80, 93], [74]]  # each row's keys after the prefix, scattered
    gapped = torch.zeros(1, 5, s, dtype=torch.bool)
    gapped[..., :prefix] = True
    for r, extra in enumerate(slots):
        gapped[0, r, extra] = True
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ext().row_attention(q, k, v, gapped, d**-0.5)
        for r, extra in enumerate(slots):
            order = list(range(prefix)) + extra + [i for i in range(s) if i >= prefix and i not in extra]
            packed = torch.zeros(1, 1, s, dtype=torch.bool)
            packed[..., : prefix + len(extra)] = True
            alone = ext().row_attention(
                q[:, :, r : r + 1].contiguous(),
                k[:, :, order].contiguous(),
                v[:, :, order].contiguous(),
                packed,
                d**-0.5,
            )
            assert torch.equal(out[:, r : r + 1], alone), f"row {r}"
            ref = F.scaled_dot_product_attention(
                q[:, :, r : r + 1], k, v, attn_mask=gapped[:, r : r + 1], enable_gqa=True
            ).transpose(1, 2)
            assert torch.allclose(out[:, r : r + 1], ref, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("ext", HELPERS)
def test_row_attention_reads_a_bfloat16_cache_as_its_float32_widening(ext) -> None:
    """The cache is read in place: bfloat16 keys and values give the bits of their exact float32 copies,
    for head sizes with a partial last chunk of 16 and for allowed-key counts off a multiple of 16."""
    g = torch.Generator().manual_seed(9)
    for heads, kv_heads, d, s in ((9, 3, 64, 53), (4, 2, 80, 16), (8, 1, 8, 31)):
        k = torch.randn(2, kv_heads, s, d, generator=g).bfloat16()
        v = torch.randn(2, kv_heads, s, d, generator=g).bfloat16()
        q = torch.randn(2, heads, 3, d, generator=g)
        mask = torch.rand(2, 3, s, generator=g) < 0.6
        mask[..., 0] = True
        out = ext().row_attention(q, k, v, mask, d**-0.5)
        assert torch.equal(out, ext().row_attention(q, k.float(), v.float(), mask, d**-0.5))
        ref = F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=mask[:, None], enable_gqa=True)
        assert torch.allclose(out, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ext", HELPERS)
@pytest.mark.parametrize("threads", [1, 2])
def test_row_attention_rows_sharing_a_prefix_get_their_lone_bits(threads: int, ext) -> None:
    """Rows whose key lists share a long prefix share its loads (one item scores a block for all their
    heads, transposed from 12 query vectors on): each row still gets the bits of its one-row call, for
    1-16 rows (several items of up to 8 rows), bfloat16 and float32 caches, and rows with no key at all."""
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, d, s, prefix = 9, 3, 64, 140, 101
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 4, 5, 8, 9, 16):
            for dtype in (torch.bfloat16, torch.float32):
                k = torch.randn(1, kv_heads, s, d, generator=g).to(dtype)
                v = torch.randn(1, kv_heads, s, d, generator=g).to(dtype)
                q = torch.randn(1, heads, rows, d, generator=g)
                mask = torch.zeros(1, rows, s, dtype=torch.bool)
                mask[..., :prefix] = True
                mask[..., prefix:] = torch.rand(1, rows, s - prefix, generator=g) < 0.15
                if rows == 9:
                    mask[0, 3] = False  # a row that sees nothing (its group then shares no block)
                out = ext().row_attention(q, k, v, mask, d**-0.5)
                for r in range(rows):
                    alone = ext().row_attention(
                        q[:, :, r : r + 1].contiguous(), k, v, mask[:, r : r + 1].contiguous(), d**-0.5
                    )
                    assert torch.equal(out[:, r : r + 1], alone), (rows, dtype, r)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("ext", HELPERS)
def test_row_attention_takes_empty_passes(ext) -> None:
    """No rows, or no keys: an empty result, or zeros (a row with no key attends nothing)."""
    q, k = torch.zeros(1, 9, 0, 64), torch.zeros(1, 3, 10, 64, dtype=torch.bfloat16)
    assert ext().row_attention(q, k, k, torch.zeros(1, 0, 10, dtype=torch.bool), 0.125).shape == (1, 0, 9, 64)
    q, k = torch.randn(1, 9, 2, 64), torch.zeros(1, 3, 0, 64, dtype=torch.bfloat16)
    out = ext().row_attention(q, k, k, torch.zeros(1, 2, 0, dtype=torch.bool), 0.125)
    assert out.shape == (1, 2, 9, 64) and not out.any()


@pytest.mark.parametrize("ext", HELPERS)
def test_row_attention_batches_sequences_exactly(ext) -> None:
    """Several sequences (batch items, own keys and mask each) get the bits of their lone calls."""
    g = torch.Generator().manual_seed(8)
    k, v = torch.randn(3, 3, 40, 64, generator=g), torch.randn(3, 3, 40, 64, generator=g)
    q = torch.randn(3, 9, 1, 64, generator=g)
    mask = torch.arange(40)[None, None, :] < torch.tensor([5, 40, 17])[:, None, None]
    out = ext().row_attention(q, k, v, mask, 0.125)
    for b in range(3):
        alone = ext().row_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], mask[b : b + 1], 0.125)
        assert torch.equal(out[b : b + 1], alone)


@needs_avx2
@pytest.mark.parametrize("threads", [1, 2])
def test_avx512_row_attention_gives_the_avx2_attention_s_bits(threads: int) -> None:
    """On a CPU with AVX512-BF16 a bfloat16 cache and bfloat16 queries (a bfloat16 model's) run the row attention's
    AVX-512 build (``attend_avx512.cpp``: scores by VDPBF16PS, weighted values 16 lanes at a time): every output
    has the AVX2 path's bits, for SmolLM2's, Qwen's and one-query-per-key layouts, head sizes 64-256, key counts
    off a multiple of four, random and tree masks, and rows that allow no key. Queries off bfloat16 and float32
    caches keep the AVX2 path."""
    ext = amx.avx2_extension()
    if not ext.set_avx512_attention(True):
        ext.set_avx512_attention(False)
        pytest.skip("no AVX512-BF16 on this CPU")
    g = torch.Generator().manual_seed(31)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    tiles = ext.set_amx_attention(False)  # the AMX scores sum in their own order (the next test)
    try:
        for (heads, kv_heads), d, s, t in itertools.product(
            [(9, 3), (14, 2), (4, 4), (8, 1)], [64, 128, 256], [1, 6, 53, 301], [1, 3, 6]
        ):
            q = (torch.randn(1, heads, t, d, generator=g) * 3).bfloat16().float()
            k = (torch.randn(1, kv_heads, s, d, generator=g) * 2).bfloat16()
            v = torch.randn(1, kv_heads, s, d, generator=g).bfloat16()
            mask = torch.rand(1, t, s, generator=g) < 0.8
            if s > t:  # a verify pass's tree: the prefix, then each row's ancestors among the pass's rows
                mask[..., : s - t] = True
                mask[..., s - t :] = torch.rand(t, t, generator=g).tril() < 0.6
            mask[0, 0] = False  # a row that allows no key
            outs = []
            for wide in (True, False):
                ext.set_avx512_attention(wide)
                outs.append(ext.row_attention(q, k, v, mask, d**-0.5))
            assert torch.equal(outs[0], outs[1]), (heads, kv_heads, d, s, t)
        ext.set_avx512_attention(True)
        q = torch.randn(1, 9, 2, 64, generator=g)  # off bfloat16: the AVX2 path either way
        k, v = torch.randn(2, 1, 3, 40, 64, generator=g)
        mask = torch.ones(1, 2, 40, dtype=torch.bool)
        for cache in (k.bfloat16(), k):
            ext.set_avx512_attention(True)
            on = ext.row_attention(q, cache, v.to(cache.dtype), mask, 0.125)
            ext.set_avx512_attention(False)
            assert torch.equal(on, ext.row_attention(q, cache, v.to(cache.dtype), mask, 0.125))
    finally:
        ext.set_avx512_attention(True)
        ext.set_amx_attention(tiles)
        torch.set_num_threads(before)


@needs_avx2
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_row_attention_keeps_each_row_s_bits_and_the_avx512_path_below_its_threshold(threads: int) -> None:
    """On a CPU with AMX-BF16 a query vector that sees at least ``set_amx_attention_min_keys`` keys has its scores
    summed on tiles (``attend_amx.cpp``), 16 keys by up to 16 vectors of a key head's rows at a time: every row of a
    pass gets the bits of its lone call (lossless verification), for SmolLM2's, Qwen's and one-query-per-key layouts,
    head sizes 64-256, tree masks and rows that see no key; the outputs stay within float32 rounding of the AVX-512
    path's, and rows under the threshold keep that path's bits."""
    ext = amx.avx2_extension()
    if not ext.set_amx_attention(True):
        ext.set_amx_attention(False)
        pytest.skip("no AMX-BF16 on this CPU")
    g = torch.Generator().manual_seed(37)
    before, least_before = torch.get_num_threads(), ext.set_amx_attention_min_keys(512)
    torch.set_num_threads(threads)
    try:
        for least in (1, 40, 512):
            ext.set_amx_attention_min_keys(least)
            for (heads, kv_heads), d, s, t in itertools.product(
                [(9, 3), (14, 2), (4, 4), (8, 1)], [64, 128, 256], [6, 53, 301, 530], [1, 3, 6]
            ):
                q = (torch.randn(1, heads, t, d, generator=g) * 3).bfloat16().float()
                k = (torch.randn(1, kv_heads, s, d, generator=g) * 2).bfloat16()
                v = torch.randn(1, kv_heads, s, d, generator=g).bfloat16()
                mask = torch.ones(1, t, s, dtype=torch.bool)
                mask[..., s - t :] = torch.rand(t, t, generator=g).tril() < 0.6  # a tree over the pass's rows
                mask[0, 0] = False  # a row that sees no key
                tiled = ext.row_attention(q, k, v, mask, d**-0.5)
                for r in range(t):
                    alone = ext.row_attention(
                        q[:, :, r : r + 1].contiguous(), k, v, mask[:, r : r + 1].contiguous(), d**-0.5
                    )
                    assert torch.equal(tiled[:, r : r + 1], alone), (least, heads, kv_heads, d, s, t, r)
                assert not tiled[:, 0].any()
                ext.set_amx_attention(False)
                wide = ext.row_attention(q, k, v, mask, d**-0.5)
                ext.set_amx_attention(True)
                torch.testing.assert_close(tiled, wide, rtol=1e-5, atol=1e-5)
                seen = mask[0].sum(-1)
                for r in range(t):
                    if seen[r] < least:
                        assert torch.equal(tiled[:, r], wide[:, r]), (least, s, t, r)
                if least == 1 and s > 6 and t > 1:  # not vacuous: the tiles' order of additions shows in some bits
                    assert not torch.equal(tiled[:, 1:], wide[:, 1:])
    finally:
        ext.set_amx_attention_min_keys(least_before)
        torch.set_num_threads(before)


@pytest.mark.parametrize("ext", HELPERS)
def test_rms_norm_rows_alone_in_hf_order(ext) -> None:
    """The C++ RMSNorm follows HF Llama's bfloat16 order (float32 statistics, round, times the weight,
    round) and a row's bits do not depend on the rows around it (verify passes, batched steps)."""
    g = torch.Generator().manual_seed(10)
    for d in (576, 80, 7):
        x = (torch.randn(4, 3, d, generator=g) * 3).bfloat16()
        w = torch.randn(d, generator=g).bfloat16()
        out = ext().rms_norm(x, w, 1e-5)
        xf = x.float()
        ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
        assert torch.allclose(out.float(), ref.float(), rtol=2**-7, atol=0)  # float32 sums may differ in order
        for i in range(4):
            assert torch.equal(ext().rms_norm(x[i, 1:2].contiguous(), w, 1e-5), out[i, 1:2])
    if ext() is amx.row_helpers():  # the model's norm runs this CPU's own build
        model_norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
        x = torch.randn(2, 5, 576, generator=g).bfloat16()
        with torch.no_grad():
            assert torch.equal(model_norm(x), ext().rms_norm(x, model_norm.weight, 1e-5))


@pytest.mark.parametrize("ext", HELPERS)
def test_argmax_rows_picks_what_torch_picks(ext) -> None:
    """First of equal maxima, the first NaN as the maximum, all -inf rows, partial chunks of 16."""
    g = torch.Generator().manual_seed(11)
    for v in (1, 7, 33, 49152):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(6, v, generator=g).to(dtype)
            if v > 20:
                x[1, 5] = x[1].max()
                x[1, 17] = x[1, 5]
                x[2, 3] = x[2, 9] = float("nan")
                x[3] = float("-inf")
                x[4] = 1.0
            assert torch.equal(ext().argmax_rows(x), x.argmax(-1))
            assert torch.equal(argmax_rows(x), x.argmax(-1))
            assert torch.equal(argmax_rows(x[0]), x[0].argmax(-1))


def test_a_killed_builds_lock_is_dropped_a_live_ones_kept(tmp_path, capsys) -> None:
    """torch's extension builder waits forever on a lock a killed build left behind; one older than a
    build can take is removed (and said), a fresh one is another process building: kept."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    amx._drop_stale_lock(lock)
    assert lock.exists()
    old = time.time() - amx.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    amx._drop_stale_lock(lock)
    assert not lock.exists() and "stale C++ build lock" in capsys.readouterr().err
    amx._drop_stale_lock(lock)  # none there: nothing to do


def test_a_build_s_key_does_not_depend_on_what_was_built_before(tmp_path, monkeypatch) -> None:
    """torch's builder appends its own link flags to the list it is given; handed the module's own
    LDFLAGS, the next build in the process got another key and compiled again (~30 s, once per order)."""
    import types

    import torch.utils.cpp_extension as cpp_extension

    def fake_load(name, sources, extra_cflags, extra_ldflags, build_directory):
        extra_cflags.append("-fgrown")
        extra_ldflags.append("-lgrown")  # what torch's load does to the list
        return types.SimpleNamespace(usable=lambda: True, __name__=name)

    monkeypatch.setenv("M2R2_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    flags_before, ld_before = list(amx.AVX2_FLAGS), list(amx.LDFLAGS)
    first = amx._build("q4_avx2", amx.AVX2_SOURCES, amx.AVX2_HEADERS, amx.AVX2_FLAGS).__name__
    amx._build("q4_amx", amx.SOURCES, amx.HEADERS, amx.FLAGS)
    assert amx._build("q4_avx2", amx.AVX2_SOURCES, amx.AVX2_HEADERS, amx.AVX2_FLAGS).__name__ == first
    after = (amx.AVX2_FLAGS, amx.LDFLAGS)
    assert after == (flags_before, ld_before)


@needs_avx2
def test_avx512_swiglu_gives_the_avx2_product_s_bits() -> None:
    """On a CPU with AVX-512 SwiGLU's product runs 16 lanes at a time (``silu_avx512.cpp``): every output has the
    AVX2 path's bits, for rows of widths off a multiple of 8 and 16, values past exp's clamps, zeros of both signs,
    subnormals, infinities and the largest bfloat16 values (the fused block calls the same range function)."""
    ext = amx.avx2_extension()
    if not ext.set_avx512_silu(True):
        ext.set_avx512_silu(False)
        pytest.skip("no AVX-512 on this CPU")
    g = torch.Generator().manual_seed(47)
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 88.5, -88.5, 100.0, -100.0, 3e38, -3e38, 1.0, -1.0])
    special = torch.cat([special, torch.tensor([float("inf"), float("-inf")])])
    try:
        for rows, m in itertools.product([1, 3, 17], [1, 5, 8, 16, 37, 1536]):
            gu = (torch.randn(rows, 2 * m, generator=g) * 6).bfloat16()
            n = min(special.numel(), gu.numel())
            gu.view(-1)[:n] = special[:n].bfloat16()
            outs = []
            for wide in (True, False):
                ext.set_avx512_silu(wide)
                outs.append(ext.silu_mul(gu).view(torch.int16))
            assert torch.equal(outs[0], outs[1]), (rows, m)
    finally:
        ext.set_avx512_silu(True)
