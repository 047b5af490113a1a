"""Two builds of the AVX2 extension running SmolLM2's whole layer stack side by side in one process: this
tree's build and a variant compiled from another copy of ``csrc_avx2`` (``--sources DIR``) and/or with a
macro (``--define MACRO=VALUE``). Passes of 1-4 rows at a 300-token context (`run_layers`, the fused stack
as decoding runs it; ``--rows``) and, with ``--prefill N``, an N-token prefill (the per-op path), the builds
alternating pass by pass, medians; both must give the same bits.
`experiments/q4_variants.py` judges a kernel on one large weight; this judges what a step sees (30 layers
of small linears, the attention, the serial parts between them, the threads' joins).

    python experiments/stack_variants.py [--sources DIR] [--define MACRO=VALUE] [--threads N] [--repeats 41]
        [--rows 1,2,3,4] [--prefill 0]
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from m2r2 import amx
from m2r2.engine import Engine
from m2r2.machine import cpu_name

p = argparse.ArgumentParser()
p.add_argument("--sources", type=Path, help="a directory holding the variant's csrc_avx2 files")
p.add_argument("--define", action="append", default=[], help="a macro for the variant, MACRO=VALUE")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--repeats", type=int, default=41)
p.add_argument("--rows", default="1,2,3,4", help="pass sizes, comma-separated (up to 32: the fused stack)")
p.add_argument("--prefill", type=int, default=0, help="also time a prefill of this many tokens (0: none)")
p.add_argument(
    "--timing-only", action="store_true", help="a variant that computes less on purpose: skip the bits check"
)
args = p.parse_args()
engine = Engine(threads=args.threads, quiet=True)
model = engine.model
current = amx.avx2_extension()
src = args.sources or amx.AVX2_SOURCES[0].parent
variant = amx._build(
    "q4_avx2_variant",
    sorted(src.glob("*.cpp")),
    sorted(src.glob("*.h")),
    [*amx.AVX2_FLAGS, *(f"-D{d}" for d in args.define)],
)
assert current is not None and variant is not None, "the AVX2 build does not run here"
real_ext, real_helpers = amx.avx2_extension, amx.row_helpers


def use(ext) -> None:
    """Make ``ext`` the build every fused call reaches (the stack is rebuilt from the same weights)."""
    amx.avx2_extension = amx.row_helpers = lambda: ext
    for block in model.layers:
        block.__dict__.pop("_fused", None)
    model.__dict__.pop("_stack", None)
    assert model.fused_stack() is not None


stacks = {}
for name, ext in (("default", current), ("variant", variant)):
    use(ext)
    stacks[name] = (ext, model.__dict__["_stack"])


def switch(name: str) -> None:
    ext, kept = stacks[name]
    amx.avx2_extension = amx.row_helpers = lambda: ext
    model.__dict__["_stack"] = kept


print(f"{cpu_name()}, {args.threads} thread(s); variant: {src} {' '.join(args.define)}; medians of {args.repeats}")
print("| rows | default ms | variant ms | variant / default |\n|--:|--:|--:|--:|")
g = torch.Generator().manual_seed(0)
with torch.inference_mode():
    cache = model.new_cache(1024)
    switch("default")
    model.run_layers(model.embed_tokens(torch.randint(0, 40000, (1, 300), generator=g)), cache, 0)
    passes = [(int(r), 300) for r in args.rows.split(",")] + ([(args.prefill, 0)] if args.prefill else [])
    for rows, pos in passes:
        x = model.embed_tokens(torch.randint(0, 40000, (1, rows), generator=g))
        times: dict[str, list[float]] = {"default": [], "variant": []}
        outs = {}
        for _ in range(args.repeats if pos else max(3, args.repeats // 4)):
            for name in ("default", "variant"):
                switch(name)
                cache.length = pos
                t = time.perf_counter()
                outs[name] = model.run_layers(x, cache, pos)
                times[name].append(time.perf_counter() - t)
        assert args.timing_only or torch.equal(outs["default"], outs["variant"]), "the builds give different bits"
        a, b = (statistics.median(times[k]) * 1e3 for k in ("default", "variant"))
        print(f"| {rows}{'' if pos else ' (prefill)'} | {a:.2f} | {b:.2f} | {b / a:.3f} |")
amx.avx2_extension, amx.row_helpers = real_ext, real_helpers
