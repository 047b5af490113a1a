"""The q4-avx2 linears with and without their AMX tile sums (`csrc_avx2/q4_amx_rows.cpp`), toggled in one process
(`set_amx_rows`), interleaved, with the tiles allowed at every pass size (`set_amx_min_rows(1)`; the default is 10):
one 4-bit linear (SmolLM2's gate|up, 3072 x 576) and an 8-bit one (8192 x 576, a sixth of the head) on one thread
with their weights in L2, then prefills of the whole layer stack on every thread with the default minimum. Both
paths give the same bits (checked on every call). The end-to-end A/B is `m2r2 bench` with and without
`M2R2_NO_AMX_ROWS=1`.

    python experiments/amx_rows_ab.py [--threads N] [--repeats N]
"""

import argparse

import torch
from warmed import toggled

from m2r2 import amx
from m2r2.engine import Engine
from m2r2.kernels import AmxInt4Linear, AmxInt8Linear
from m2r2.machine import cpu_name

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--repeats", type=int, default=101)
args = ap.parse_args()
engine = Engine(threads=args.threads, quiet=True)
model, ext = engine.model, amx.avx2_extension()
assert engine.kernel == "q4-avx2" and ext.set_amx_rows(True), "needs the q4-avx2 kernel on an AMX-INT8 CPU"
print(f"{cpu_name()}, {engine.kernel}")


g = torch.Generator().manual_seed(0)
with torch.inference_mode():
    torch.set_num_threads(1)
    previous = ext.set_amx_min_rows(1)
    print(f"\none linear, 1 thread, medians of {args.repeats}, interleaved (tiles at every pass size)")
    print("| linear | rows | AMX us | VNNI us | AMX / VNNI |\n|---|--:|--:|--:|--:|")
    gate_up = model.layers[0].mlp.w13
    head_part = torch.nn.Linear(576, 8192, bias=False).to(torch.bfloat16)  # random weights: the time is the same
    for name, lin in (("4-bit 3072 x 576", gate_up), ("8-bit 8192 x 576", AmxInt8Linear(head_part, products="avx2"))):
        assert isinstance(lin, AmxInt4Linear | AmxInt8Linear)
        for rows in (1, 2, 4, 8, 10, 12, 16, 32, 128):
            x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
            on, off = toggled(lambda x=x, lin=lin: lin(x), ext.set_amx_rows, args.repeats)
            print(f"| {name} | {rows} | {on * 1e6:.0f} | {off * 1e6:.0f} | {on / off:.3f} |")
    ext.set_amx_min_rows(previous)
    torch.set_num_threads(args.threads)
    print(f"\nprefill of the 30 layers, {args.threads} thread(s), medians of 9, interleaved (default minimum rows)")
    print("| tokens | AMX ms | VNNI ms | AMX / VNNI |\n|--:|--:|--:|--:|")
    for n in (40, 128, 400):
        x = model.embed_tokens(torch.randint(0, 40000, (1, n), generator=g))
        on, off = toggled(lambda x=x: model.run_layers(x, model.new_cache(1024), 0), ext.set_amx_rows, 9)
        print(f"| {n} | {on * 1e3:.1f} | {off * 1e3:.1f} | {on / off:.3f} |")
