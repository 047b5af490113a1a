"""The fused decoder block of the AVX2 build (``csrc_avx2/block_avx2.cpp``): a block's passes of a few rows
in one C++ call give every row, and the cache, the bits of the per-op path (so lossless verification and
the server's batched steps, which keep the per-op path, are unaffected), and it steps aside where it does
not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from m2r2 import amx
from m2r2 import model as model_mod
from m2r2.decoding.base import GenerationConfig
from m2r2.loading import load_model
from m2r2.model import swiglu

needs_avx2 = pytest.mark.skipif(
    amx.avx2_extension() is None or amx.row_helpers() is not amx.avx2_extension(),
    reason="the AVX2 build is not this CPU's row-helper build",
)


def passes(model, fused: bool, store: torch.dtype | None, monkeypatch) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Final states of decode-style passes of 1..6 rows and a token tree after a 40-token prefill (the same for
    both: the per-op path's), and the cache's keys after them, with the fused block on or off."""
    g = torch.Generator().manual_seed(0)
    vocab, ctx = model.cfg.vocab_size, 40
    with torch.inference_mode():
        cache = model.new_cache(ctx + 16)
        if store is not None:  # the server's pooled caches keep float32
            cache.k, cache.v = cache.k.to(store), cache.v.to(store)
        monkeypatch.setattr(model_mod, "FUSED_BLOCKS", False)
        model(torch.randint(0, vocab, (1, ctx), generator=g), cache, 0, last_only=True)
        monkeypatch.setattr(model_mod, "FUSED_BLOCKS", fused)
        out = []
        for t in range(1, 7):
            cache.length = ctx
            out.append(model.run_layers(model.embed_tokens(torch.randint(0, vocab, (1, t), generator=g)), cache, ctx))
        vis = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        mask = torch.cat([torch.ones(4, ctx, dtype=torch.bool), vis], dim=1)
        positions = torch.tensor([ctx, ctx + 1, ctx + 1, ctx + 2])
        tokens = torch.randint(0, vocab, (1, 4), generator=g)
        out.append(model.run_layers(model.embed_tokens(tokens), cache, ctx, positions=positions, mask=mask))
    return out, cache.k.clone()


@needs_avx2
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("store", [None, torch.float32])
@pytest.mark.parametrize("threads", [1, 2, 3])  # 3: uneven shares, some empty, query groups cut apart
def test_fused_block_gives_the_per_op_bits(tiny_model, monkeypatch, arch: str, store, threads: int) -> None:
    d = tiny_model(arch=arch, hidden_size=64, intermediate_size=128, vocab_size=320, layers=3)
    model = load_model(d, torch.bfloat16, kernel="q4-avx2").model
    assert all(block.fused() is not None for block in model.layers)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused, k_fused = passes(model, True, store, monkeypatch)
        plain, k_plain = passes(model, False, store, monkeypatch)
    finally:
        torch.set_num_threads(before)
    for i, (a, b) in enumerate(zip(fused, plain, strict=True)):
        assert torch.equal(a, b), f"pass {i}"
    assert torch.equal(k_fused, k_plain)


@needs_avx2
@pytest.mark.parametrize("stop", [None, 2])
def test_a_pass_s_blocks_in_one_call_give_the_per_block_bits(tiny_model, monkeypatch, stop) -> None:
    """``stack_forward`` (every block of a pass in one C++ call) gives each block's output, the final rows
    and the cache the bits of the blocks called one by one, for decode-style and tree passes, and keeps
    every block's output when asked (``hidden``) or stops early (``stop``)."""
    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320, layers=3)
    model = load_model(d, torch.bfloat16, kernel="q4-avx2").model
    assert model.fused_stack() is not None
    ext = amx.avx2_extension()
    calls, original = [], ext.stack_forward
    monkeypatch.setattr(ext, "stack_forward", lambda *a: (calls.append(1), original(*a))[1])
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 320, (1, 30), generator=g)
    rows = torch.randint(0, 320, (1, 4), generator=g)
    vis = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, 30, dtype=torch.bool), vis], dim=1)
    positions = torch.tensor([30, 31, 31, 32])
    results = []
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(model, "_stack_for", lambda *a: None)
        with torch.inference_mode():
            cache = model.new_cache(48)
            model.run_layers(model.embed_tokens(prompt), cache, 0)
            hidden: list[torch.Tensor] = []
            a = model.run_layers(model.embed_tokens(rows[:, :3]), cache, 30, hidden, stop)
            cache.length = 30
            b = model.run_layers(model.embed_tokens(rows), cache, 30, positions=positions, mask=mask)
        results.append((a, hidden, b, cache.k.clone(), cache.v.clone()))
    (a1, h1, b1, k1, v1), (a2, h2, b2, k2, v2) = results
    assert calls and len(h1) == len(h2) == (stop or 3)
    assert torch.equal(a1, a2) and torch.equal(b1, b2) and torch.equal(k1, k2) and torch.equal(v1, v2)
    assert all(torch.equal(x, y) for x, y in zip(h1, h2, strict=True))


