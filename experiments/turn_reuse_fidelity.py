"""Is a second turn over a carried cache as faithful to the model as one over a fresh prefill? The two
differ in their last bits (the carried K/V were computed by decoding steps, a fresh prefill recomputes them in
one pass with other kernels), so their greedy second turns part ways on some prompts. Each is scored
against the float32 reference model's second turn after the *same* history (the default engine's first
answer): exact-match rate, mean common prefix and mean ROUGE-L F (the benchmark's metric, as
`experiments/kernel_quality.py` scores kernels).

    python experiments/turn_reuse_fidelity.py [PROMPTS]
"""

import statistics
import sys

from m2r2.bench.datasets import load_dataset
from m2r2.bench.quality import rouge_l
from m2r2.cache import Conversation
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 20
engine = Engine(threads=1, quiet=True)
ref = Engine(dtype="fp32", threads=1, quiet=True)
gen = GenerationConfig(max_new_tokens=128)
scores: dict[str, list[dict]] = {"fresh": [], "carried": []}
for p in load_dataset("mt_bench", n_prompts).prompts:
    conv = Conversation()
    first = [{"role": "user", "content": p.turns[0]}]
    answer = engine.chat(first, method="vanilla", gen=gen, session=conv).text
    history = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": p.turns[1]}]
    target = ref.chat(history, method="vanilla", gen=gen)
    for mode, session in (("fresh", None), ("carried", conv)):
        out = engine.chat(history, method="vanilla", gen=gen, session=session)
        pairs = zip(out.result.tokens, target.result.tokens, strict=False)
        prefix = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        scores[mode].append(
            {
                "exact": out.result.tokens == target.result.tokens,
                "prefix": min(len(out.result.tokens), len(target.result.tokens)) if prefix is None else prefix,
                "rouge": rouge_l(target.text, out.text),
                "tokens": out.result.tokens,
            }
        )
same = sum(a["tokens"] == b["tokens"] for a, b in zip(scores["fresh"], scores["carried"], strict=True))
print(f"{engine.kernel} kernel against fp32, MT-Bench second turns 1..{n_prompts}, 128 tokens; "
      f"fresh and carried identical on {same} of {n_prompts}")  # fmt: skip
for mode, rows in scores.items():
    print(
        f"{mode:7s} exact {sum(r['exact'] for r in rows) / len(rows):.2f}  "
        f"mean prefix {statistics.fmean(r['prefix'] for r in rows):.1f}  "
        f"ROUGE-L {statistics.fmean(r['rouge'] for r in rows):.3f}"
    )
