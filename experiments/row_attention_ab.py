"""The AVX2 row attention against a saved run of another build: 180 random cases (5 head layouts, 1-700 keys,
1-5 rows, bfloat16 and float32 caches, random masks) must give the same bits; then microseconds per call
(best of 300, 1 thread) for SmolLM2's 9/3 heads at 264 and 600 keys, 1 and 4 rows. ``against DIR`` instead
builds the ``csrc_avx2`` sources in DIR (a copy of the old ones) and compares the two builds call by call over
2,520 more cases (7 head layouts, head sizes 8-256, 1-300 keys, 1-9 rows, batches of 1-2, 1 and 2 threads;
half of them with random masks, half with a verify pass's tree masks; half with queries rounded to bfloat16, as a
bfloat16 model's are, which a bfloat16 cache runs on the AVX-512 build where the CPU has AVX512-BF16). The timings
run SmolLM2's bfloat16 queries, with the AVX-512 build off and on where this CPU has it.

    git stash; python experiments/row_attention_ab.py save runs/attn-ref.pt; git stash pop
    python experiments/row_attention_ab.py check runs/attn-ref.pt
    python experiments/row_attention_ab.py against /tmp/old-csrc_avx2
"""

import itertools
import sys
import time
from pathlib import Path

import torch

from m2r2 import amx

ext = amx.avx2_extension()
assert ext is not None, "the AVX2 build does not run here"


def tree_mask(B: int, T: int, S: int, g: torch.Generator) -> torch.Tensor:
    """A verify pass's mask: every row sees the first S - T keys (some cut by a random gap), then a random
    subset of the pass's own T keys, always its own (a tree row sees its ancestors)."""
    if S < T:  # no room for a tree behind a prefix
        return torch.rand(B, T, S, generator=g) < 0.7
    m = torch.ones(B, T, S, dtype=torch.bool)
    m[:, :, S - T :] = torch.rand(B, T, T, generator=g) < 0.5
    m[:, :, S - T :] |= torch.eye(T, dtype=torch.bool)
    if S > T + 4:
        m[:, :, 2:4] = False
    return m


if sys.argv[1] == "against":
    src = Path(sys.argv[2])
    old = amx._build("attn_old", sorted(src.glob("*.cpp")), sorted(src.glob("*.h")), list(amx.AVX2_FLAGS))
    g = torch.Generator().manual_seed(1)
    layouts = [(3, 3), (2, 1), (9, 3), (8, 2), (14, 2), (12, 2), (4, 1)]
    grid = itertools.product(
        layouts, [8, 24, 64, 72, 128, 256], [torch.bfloat16, torch.float32], [1, 5, 37, 70, 300], [1, 3, 9], [1, 2]
    )
    for n, ((H, KVH), D, dt, S, T, threads) in enumerate(grid):
        torch.set_num_threads(threads)
        B = 1 + (n // 2) % 2
        q = torch.randn(B, H, T, D, generator=g) * 2
        if n // 4 % 2:
            q = q.bfloat16().float()
        k = (torch.randn(B, KVH, S + 3, D, generator=g) * 2).to(dt)
        v = torch.randn(B, KVH, S + 3, D, generator=g).to(dt)
        if n % 2:
            mask = torch.rand(B, T, S + 3, generator=g) < 0.7
        else:
            mask = torch.cat([tree_mask(B, T, S, g), torch.zeros(B, T, 3, dtype=torch.bool)], dim=-1)
        mask[:, :, S:] = False
        args = (q, k, v, mask, D**-0.5)
        assert torch.equal(ext.row_attention(*args), old.row_attention(*args)), (H, KVH, D, dt, S, T, threads)
    print("cases", n + 1, "identical (half random masks, half tree masks; half bfloat16 queries)")
    sys.exit()
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
        q = torch.randn(1, 9, T, 64).bfloat16().float()
        k = torch.randn(1, 3, S, 64).bfloat16()
        v = torch.randn(1, 3, S, 64).bfloat16()
        m = torch.ones(1, T, S, dtype=torch.bool)
        times = []
        for wide in (False, True):
            ext.set_avx512_attention(wide)
            best = 1e9
            for _ in range(300):
                t = time.perf_counter()
                ext.row_attention(q, k, v, m, 0.125)
                best = min(best, time.perf_counter() - t)
            times.append(f"{best * 1e6:.1f} us")
        ext.set_avx512_attention(True)
        print(f"S={S} T={T}: {times[0]}, AVX-512 build {times[1] if ext.avx512_attention_in_use() else '(not here)'}")