@needs_avx2
def test_fused_block_steps_aside_where_it_does_not_apply(tiny_model) -> None:
    """Other kernels (torch's q4 here) and training (gradients) keep the per-op path."""
    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320)
    assert load_model(d, torch.bfloat16, kernel="q4").model.layers[0].fused() is None
    model = load_model(d, torch.bfloat16, kernel="q4-avx2").model
    block = model.layers[0]
    assert block.fused() is not None
    calls = []
    ext = amx.avx2_extension()
    original = ext.block_forward
    try:
        ext.block_forward = lambda *a: (calls.append(1), original(*a))[1]
        cache = model.new_cache(8)
        x = torch.randn(1, 2, 64, dtype=torch.bfloat16, requires_grad=True)
        cos, sin = model.rope(0, 2, torch.bfloat16)
        block(x, cos, sin, cache, 0, 0, model.causal_mask(0, 2, 8)).float().sum().backward()
        assert not calls and x.grad is not None
        with torch.inference_mode():
            block(x.detach(), cos, sin, cache, 0, 0, model.causal_mask(0, 2, 8))
        assert calls
    finally:
        ext.block_forward = original


@needs_avx2
def test_swiglu_rounds_as_torch_does() -> None:
    """The C++ ``silu(gate) * up``: torch's two bfloat16 roundings with its own exp, so at most a unit in
    the last place apart from torch's (and equal almost everywhere); with gradients, torch's own."""
    y = (torch.randn(7, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    gate, up = y.float().chunk(2, dim=-1)
    ref = (F.silu(gate).to(torch.bfloat16).float() * up).to(torch.bfloat16)
    with torch.inference_mode():
        got = swiglu(y)
    ulp = 2.0 ** (torch.floor(torch.log2(ref.float().abs().clamp_min(1e-30))) - 7)
    assert ((got.float() - ref.float()).abs() <= ulp).all()
    assert (got == ref).float().mean() > 0.99
    x = y.float().requires_grad_()
    assert torch.equal(swiglu(x), F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1])


def avx2_stream(tiny_model, noise: float = 0.1, head_bits: int | None = None, token_taps: tuple[int, ...] = ()):
    """A tiny model on the AVX2 kernels and a folded one-layer seeded stream over its last layer with a
    draft vocabulary (the shipped stream's shape; ``head_bits=4``: its draft head in 4-bit blocks; ``token_taps``:
    the base's first layers' outputs at each draft node join its seed)."""
    from m2r2.multirate.seeded import SeededConfig, SeededFastStream

    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320, layers=3)
    model = load_model(d, torch.bfloat16, kernel="q4-avx2").model
    fast = SeededFastStream(model, SeededConfig.build(3, depth=1, rank=4, token_taps=list(token_taps)))
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in fast.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    fast.draft_vocab = torch.arange(0, 320, 2)
    return model, fast.freeze(merge=True, head_bits=head_bits)


