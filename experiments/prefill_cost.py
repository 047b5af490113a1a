"""What a prompt's prefill costs by its length (1 thread, best of 3), the MT-Bench first turns' prompt
lengths, and two of its parts: SmolLM2's fused attention per layer over the whole cache capacity
(prompt + 128 + 32 slots, as before the fourteenth round) against over the filled slots only, and one
layer's four linear layers by rows on the 4-bit kernel against oneDNN's bf16 GEMM (weights cache-hot).
The prefill is paid by every method alike, once per turn, and is part of each prompt's time in
`m2r2 bench`.

    python experiments/prefill_cost.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

from m2r2.bench.datasets import load_dataset
from m2r2.engine import Engine
from m2r2.kernels import dense_weight


def best_ms(f, repeats: int = 10) -> float:
    f()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


engine = Engine(threads=1, quiet=True)
model = engine.model
cfg = model.cfg
prompts = load_dataset("mt_bench", 60).prompts
lengths = [len(engine.tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}])) for p in prompts]
print("first-turn prompt tokens: median", statistics.median(lengths), "mean", sum(lengths) / len(lengths))
with torch.inference_mode():
    for n in (1, 16, 32, 64, 128, 256, 384):
        ids = torch.arange(n)[None] % 1000 + 100
        ms = best_ms(lambda ids=ids, n=n: model(ids, model.new_cache(n + 200), 0, last_only=True), repeats=3)
        print(f"prefill {n:4d} tokens: {ms:7.1f} ms  ({ms / n:.2f} ms/token)")
    for t in (67, 128, 300):
        cap = t + 128 + 32
        q = torch.randn(1, cfg.num_heads, t, cfg.head_dim).bfloat16()
        k, v = (torch.randn(1, cfg.num_kv_heads, cap, cfg.head_dim).bfloat16() for _ in range(2))
        mask = torch.arange(cap)[None] <= torch.arange(t)[:, None]
        whole = best_ms(
            lambda q=q, k=k, v=v, m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        )
        filled = best_ms(
            lambda q=q, k=k, v=v, m=mask, t=t: F.scaled_dot_product_attention(
                q, k[:, :, :t], v[:, :, :t], attn_mask=m[:, :t], enable_gqa=True
            )
        )
        print(f"attention, {t} rows, one layer: {whole:.2f} ms over {cap} slots, {filled:.2f} ms over {t}")
    linears = [m for m in model.layers[0].modules() if type(m).__name__.endswith("Linear")]
    dense = [dense_weight(m).to(torch.bfloat16) for m in linears]
    for rows in (1, 4, 8, 16, 64, 256):
        q4 = bf16 = 0.0
        for lin, w in zip(linears, dense, strict=True):
            x = torch.randn(rows, w.shape[1], dtype=torch.bfloat16)
            q4 += best_ms(lambda lin=lin, x=x: lin(x), repeats=20)
            bf16 += best_ms(lambda x=x, w=w: F.linear(x, w), repeats=20)
        print(
            f"one layer's linears, {rows:3d} rows: 4-bit {q4 / rows:.3f} ms/row, oneDNN bf16 {bf16 / rows:.3f} ms/row"
        )
