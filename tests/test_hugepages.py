"""The C++ kernels' packed weights gathered into one buffer on huge pages (``m2r2.hugepages``): the same bytes and
outputs, one allocation in the order given, 2 MB aligned; the engine's models and fast streams get it on load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from m2r2 import amx, hugepages
from m2r2.kernels import AmxInt4Linear, AmxInt8Linear, _AmxLinear
from m2r2.loading import load_model

needs_avx2 = pytest.mark.skipif(amx.avx2_extension() is None, reason="no AVX2 CPU or no C++ compiler here")


def _layer(kind: type, n: int, k: int, seed: int) -> _AmxLinear:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    return kind(lin, products="avx2")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@needs_avx2
def test_gather_keeps_every_output_and_lays_the_weights_out_in_order() -> None:
    """Each layer's output is the same bits after its weights move (4- and 8-bit, pairs of blocks and an odd
    last block), all weights share one 2 MB-aligned allocation, each starting on a cache line, in the order given;
    the old tensors are no longer the modules'."""
    layers = [_layer(AmxInt4Linear, 200, 96, 1), _layer(AmxInt8Linear, 192, 64, 2), _layer(AmxInt4Linear, 64, 128, 3)]
    xs = [torch.randn(5, lin.in_features, generator=torch.Generator().manual_seed(4)).bfloat16() for lin in layers]
    before = [lin(x) for lin, x in zip(layers, xs, strict=True)]
    old = [lin.qbytes for lin in layers]
    advised = hugepages.gather(layers)
    assert isinstance(advised, bool)
    if sys.platform.startswith("linux") and "[never]" not in _thp_mode():
        assert advised  # Linux accepts the advice wherever transparent huge pages are on
    for lin, x, want, q in zip(layers, xs, before, old, strict=True):
        assert torch.equal(lin(x), want)
        assert lin.qbytes is not q and torch.equal(lin.qbytes, q)
    tensors = [t for lin in layers for t in (lin.qbytes, lin.scales)]
    assert len({_storage(t) for t in tensors}) == 1
    starts = [t.data_ptr() for t in tensors]
    assert starts == sorted(starts) and all(p % hugepages.ALIGN == 0 for p in starts)
    if advised:  # the buffer starts on a huge page
        assert starts[0] % hugepages.HUGE_PAGE == 0


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.read_text() if path.exists() else "[never]"


def test_gather_takes_only_contiguous_cpu_tensors() -> None:
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qbytes = torch.zeros(4, 6, dtype=torch.uint8).t()  # not contiguous
            self.scales = torch.zeros(4, dtype=torch.half)

    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        hugepages.gather([Holder()])
    assert hugepages.gather([]) is False


@needs_avx2
def test_a_model_on_the_cpp_kernels_has_its_packed_weights_in_one_buffer(tiny_model) -> None:
    """``use_kernels`` gathers every block's linears (q/k/v, output, gate|up, down, block by block) and the
    8-bit head, in that order, into one buffer."""
    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320)
    model = load_model(d, torch.bfloat16, kernel="q4-avx2").model
    order = [m for b in model.layers for m in (b.attn.wqkv, b.attn.wo, b.mlp.w13, b.mlp.w2)] + [model.lm_head]
    assert all(isinstance(m, _AmxLinear) for m in order)
    assert len({_storage(m.qbytes) for m in order}) == 1
    starts = [m.qbytes.data_ptr() for m in order]
    assert starts == sorted(starts)