def ties_by_id(ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Top-k ids with each run of exactly equal probabilities (equal logits) in id order: the C++ level takes the
    lower id first, ``torch.topk`` leaves the order of ties unspecified (it changed from run to run here)."""
    out = ids.clone()
    for r in range(ids.shape[0]):
        order = sorted(range(ids.shape[1]), key=lambda j: (-float(probs[r, j]), int(ids[r, j])))
        out[r] = ids[r, order]
    return out


@needs_avx2
@pytest.mark.parametrize("token_taps", [(), (0,), (0, 1)])
def test_a_fused_draft_level_is_the_per_op_level(tiny_model, monkeypatch, token_taps) -> None:
    """One C++ call for a draft level gives the per-op level's fast states (bits) and top tokens, and its
    probabilities within float32 rounding (its softmax has its own exp); with token taps, the same first layers'
    K/V in the nodes' slots too."""
    from m2r2.decoding.tree import SeededDrafter, Tree

    model, fast = avx2_stream(tiny_model, token_taps=token_taps)
    assert fast.fused_level() is not None
    tree = Tree([7, 11, 12], [-1, 0, 0], [0, 1, 1], [1.0, 0.6, 0.3])
    results = []
    for fused in (True, False):
        monkeypatch.setattr(model_mod, "FUSED_BLOCKS", fused)
        drafter = SeededDrafter(fast)
        with torch.inference_mode():
            cache = model.new_cache(64)
            h = model.run_layers(model.embed_tokens(torch.arange(20)[None] % 320), cache, 0)
            drafter.start(h[:, -1:], cache, 20)
            first = drafter.top(tree, [0], 3)
            second = drafter.top(tree, [1, 2], 3)  # a second level reads the first's fast K/V
        results.append(
            (first, second, torch.stack([drafter.seeds[r] for r in (0, 1, 2)]), cache.k.clone(), cache.v.clone())
        )
    (f1, s1, seeds1, k1, v1), (f2, s2, seeds2, k2, v2) = results
    assert torch.equal(seeds1, seeds2) and torch.equal(k1, k2) and torch.equal(v1, v2)
    for (ids_a, p_a), (ids_b, p_b) in ((f1, f2), (s1, s2)):
        assert torch.equal(ties_by_id(ids_a, p_a), ties_by_id(ids_b, p_b))
        assert torch.allclose(p_a, p_b, rtol=1e-5, atol=1e-7)


@needs_avx2
@pytest.mark.parametrize("lookup", [0, 4])
@pytest.mark.parametrize("head_bits", [8, 4])  # 4: the draft head in 4-bit blocks (m2r2's default)
@pytest.mark.parametrize("token_taps", [(), (1,)])
def test_trees_drafted_in_fused_levels_stay_plain_greedy(tiny_model, lookup: int, head_bits: int, token_taps) -> None:
    import random

    from m2r2.decoding.autoregressive import Autoregressive
    from m2r2.decoding.base import GenerationConfig
    from m2r2.decoding.tree import TreeSpeculative
    from m2r2.kernels import AmxInt4Linear, AmxInt8Linear

    model, fast = avx2_stream(tiny_model, noise=0.05, head_bits=head_bits, token_taps=token_taps)
    assert type(fast.sub_head) is (AmxInt4Linear if head_bits == 4 else AmxInt8Linear)
    assert fast.fused_level() is not None
    ext = amx.avx2_extension()
    calls, original = [], ext.draft_tree
    rng = random.Random(lookup)
    try:
        ext.draft_tree = lambda *a: (calls.append(1), original(*a))[1]
        strat = TreeSpeculative("m2r2", model, fast, [], None, 8, 4, 2, 2, lookup=lookup)
        for _ in range(3):
            prompt = [rng.randrange(320) for _ in range(rng.randint(2, 30))]
            gen = GenerationConfig(max_new_tokens=rng.randint(10, 50))
            assert strat.generate(prompt, gen).tokens == Autoregressive(model, []).generate(prompt, gen).tokens
    finally:
        ext.draft_tree = original
    assert calls


@needs_avx2
@pytest.mark.parametrize(
    ("width", "branch", "depth", "nodes", "calib", "cost"),
    [
        (2, 2, 5, 8, 1.0, 0.0),
        (1, 1, 4, 8, 1.0, 0.0),
        (3, 2, 4, 12, 1.0, 0.0),
        (2, 4, 3, 6, 1.0, 0.0),
        (2, 2, 5, 8, 1.3, 0.2),
        (2, 3, 6, 16, 0.7, 0.05),
        (4, 4, 2, 3, 1.0, 0.0),
    ],
)
@pytest.mark.parametrize("token_taps", [(), (0, 1)])
def test_a_tree_grown_in_one_call_is_the_tree_of_its_levels(
    tiny_model, monkeypatch, width, branch, depth, nodes, calib, cost, token_taps
) -> None:
    """``draft_tree`` (a whole greedy tree in one C++ call) drafts the tree ``TreeSpeculative.draft`` builds from
    fused levels one by one: the same tokens, parents, depths and path probabilities (the same float32
    probabilities multiplied in double), the same stopping by depth, size and cost, the same fast K/V in the cache."""
    from m2r2.decoding.tree import SeededDrafter, TreeCosts, TreeSpeculative

    model, fast = avx2_stream(tiny_model, noise=0.3, token_taps=token_taps)
    costs = TreeCosts(draft=[cost] * 4, verify=[1.0, 1.0]) if cost else None
    strat = TreeSpeculative("m2r2", model, fast, [], None, nodes, depth, width, branch, costs=costs)
    gen = GenerationConfig(max_new_tokens=64)
    trees, caches = [], []
    for whole in (True, False):
        if not whole:
            monkeypatch.setattr(SeededDrafter, "grow", lambda *a, **k: None)
        with torch.inference_mode():
            cache = model.new_cache(64)
            h = model.run_layers(model.embed_tokens(torch.arange(20)[None] % 320), cache, 0)
            trees.append(strat.draft(h[:, -1:], 5, cache, 40, gen, calib, costs))
            caches.append((cache.k.clone(), cache.v.clone()))
    (a, b), ((ka, va), (kb, vb)) = trees, caches
    assert len(a.tokens) > 2
    assert (a.tokens, a.parents, a.depths, a.scores) == (b.tokens, b.parents, b.depths, b.scores)
    assert torch.equal(ka, kb) and torch.equal(va, vb)


@needs_avx2
@pytest.mark.parametrize("threads", [1, 2])
def test_a_prefill_on_the_fused_blocks_gives_each_row_the_bits_of_short_passes(
    tiny_model, monkeypatch, threads
) -> None:
    """A prompt of more than 32 rows runs on the fused blocks (its element-wise steps and attention on every
    thread; in pieces of ``PREFILL_MAX_ROWS``): every row's state, every kept layer's output and the cache get the
    bits of the per-op path run over pieces of at most 32 rows (where it attends row by row, as the fused blocks do),
    since a row's numbers never depend on the rows beside it."""
    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320, layers=3)
    model = load_model(d, torch.bfloat16, kernel="q4-avx2").model
    prompt = torch.randint(0, 320, (1, 70), generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    was = amx.avx2_extension().set_bf16_prefill(False)  # the int8 loops' prefill (an AMX CPU's tiles: the next test)
    results, calls, original = [], [], amx.avx2_extension().stack_forward
    monkeypatch.setattr(amx.avx2_extension(), "stack_forward", lambda *a: (calls.append(1), original(*a))[1])
    try:
        for fused, piece in ((True, 70), (True, 40), (False, 30)):
            monkeypatch.setattr(model_mod, "FUSED_BLOCKS", fused)
            monkeypatch.setattr(model_mod, "PREFILL_MAX_ROWS", piece if fused else 512)
            calls.clear()
            with torch.inference_mode():
                cache, hidden, outs = model.new_cache(80), [], []
                step = 70 if fused else piece  # the fused blocks take the whole prompt; the per-op path short passes
                for s0 in range(0, 70, step):
                    layers: list[torch.Tensor] = []
                    outs.append(model.run_layers(model.embed_tokens(prompt[:, s0 : s0 + step]), cache, s0, layers))
                    hidden.append(layers)
            assert len(calls) == (-(-70 // piece) if fused else 0)
            assert cache.length == 70
            per_layer = [torch.cat(parts, dim=1) for parts in zip(*hidden, strict=True)]
            results.append((torch.cat(outs, dim=1), per_layer, cache.k.clone(), cache.v.clone()))
    finally:
        torch.set_num_threads(before)
        amx.avx2_extension().set_bf16_prefill(was)
    for out, layers, k, v in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(k, results[0][2]) and torch.equal(v, results[0][3])
        assert len(layers) == 3 and all(torch.equal(a, b) for a, b in zip(layers, results[0][1], strict=True))


needs_bf16_prefill = pytest.mark.skipif(
    amx.avx2_extension() is None or not amx.avx2_extension().bf16_prefill_in_use(),
    reason="no AMX-BF16 tiles for prefills here",
)


@needs_avx2
@needs_bf16_prefill
def test_the_prefill_tiles_multiply_the_widened_weights(tiny_model) -> None:
    """The prefill's AMX-BF16 linear (``csrc_avx2/prefill_amx.cpp``) is the 4- or 8-bit weight widened to bfloat16
    times the bfloat16 rows, summed in float32. Rows of the identity read the widened weights back: the model's
    bfloat16 weights, but for a rare bfloat16 unit where ``d q + m`` falls halfway and the model's came rounded
    another way (a nibble or column out of place would be a quantization step off, and often). Against those weights
    times the rows in float64, each output is off by at most its own rounding to bfloat16 and float32 sums (rows past
    a whole tile included)."""
    from m2r2.kernels import dense_weight

    d = tiny_model(hidden_size=128, intermediate_size=192, vocab_size=320, layers=1)
    model = load_model(d, torch.bfloat16, kernel="q4-avx2").model
    ext = amx.avx2_extension()
    block = model.layers[0]
    g = torch.Generator().manual_seed(1)
    for lin, bits in ((block.attn.wqkv, 4), (block.mlp.w13, 4), (block.mlp.w2, 4), (model.lm_head, 8)):
        eye = torch.eye(lin.in_features, dtype=torch.bfloat16)
        widened = ext.bf16_linear(eye, lin.qbytes, lin.scales, bits).T.double()  # [N, K]
        w = dense_weight(lin).bfloat16().double()
        unit = 2.0 ** (torch.floor(torch.log2(w.abs().clamp_min(2.0**-100))) - 7)
        assert ((widened - w).abs() <= unit).all() and (widened != w).double().mean() < 0.02
        for m in (33, 47, 80):
            x = torch.randn(m, lin.in_features, generator=g).bfloat16()
            y = ext.bf16_linear(x, lin.qbytes, lin.scales, bits).double()
            want = x.double() @ widened.T
            tol = want.abs() * 2.0**-8 + (x.double().abs() @ widened.abs().T) * 2.0**-20
            assert y.shape == want.shape and ((y - want).abs() <= tol).all()


@needs_avx2
@needs_bf16_prefill
def test_a_prefill_on_the_bf16_tiles_gives_each_row_the_bits_of_any_split(tiny_model, monkeypatch) -> None:
    """On an AMX CPU a prompt of more than 32 rows prefills on bfloat16 tiles: bits of their own, but still each
    row's own (a prompt split into any pieces of more than 32 rows gets the same states and cache), and close to the
    int8 loops' prefill; a longer prompt than ``PREFILL_MAX_ROWS`` is cut into equal pieces, none of a verify pass's
    length (so none leaves the tiles)."""
    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320, layers=3)
    model = load_model(d, torch.bfloat16, kernel="q4-avx2").model
    ext = amx.avx2_extension()
    prompt = torch.randint(0, 320, (1, 70), generator=torch.Generator().manual_seed(3))
    sizes = []
    original = ext.stack_forward
    monkeypatch.setattr(ext, "stack_forward", lambda *a: (sizes.append(a[1].shape[0]), original(*a))[1])

    def prefill(piece: int, tiles: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(model_mod, "PREFILL_MAX_ROWS", piece)
        was = ext.set_bf16_prefill(tiles)
        try:
            with torch.inference_mode():
                cache = model.new_cache(80)
                out = model.run_layers(model.embed_tokens(prompt), cache, 0)
        finally:
            ext.set_bf16_prefill(was)
        return out, cache.k.clone()

    whole, k = prefill(512)
    for piece in (40, 36):  # 35 + 35 rows both times (never 40 + 30: a 30-row pass would take the int8 loops)
        sizes.clear()
        out, kp = prefill(piece)
        assert sizes == [35, 35] and torch.equal(out, whole) and torch.equal(kp, k)
    int8, _ = prefill(512, tiles=False)
    assert ext.prefill_min_rows() == model_mod.ROW_INVARIANT_MAX_ROWS + 1  # the C++ side's "a prefill" is Python's
    assert not torch.equal(int8, whole)
    assert (int8.float() - whole.float()).abs().max() <= 0.05 * whole.float().abs().max()


@needs_avx2
def test_the_kept_stack_follows_any_module_assigned_onto_the_model(tiny_model) -> None:
    """``fused_stack`` re-reads the blocks' modules only after an assignment onto the model's modules
    (``Structure``): a replaced linear, norm weight or whole block drops or rebuilds the stack; an unrelated pass
    keeps it."""
    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320, layers=3)
    model = load_model(d, torch.bfloat16, kernel="q4-avx2").model
    stack = model.fused_stack()
    assert stack is not None and model.fused_stack() is stack
    attn = model.layers[1].attn
    fused_wo = attn.wo
    attn.wo = torch.nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)  # a linear the fused block cannot run
    assert model.fused_stack() is None
    attn.wo = fused_wo
    again = model.fused_stack()
    assert again is not None and again is not stack  # rebuilt from the restored modules
    norm = model.layers[0].mlp_norm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone(), requires_grad=False)
    rebuilt = model.fused_stack()
    assert rebuilt is not None and rebuilt is not again
    model.layers[2] = model.layers[0]  # a whole block replaced through the block list
    assert model.fused_stack() is not rebuilt


