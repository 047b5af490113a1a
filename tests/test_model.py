"""Forward-pass invariants of our Transformer on tiny random models (fp32, plain kernels).

Tolerance: ``atol=1e-5`` between two ways of computing the same fp32 logits (values O(1..10));
different matmul shapes round differently, so bit equality is not expected.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_VOCAB
from m2r2.loading import load_model
from m2r2.model import Transformer

ATOL = 1e-5
ARCH_CASES = [
    {"arch": "llama"},
    {"arch": "qwen2", "tie": True},
    {"arch": "mistral", "sliding_window": 8},
]
ARCH_IDS = ["llama", "qwen2-tied", "mistral-window8"]


def load(model_dir) -> Transformer:
    return load_model(model_dir, torch.float32, kernel="plain").model


def rand_tokens(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=ARCH_CASES, ids=ARCH_IDS)
def model(request, tiny_model) -> Transformer:
    return load(tiny_model(**request.param))


@torch.inference_mode()
def test_multi_token_forward_equals_token_by_token(model: Transformer) -> None:
    n = 24  # > the mistral window of 8, so the windowed one-token mask is exercised too
    ids = rand_tokens(n)
    full_cache = model.new_cache(n)
    full = model(ids, full_cache, 0)
    step_cache = model.new_cache(n)
    steps = torch.cat([model(ids[:, i : i + 1], step_cache) for i in range(n)], dim=1)
    assert full_cache.length == step_cache.length == n
    torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)
    torch.testing.assert_close(step_cache.k, full_cache.k, atol=ATOL, rtol=0)
    torch.testing.assert_close(step_cache.v, full_cache.v, atol=ATOL, rtol=0)
    assert full_cache.k.abs().sum() > 0


@torch.inference_mode()
def test_chunked_prefill_equals_one_shot(model: Transformer) -> None:
    ids = rand_tokens(30, seed=1)
    ref = model(ids, model.new_cache(30), 0)
    cache = model.new_cache(30)
    chunks = [model(ids[:, a : a + 7], cache) for a in range(0, 30, 7)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), ref, atol=ATOL, rtol=0)


@torch.inference_mode()
def test_causality(model: Transformer) -> None:
    ids = rand_tokens(20, seed=2)
    other = ids.clone()
    other[0, 12] = (other[0, 12] + 1) % TINY_VOCAB
    a = model(ids, model.new_cache(20), 0)
    b = model(other, model.new_cache(20), 0)
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=0, rtol=0)
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3


@torch.inference_mode()
def test_last_only(model: Transformer) -> None:
    ids = rand_tokens(9, seed=3)
    full = model(ids, model.new_cache(9), 0)
    last = model(ids, model.new_cache(9), 0, last_only=True)
    assert last.shape == (1, 1, TINY_VOCAB) and last.dtype == torch.float32
    torch.testing.assert_close(last, full[:, -1:], atol=ATOL, rtol=0)


@torch.inference_mode()
def test_batch_of_two_equals_two_single_runs(model: Transformer) -> None:
    ids = rand_tokens(16, batch=2, seed=4)
    cache = model.new_cache(20, batch=2)
    assert cache.batch == 2
    both = model(ids, cache, 0)
    nxt = torch.tensor([[5], [7]])
    both_step = model(nxt, cache)
    for b in range(2):
        single_cache = model.new_cache(20)
        single = model(ids[b : b + 1], single_cache, 0)
        single_step = model(nxt[b : b + 1], single_cache)
        torch.testing.assert_close(both[b : b + 1], single, atol=ATOL, rtol=0)
        torch.testing.assert_close(both_step[b : b + 1], single_step, atol=ATOL, rtol=0)
        torch.testing.assert_close(cache.k[:, b : b + 1, :, :17], single_cache.k[:, :, :, :17], atol=ATOL, rtol=0)
    assert (both[0] - both[1]).abs().max() > 1e-3


@torch.inference_mode()
def test_sliding_window_matches_transformers_beyond_window(tiny_model) -> None:
    """Mistral with a window of 8, decoded one token at a time to position 40, against HF's full forward."""
    from transformers import AutoModelForCausalLM

    d = tiny_model(arch="mistral", sliding_window=8)
    ours = load(d)
    n = 40
    ids = rand_tokens(n, seed=5)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()(ids).logits
    cache = ours.new_cache(n)
    prefill = ours(ids[:, :4], cache, 0)
    steps = [ours(ids[:, i : i + 1], cache) for i in range(4, n)]
    got = torch.cat([prefill, *steps], dim=1)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)

    # Guard: the window must matter here, or the comparison above proves nothing about masking.
    ours.cfg.sliding_window = None
    unwindowed = ours(ids, ours.new_cache(n), 0)
    assert (unwindowed[:, :8] - ref[:, :8]).abs().max() < 1e-4
    assert (unwindowed[:, 10:] - ref[:, 10:]).abs().max() > 1e-2


@torch.inference_mode()
def test_bf16_plain_runs_and_returns_float32_logits(tiny_model) -> None:
    d = tiny_model(arch="llama")
    m16 = load_model(d, torch.bfloat16, kernel="plain").model
    m32 = load(d)
    ids = rand_tokens(12, seed=6)
    a = m16(ids, m16.new_cache(12), 0)
    b = m32(ids, m32.new_cache(12), 0)
    assert m16.dtype == torch.bfloat16 and a.dtype == torch.float32
    assert (a - b).abs().max() < 0.25 * b.abs().max()


