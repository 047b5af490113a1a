"""What the experiments that time parts of real generation share: an engine, MT-Bench first turns as chat token
ids, and one warm-up answer per method (which also measures the tree's costs), so the timed answers start warm.

    from warmed import GEN, warmed_first_turns   # in a script run as python experiments/NAME.py

The bundled model unless M2R2_MODEL names another (what ``--model`` takes: ``M2R2_MODEL=qwen2.5-coder-0.5b``).
"""

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from m2r2 import amx
from m2r2.bench.datasets import load_dataset
from m2r2.cache import KVCache
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine
from m2r2.kernels import head_argmax

#: the answers these experiments time: greedy, up to 128 new tokens
GEN = GenerationConfig(max_new_tokens=128)


def warmed_first_turns(n_prompts: int, threads: int, first: int = 0) -> tuple[Engine, list[list[int]]]:
    """An engine on ``threads`` threads and MT-Bench prompts ``first..first+n_prompts-1`` (first turns, as chat
    ids), after `vanilla` and `m2r2` have each answered the first of them once."""
    engine = Engine(os.environ.get("M2R2_MODEL") or None, threads=threads, quiet=True)
    prompts = load_dataset("mt_bench", first + n_prompts).prompts[first:]
    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}]) for p in prompts]
    for method in ("vanilla", "m2r2"):
        engine.generate_ids(ids[0], method, GEN)
    return engine, ids


def tally(row: list, result, seconds: float) -> None:
    """Add one answer to ``row`` (``[tokens, verify passes, verify rows, seconds]``: what the experiments that time
    whole answers total; a method without verify passes counts a pass a token, a row a pass)."""
    passes = result.stats.get("verify_passes", len(result.tokens))
    row[0] += len(result.tokens)
    row[1] += passes
    row[2] += result.stats.get("verify_rows_per_pass", 1.0) * passes
    row[3] += seconds


def filled_context(model, prompt: list[int], ctx: int) -> tuple[KVCache, torch.Tensor]:
    """A bfloat16 cache with room for 64 more rows, prefilled with ``prompt`` repeated to ``ctx`` tokens, and
    those tokens ``[1, ctx]``: the real context the experiments that time one pass run their rows after."""
    cache = KVCache(model.cfg, ctx + 64, dtype=torch.bfloat16)
    toks = torch.tensor([(prompt * (ctx // len(prompt) + 1))[:ctx]])
    with torch.no_grad():
        model.run_layers(model.embed_tokens(toks), cache, 0)
    return cache, toks


def pass_inputs(model, cache: KVCache, toks: torch.Tensor, ctx: int, t: int) -> tuple[torch.Tensor, ...]:
    """What ``stack_forward`` takes for a pass over the first ``t`` of ``toks`` after ``ctx`` cached tokens: the rows'
    embeddings, the causal mask over the cache's capacity, and the RoPE tables."""
    x = model.embed_tokens(toks[:, :t])[0].contiguous()
    mask = model.causal_mask(ctx, t, cache.max_len).contiguous()
    cos, sin = (r.contiguous() for r in model.rope(ctx, t, x.dtype))
    return x, mask, cos, sin


def timed_pass(model, ext, stack, cache: KVCache, ctx: int, inputs: tuple[torch.Tensor, ...]) -> tuple:
    """A verify pass's two parts on a fused stack of ``ext``'s build: every block over the rows (writing the same cache
    slots every time), then the certified head argmax. Returns the last rows, their argmax ids, and the seconds of
    each part."""
    x, mask, cos, sin = inputs
    t0 = time.perf_counter()
    h = ext.stack_forward(stack, x, cache.k, cache.v, ctx, mask, cos, sin, len(model.layers), False)[-1]
    t1 = time.perf_counter()
    ids = head_argmax(model, h[None])
    return h, ids, t1 - t0, time.perf_counter() - t1


def toggled(run: Callable[[], torch.Tensor], switch: Callable[[bool], object], repeats: int) -> tuple[float, float]:
    """Median seconds of ``run()`` with a kernel build's switch on and off (``switch(True)`` / ``switch(False)``,
    e.g. ``set_vnni``), alternating call by call so that the machine's drift favours neither; both must give the
    same bits. Leaves the switch on."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        outs = {}
        for on in (True, False):
            switch(on)
            t = time.perf_counter()
            outs[on] = run()
            times[on].append(time.perf_counter() - t)
        assert torch.equal(outs[True], outs[False]), "the two paths gave different bits"
    switch(True)
    return statistics.median(times[True]), statistics.median(times[False])


def patched_build(name: str, edits: list[tuple[str, str]], src: Path | None = None):
    """A copy of the ``csrc_avx2/`` sources (or those in ``src``) with text edits to ``block_avx2.cpp`` (each ``old``
    found exactly once), built as its own extension and put in the engine's place: the engines made after it build
    their blocks from it. Returns the extension."""
    src = src or Path(amx.__file__).with_name("csrc_avx2")
    tmp = Path(tempfile.mkdtemp())
    for f in src.iterdir():
        if f.suffix in (".cpp", ".h"):
            shutil.copy(f, tmp / f.name)
    block = (tmp / "block_avx2.cpp").read_text()
    for old, new in edits:
        assert block.count(old) == 1, f"block_avx2.cpp changed: {old[:40]!r}"
        block = block.replace(old, new)
    (tmp / "block_avx2.cpp").write_text(block)
    ext = amx._build(name, sorted(tmp.glob("*.cpp")), sorted(tmp.glob("*.h")), list(amx.AVX2_FLAGS))
    assert ext is not None, "the patched build failed"
    amx.avx2_extension = lambda: ext
    return ext