def test_causal_masks_are_rows_of_a_kept_square_and_follow_the_window(tiny_model) -> None:
    d = tiny_model(arch="mistral", sliding_window=4)
    model = load_model(d, torch.float32).model
    for pos, t, kv_len in [(0, 3, 12), (5, 1, 12), (9, 3, 12), (2, 2, 7), (0, 7, 7)]:
        q = torch.arange(pos, pos + t)[:, None]
        k = torch.arange(kv_len)[None, :]
        want = (k <= q) & (k > q - 4)
        assert torch.equal(model.causal_mask(pos, t, kv_len), want)
    model.cfg.sliding_window = None
    assert torch.equal(model.causal_mask(9, 3, 12), torch.arange(12)[None, :] <= torch.arange(9, 12)[:, None])
    big = model_mod.CAUSAL_KEPT_MAX + 8  # past the kept size: built for the rows asked only
    assert torch.equal(
        model.causal_mask(big - 2, 2, big)[:, -3:], torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    )


@needs_avx2
def test_a_drafter_that_grows_whole_trees_is_timed_by_whole_trees(tiny_model, monkeypatch) -> None:
    """``measure_tree_costs`` times a drafter with ``grow`` by whole trees after a slow pass (levels: the slope to
    trees of ``DEEP`` levels) and every other drafter by its levels: either way four positive level costs, a start
    and one slow pass per row count."""
    from m2r2.decoding import tree as tree_mod
    from m2r2.decoding.tree import SeededDrafter, measure_tree_costs

    model, fast = avx2_stream(tiny_model)
    grown = []
    original = SeededDrafter.grow
    monkeypatch.setattr(SeededDrafter, "grow", lambda self, *a: (grown.append(a[4].depth), original(self, *a))[1])
    costs = measure_tree_costs(model, SeededDrafter(fast), 4, repeats=2)
    assert set(grown) == {1, tree_mod.DEEP}  # trees of one and DEEP levels, nothing level by level
    assert len(costs.draft) == 4 and min(costs.draft) > 0 and costs.start >= 0 and len(costs.verify) == 5
    monkeypatch.setattr(SeededDrafter, "grow", lambda self, *a: None)
    grown.clear()
    level_by_level = measure_tree_costs(model, SeededDrafter(fast), 4, repeats=2)
    assert not grown and len(level_by_level.draft) == 4 and min(level_by_level.draft) > 0