def test_q4_kernel_recovers_q4_1_weights_exactly() -> None:
    """Weights built like GGUF Q4_1 blocks (``d * q + m``) come back bit for bit through the 4-bit kernel.

    ``d`` and ``m`` are powers-of-two multiples so every weight, scale and zero is exact in bf16; a
    one-hot input row then reads one weight column straight out of the kernel.
    """
    from m2r2.kernels import Int4Linear

    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("the 4-bit CPU kernel is unavailable here")
    g = torch.Generator().manual_seed(0)
    n, k = 48, 96
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0.0, 15.0  # Q4_1 maps each block's min and max to 0 and 15
    d = 2.0 ** -torch.randint(4, 8, (n, k // 32, 1), generator=g).float()
    m = -torch.randint(0, 64, (n, k // 32, 1), generator=g).float() / 64
    w = (q * d + m).view(n, k)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = w.to(torch.bfloat16)
    q4 = Int4Linear(lin)
    eye = torch.eye(k, dtype=torch.bfloat16)
    assert torch.equal(q4(eye).float(), w.t())
    # a row's result does not depend on the other rows of the pass (lossless verification)
    x = torch.randn(7, k, generator=g).to(torch.bfloat16)
    assert torch.equal(torch.cat([q4(x[i : i + 1]) for i in range(7)]), q4(x))


def test_q4_kernel_recovers_q4_k_weights_exactly_and_flags_other_grids() -> None:
    """Q4_K sub-blocks (``w = s * q - m``, ``q`` in 0..15, but 15 or 0 often unused) come back bit for bit;
    a 6-bit grid (Q6_K) is not 4-bit: quantised (lossy) and flagged ``exact = False``."""
    from m2r2.kernels import Int4Linear

    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("the 4-bit CPU kernel is unavailable here")
    g = torch.Generator().manual_seed(1)
    n, k = 64, 128
    top = torch.randint(9, 16, (n, k // 32, 1), generator=g)  # the largest q a block uses
    bottom = torch.randint(0, 3, (n, k // 32, 1), generator=g)  # the smallest
    q = bottom + (torch.rand(n, k // 32, 32, generator=g) * (top - bottom + 1)).floor().clamp(max=top - bottom)
    d = 2.0 ** -torch.randint(4, 8, (n, k // 32, 1), generator=g).float()
    m = torch.randint(0, 64, (n, k // 32, 1), generator=g).float() / 64
    w = (q * d - m).view(n, k)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = w.to(torch.bfloat16)
    q4 = Int4Linear(lin, w)
    assert q4.exact and torch.equal(q4(torch.eye(k, dtype=torch.bfloat16)).float(), w.t())
    six = (torch.randint(0, 64, (n, k), generator=g).float() - 32) / 256
    lin.weight.data = six.to(torch.bfloat16)
    lossy = Int4Linear(lin, six)
    assert not lossy.exact and not torch.equal(lossy(torch.eye(k, dtype=torch.bfloat16)).float(), six.t())


def test_auto_kernel_prefers_q4_for_bf16_on_cpu(tiny_model) -> None:
    from m2r2.kernels import mkldnn_usable, q4_usable

    d = tiny_model(hidden_size=64)
    plain = load_model(d, torch.bfloat16, kernel="plain").model
    expected = "q4" if q4_usable(plain) else "mkldnn" if mkldnn_usable(plain) else "plain"
    assert load_model(d, torch.bfloat16, kernel="auto").kernel == expected
    assert load_model(d, torch.float32, kernel="auto").kernel == "plain"


@pytest.mark.parametrize("kernel", ["plain", "q4-avx2"])
def test_greedy_vanilla_reads_the_head_s_own_logits_and_picks_the_same_tokens(tiny_model, kernel: str) -> None:
    """``float_logits=False`` hands greedy decoding the head's own output (bf16 here): widening it is exact, so
    it is the float32 logits' values and argmax, and `vanilla` gives the tokens it gave with float32 logits."""
    from m2r2 import amx
    from m2r2.decoding.autoregressive import Autoregressive
    from m2r2.decoding.base import GenerationConfig

    if kernel == "q4-avx2" and amx.avx2_extension() is None:
        pytest.skip("no AVX2 CPU or no C++ compiler here")
    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320, layers=3)
    model = load_model(d, torch.bfloat16, kernel=kernel).model
    ids = torch.arange(1, 20)[None]
    own = model(ids, model.new_cache(64), 0, float_logits=False)
    ref = model(ids, model.new_cache(64), 0)
    assert own.dtype == torch.bfloat16 and torch.equal(own.float(), ref)
    vanilla = Autoregressive(model, [])
    greedy, asked_float = GenerationConfig(max_new_tokens=24), []
    float_head = model.head

    def widened(h, float_logits=True):
        asked_float.append(float_logits)
        return float_head(h, True)

    out = vanilla.generate([3, 5, 7], greedy).tokens
    model.head = widened  # every step through float32 logits, as before
    try:
        assert vanilla.generate([3, 5, 7], greedy).tokens == out
    finally:
        del model.head
    assert asked_float and not any(asked_float[1:])  # the loop asked for the head's own logits after the prompt
