"""The AVX2 row attention against a saved run of another build: 180 random cases (5 head layouts, 1-700 keys,
1-5 rows, bfloat16 and float32 caches, random masks) must give the same bits; then microseconds per call
(best of 300, 1 thread) for SmolLM2's 9/3 heads at 264 and 600 keys, 1 and 4 rows.

    git stash; python experiments/row_attention_ab.py save runs/attn-ref.pt; git stash pop
    python experiments/row_attention_ab.py check runs/attn-ref.pt
"""

import sys
import time

import torch

from m2r2 import amx

ext = amx.avx2_extension()
assert ext is not None, "the AVX2 build does not run here"
torch.manual_seed(0)
cases = []
for H, KVH, D in ((9, 3, 64), (14, 2, 64), (4, 4, 32), (8, 2, 128), (6, 3, 16)):
    for S in (1, 5, 13, 64, 264, 700):
        for T in (1, 3, 5):
            for dt in (torch.bfloat16, torch.float32):
                q = torch.randn(1, H, T, D) * 3
                k = (torch.randn(1, KVH, S, D) * 2).to(dt)
                v = torch.randn(1, KVH, S, D).to(dt)
                mask = torch.rand(1, T, S) < 0.8
                mask[0, 0, 0] = True
                cases.append((q, k, v, mask))
outs = [ext.row_attention(q, k, v, m, 0.125) for q, k, v, m in cases]
if sys.argv[1] == "save":
    torch.save(outs, sys.argv[2])
    print("saved", len(cases))
else:
    ref = torch.load(sys.argv[2])
    bad = sum(not torch.equal(a, b) for a, b in zip(outs, ref, strict=True))
    print("cases", len(ref), "differing", bad)
torch.set_num_threads(1)
for S in (264, 600):
    for T in (1, 4):
        q = torch.randn(1, 9, T, 64)
        k = torch.randn(1, 3, S, 64).bfloat16()
        v = torch.randn(1, 3, S, 64).bfloat16()
        m = torch.ones(1, T, S, dtype=torch.bool)
        best = 1e9
        for _ in range(300):
            t = time.perf_counter()
            ext.row_attention(q, k, v, m, 0.125)
            best = min(best, time.perf_counter() - t)
        print(f"S={S} T={T}: {best * 1e6:.1f} us")