def greedy_passes(model, fused: bool, monkeypatch) -> tuple[list[tuple[list[int], torch.Tensor]], torch.Tensor]:
    """Each row's greedy token and the final states of passes of 1..6 rows and a token tree after a 40-token
    prefill, by :func:`m2r2.decoding.tree.greedy_verify` with the one-call greedy pass on or off, and the cache."""
    from m2r2.decoding.tree import greedy_verify

    g = torch.Generator().manual_seed(2)
    vocab, ctx = model.cfg.vocab_size, 40
    monkeypatch.setattr(model_mod, "GREEDY_PASS", fused)
    with torch.inference_mode():
        cache = model.new_cache(ctx + 16)
        model(torch.randint(0, vocab, (1, ctx), generator=g), cache, 0, last_only=True)
        out = []
        for t in range(1, 7):
            cache.length = ctx
            tokens, h = greedy_verify(model, torch.randint(0, vocab, (t,), generator=g).tolist(), cache, ctx)
            out.append((list(tokens) if isinstance(tokens, list) else tokens.tolist(), h))
            assert cache.length == ctx + t
        vis = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        mask = torch.cat([torch.ones(4, ctx, dtype=torch.bool), vis], dim=1)
        positions = torch.tensor([ctx, ctx + 1, ctx + 1, ctx + 2])
        rows = torch.randint(0, vocab, (4,), generator=g).tolist()
        tokens, h = greedy_verify(model, rows, cache, ctx, positions, mask)
        out.append((list(tokens) if isinstance(tokens, list) else tokens.tolist(), h))
    return out, cache.k.clone()


