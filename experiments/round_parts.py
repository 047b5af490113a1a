"""Where an `m2r2` round's wall clock goes, part by part, inside real greedy generation on MT-Bench
first turns (after a warm-up; 1 thread unless THREADS): drafting the tree, choosing its rows, the verify pass's
layers, its head, accepting, compacting the cache, and the rest of the round (Python around them).
`vanilla` is timed the same way for its one-token steps. Where a greedy pass runs as one C++ call
(`Transformer.greedy_pass`, from commit 56fcc7f) its layers, head and argmax are one part, `pass`.

    python experiments/round_parts.py [PROMPTS] [FIRST] [THREADS]
"""

import collections
import sys
import time

from warmed import GEN, warmed_first_turns

from m2r2.cache import KVCache
from m2r2.decoding import tree as tree_mod

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 8
first = int(sys.argv[2]) if len(sys.argv) > 2 else 0
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 1
engine, ids = warmed_first_turns(n_prompts, threads, first)
model = engine.model
gen = GEN

spent: dict[str, float] = collections.defaultdict(float)


def timed(owner, name, part):
    """Wrap ``owner.name`` so its wall clock adds to ``spent[part]`` (prefills of 40+ rows excluded)."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        x = next((a for a in args if hasattr(a, "shape")), None)
        if part != "layers" or x is None or x.shape[1] < 40:
            spent[part] += time.perf_counter() - t
        return out

    setattr(owner, name, staticmethod(wrapper) if isinstance(owner.__dict__.get(name), staticmethod) else wrapper)


timed(model, "run_layers", "layers")
timed(model, "greedy_pass", "pass")
timed(tree_mod, "head_argmax", "head")
timed(tree_mod.TreeSpeculative, "draft", "draft")
timed(tree_mod.TreeSpeculative, "choose", "choose")
timed(tree_mod.TreeSpeculative, "_accept", "accept")
timed(KVCache, "keep", "keep")
timed(tree_mod.TreeSpeculative, "round", "round")
print(f"{engine.kernel} kernel, {threads} thread(s), MT-Bench prompts {first + 2}..{first + n_prompts} timed")
for method in ("vanilla", "m2r2"):
    spent.clear()
    t0, tokens, passes, rows = time.perf_counter(), 0, 0, 0.0
    for prompt in ids[1:]:
        r = engine.generate_ids(prompt, method, gen)
        tokens += len(r.tokens)
        n = r.stats.get("verify_passes", len(r.tokens))
        passes += n
        rows += r.stats.get("verify_rows_per_pass", 1.0) * n
    elapsed = time.perf_counter() - t0
    per_pass = {k: v / passes * 1e3 for k, v in spent.items()}
    ms = elapsed / passes * 1e3
    print(
        f"{method}: {tokens / elapsed:.1f} tok/s, {tokens / passes:.2f} tokens/pass, {rows / passes:.2f} rows/pass, "
        f"{ms:.2f} ms/pass"
    )
    inner = sum(per_pass.get(k, 0.0) for k in ("pass", "layers", "head", "draft", "choose", "accept", "keep"))
    for k in ("draft", "choose", "pass", "layers", "head", "accept", "keep"):
        if k in per_pass:
            print(f"  {k:7s} {per_pass[k]:6.2f} ms/pass")
    if "round" in per_pass:
        print(f"  rest of round {per_pass['round'] - inner:6.2f} ms/pass")
    rest = "the rest (head, sampling, prefill, loop)"
    outside = "outside rounds (prefill, stopping)" if "round" in per_pass else rest
    print(f"  {outside} {ms - per_pass.get('round', inner):6.2f} ms/pass")
