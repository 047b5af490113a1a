"""Which part of the AMX tile loop (`csrc_avx2/q4_amx_rows.cpp`) costs what: copies of its sources with one part
left out (their outputs are wrong: timing only), each built as its own extension, run in turn over the same 4-bit
weights (SmolLM2's gate|up and down projections of block 0) at 4, 16 and 64 rows with the tiles allowed at every
size; medians of 55 calls, microseconds. `no_terms`: no float terms (the stored sums are not read); `no_stage`:
only the first chunk of groups is put into B form; `no_tiles`: no tile loads, products or stores; `no_tilestore`:
the products' sums are not stored. If the parts overlapped, leaving one out would save less than its own time.

    python experiments/amx_parts.py [THREADS]
"""

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from m2r2 import amx
from m2r2.engine import Engine
from m2r2.machine import cpu_name

src = Path(amx.__file__).with_name("csrc_avx2")
F = "q4_amx_rows.cpp"
variants = {
    "base": [],
    "no_terms": [
        (
            "    for (i = 0; i < n; ++i) {  // pair_rows' float terms",
            "    for (i = 0; i < 0; ++i) {  // pair_rows' float terms",
        )
    ],
    "no_stage": [
        (
            "    for (int64_t i = 0; i < n; ++i) stage_group<BITS>(qb + (g0 + i) * 2 * gbytes, wb[i]);",
            "    if (g0 == 0) for (int64_t i = 0; i < n; ++i) stage_group<BITS>(qb, wb[i]);",
        )
    ],
    "no_tiles": [
        (
            "    for (; i + 2 <= n; i += 2) {\n      _tile_loadd(1",
            "    for (; i + 2 <= 0; i += 2) {\n      _tile_loadd(1",
        ),
        ("    if (i < n) {\n      _tile_loadd(1", "    if (false) {\n      _tile_loadd(1"),
    ],
    "no_tilestore": [("      _tile_stored(2, cs[i], 64);\n      _tile_stored(5, cs[i + 1], 64);", "")],
}
exts = {}
for name, edits in variants.items():
    tmp = Path(tempfile.mkdtemp())
    for f in src.iterdir():
        if f.suffix in (".cpp", ".h"):
            shutil.copy(f, tmp / f.name)
    text = (tmp / F).read_text()
    for old, new in edits:
        assert text.count(old) == 1, (name, old[:50])
        text = text.replace(old, new)
    (tmp / F).write_text(text)
    exts[name] = amx._build("amxp_" + name, sorted(tmp.glob("*.cpp")), sorted(tmp.glob("*.h")), list(amx.AVX2_FLAGS))
    assert exts[name] is not None
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
e = Engine(threads=threads, quiet=True)
print(f"{cpu_name()}, {threads} thread(s); us a call, medians of 55")
b = e.model.layers[0]
for ext in exts.values():
    ext.set_amx_min_rows(1)
for lname, m in (("w13", b.mlp.w13), ("w2", b.mlp.w2)):
    for M in (4, 16, 64):
        x = torch.randn(M, m.in_features).to(torch.bfloat16)
        ts = {k: [] for k in exts}
        for _ in range(60):
            for k, ext in exts.items():
                t = time.perf_counter()
                getattr(ext, m.op)(x, m.qbytes, m.scales)
                ts[k].append(time.perf_counter() - t)
        print(lname, M, " ".join(f"{k}={statistics.median(v[5:]) * 1e6:.1f}us" for k, v in ts.items()), flush=True)