@needs_avx2
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("threads", [1, 2])
def test_a_greedy_pass_in_one_call_gives_the_op_by_op_tokens_and_states(
    tiny_model, monkeypatch, arch: str, threads: int
) -> None:
    """``greedy_pass`` (embeddings, blocks, norm, LM head and argmax in one C++ call) gives every row the token and
    final state of the layers and the certified head argmax run op by op, and the same cache, for decode-style
    passes and a tree; and it is the path a greedy pass takes where it applies."""
    d = tiny_model(arch=arch, hidden_size=64, intermediate_size=128, vocab_size=320, layers=3)
    model = load_model(d, torch.bfloat16, kernel="q4-avx2").model
    assert model.greedy_parts() is not None
    ext = amx.avx2_extension()
    calls, original = [], ext.greedy_pass
    monkeypatch.setattr(ext, "greedy_pass", lambda *a: (calls.append(1), original(*a))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused, k_fused = greedy_passes(model, True, monkeypatch)
        assert len(calls) == 7
        plain, k_plain = greedy_passes(model, False, monkeypatch)
        assert len(calls) == 7
    finally:
        torch.set_num_threads(before)
    for i, ((ta, ha), (tb, hb)) in enumerate(zip(fused, plain, strict=True)):
        assert ta == tb, f"pass {i}"
        assert torch.equal(ha, hb), f"pass {i}"
    assert torch.equal(k_fused, k_plain)


@needs_avx2
def test_a_greedy_pass_steps_aside_where_it_does_not_apply(tiny_model) -> None:
    """None (the caller runs the layers and the head) for more rows than a verify pass, with gradients on, and
    for a head that is not the AVX2 build's 4/8-bit one."""
    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320, layers=3)
    model = load_model(d, torch.bfloat16, kernel="q4-avx2").model
    cache = model.new_cache(64)
    with torch.inference_mode():
        assert model.greedy_pass([1] * (model_mod.ROW_INVARIANT_MAX_ROWS + 1), cache, 0) is None
        assert model.greedy_pass([1, 2], cache, 0) is not None
    with torch.enable_grad():
        assert model.greedy_pass([1], cache, 2) is None
    model.lm_head = torch.nn.Linear(64, 320, bias=False).to(torch.bfloat16)
    with torch.inference_mode():
        assert model.greedy_parts() is None
        assert model.greedy_pass([1], cache, 2) is None


@needs_avx2
def test_greedy_answers_are_the_same_with_the_one_call_pass(tiny_model, monkeypatch) -> None:
    """Trees verified in one-call passes answer token for token as plain decoding op by op, and so do plain
    decoding in one-call steps and lookahead decoding's one-call passes."""
    import random

    from m2r2.decoding.autoregressive import Autoregressive
    from m2r2.decoding.lookahead import Lookahead
    from m2r2.decoding.tree import TreeSpeculative

    model, fast = avx2_stream(tiny_model, noise=0.05, head_bits=4, token_taps=())
    assert model.greedy_parts() is not None
    strat = TreeSpeculative("m2r2", model, fast, [], None, 8, 4, 2, 2, lookup=6)
    rng = random.Random(3)
    for _ in range(3):
        prompt = [rng.randrange(320) for _ in range(rng.randint(2, 30))]
        gen = GenerationConfig(max_new_tokens=rng.randint(10, 50))
        monkeypatch.setattr(model_mod, "GREEDY_PASS", False)
        plain = Autoregressive(model, []).generate(prompt, gen).tokens
        monkeypatch.setattr(model_mod, "GREEDY_PASS", True)
        assert Autoregressive(model, []).generate(prompt, gen).tokens == plain
        assert strat.generate(prompt, gen).tokens == plain
        assert Lookahead(model, [], window=3, ngram=3, candidates=2).generate(prompt, gen).tokens == plain


@needs_avx2
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("store", [None, torch.float32])  # None: bfloat16 (distillation's pool); the server's float32
@pytest.mark.parametrize("threads", [1, 2])
def test_batched_greedy_steps_give_each_sequence_its_lone_steps(
    tiny_model, monkeypatch, arch: str, store, threads: int
) -> None:
    """``greedy_steps`` (one new token of each of several sequences in one C++ call) gives every row the token, final
    state and cached keys and values of that sequence's lone ``greedy_pass`` step, for sequences of different lengths
    (one past the AMX attention's threshold) and caches (lent by a pool at two capacities, in its item order or not
    after one leaves and the last moves into its place, and a lone one), and it is the path a batched step takes."""
    from m2r2.cache import KVPool

    d = tiny_model(arch=arch, hidden_size=64, intermediate_size=128, vocab_size=320, layers=3,
                   max_position_embeddings=1024)  # fmt: skip
    model = load_model(d, torch.bfloat16, kernel="q4-avx2").model
    ext = amx.avx2_extension()
    calls, original = [], ext.greedy_steps
    monkeypatch.setattr(ext, "greedy_steps", lambda *a: (calls.append(len(a[5])), original(*a))[1])
    g = torch.Generator().manual_seed(4)
    lengths, capacities = [3, 17, 40, 500, 9, 30], [560, 560, 560, 560, 128, 96]
    pool = KVPool(model.cfg, 8, torch.bfloat16, model.device, store)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            seqs = []  # (pooled cache, lone cache, next token)
            for n, capacity in zip(lengths, capacities, strict=True):
                prompt = torch.randint(0, 320, (1, n), generator=g)
                pooled = pool.take(capacity) if capacity > 100 else model.new_cache(capacity)  # the last: a lone cache
                lone = model.new_cache(capacity)
                if store is not None:
                    lone.k, lone.v = lone.k.to(store), lone.v.to(store)
                    if pooled.base is None:
                        pooled.k, pooled.v = pooled.k.to(store), pooled.v.to(store)
                first = model(prompt, pooled, 0, last_only=True)[0, -1].argmax()
                assert torch.equal(model(prompt, lone, 0, last_only=True)[0, -1].argmax(), first)
                seqs.append((pooled, lone, int(first)))
            for step in range(6):
                if step == 3:  # the second sequence leaves: the last one moves into its item
                    pool.give(seqs.pop(1)[0])
                    assert [c.item for c, _, _ in seqs[:3]] == [0, 2, 1]
                out = model.greedy_steps([t for _, _, t in seqs], [c for c, _, _ in seqs])
                assert out is not None
                ids, h = out
                for b, (pooled, lone, tok) in enumerate(seqs):
                    want, h_lone = model.greedy_pass([tok], lone, lone.length)
                    assert ids[b] == want[0], f"step {step}, sequence {b}"
                    assert torch.equal(h[b], h_lone[0]), f"step {step}, sequence {b}"
                    assert pooled.length == lone.length
                    n = lone.length
                    assert torch.equal(pooled.k[:, :, :, :n], lone.k[:, :, :, :n])
                    assert torch.equal(pooled.v[:, :, :, :n], lone.v[:, :, :, :n])
                seqs = [(c, lone, t) for (c, lone, _), t in zip(seqs, ids, strict=True)]
    finally:
        torch.set_num_threads(before)
    assert calls == [6, 6, 6, 5, 5, 5]


@needs_avx2
def test_batched_greedy_steps_step_aside_where_they_do_not_apply(tiny_model) -> None:
    """None (the caller runs ``step_rows`` and the head) for a cache of several sequences, a full cache, more rows
    than the kernels keep row-invariant, and with gradients on."""
    from m2r2.cache import KVPool

    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320, layers=3)
    model = load_model(d, torch.bfloat16, kernel="q4-avx2").model
    one, two = (KVPool(model.cfg, 40, torch.bfloat16, model.device) for _ in range(2))
    a, b = one.take(16), two.take(32)
    with torch.inference_mode():
        assert model.greedy_steps([1, 2, 3], [a, b, model.new_cache(24)]) is not None
        assert model.greedy_steps([1], [model.new_cache(16, batch=2)]) is None
        many = [one.take(16) for _ in range(model_mod.ROW_INVARIANT_MAX_ROWS - 1)]
        assert model.greedy_steps([1] * (len(many) + 1), [a, *many]) is not None
        assert model.greedy_steps([1] * (len(many) + 2), [a, b, *many]) is None
        a.length = 16
        assert model.greedy_steps([1], [a]) is None
    with torch.enable_grad():
        assert model.greedy_steps([1], [b]) is None


@needs_avx2
def test_distilled_answers_are_plain_greedy_answers(tiny_model, monkeypatch) -> None:
    """Continuous batching (fewer live sequences than prompts, answers of different lengths, some ended by an end
    token) gives every prompt plain greedy decoding's answer, through one-call batched steps or through step_rows."""
    import random

    from m2r2.decoding.autoregressive import Autoregressive
    from m2r2.training.distill import answer_stream

    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320, layers=3)
    model = load_model(d, torch.bfloat16, kernel="q4-avx2").model
    rng = random.Random(5)
    prompts = [[rng.randrange(320) for _ in range(rng.randint(2, 40))] for _ in range(7)]
    eos = [7, 11, 13]
    plain = [Autoregressive(model, eos).generate(p, GenerationConfig(max_new_tokens=24)).tokens for p in prompts]
    plain = [t[:-1] if t and t[-1] in eos else t for t in plain]  # an answer's record holds no end token
    assert any(len(t) < 24 for t in plain) and any(len(t) == 24 for t in plain)
    ext = amx.avx2_extension()
    calls, original = [], ext.greedy_steps
    monkeypatch.setattr(ext, "greedy_steps", lambda *a: (calls.append(1), original(*a))[1])
    for fused in (True, False):
        calls.clear()
        monkeypatch.setattr(model_mod, "GREEDY_PASS", fused)
        got = dict(answer_stream(model, prompts, 24, eos, live=3))
        assert [got[i] for i in range(len(prompts))] == plain
        assert bool(calls) == fused
