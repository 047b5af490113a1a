"""Where an `m2r2` round's wall clock goes, call by call, inside real greedy generation on MT-Bench first turns: every
call into the AVX2 build's C++ (through a proxy that times each op) and the named Python parts of a round (drafting,
choosing, the verify pass's layers and head, the answer store's proposals, the cache's compaction, ...), per pass and
per call. The C++ ops' time against their Python callers' is the Python around them.

    python experiments/round_calls.py [PROMPTS] [THREADS]
"""

import collections
import sys
import time

from warmed import GEN, warmed_first_turns

from m2r2 import amx
from m2r2 import model as model_mod
from m2r2.cache import KVCache
from m2r2.decoding import tree as tree_mod
from m2r2.decoding.answer_store import AnswerStore
from m2r2.decoding.tree import Tree, VerifyFit

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 20
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine, ids = warmed_first_turns(n_prompts, threads)
spent: dict[str, float] = collections.defaultdict(float)
calls: collections.Counter[str] = collections.Counter()


def timing(fn, key: str):
    def run(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        spent[key] += time.perf_counter() - t
        calls[key] += 1
        return out

    return run


class TimedOps:
    """The C++ extension with every op timed."""

    def __init__(self, ext) -> None:
        self.ext = ext

    def __getattr__(self, name: str):
        return timing(getattr(self.ext, name), f"c++ {name}")


ops = TimedOps(amx.avx2_extension())
amx.avx2_extension = lambda: ops
for owner, name, key in [
    (tree_mod.TreeSpeculative, "round", "round"),
    (tree_mod.TreeSpeculative, "draft", "draft"),
    (tree_mod.TreeSpeculative, "choose", "choose"),
    (tree_mod.TreeSpeculative, "costs_for", "costs_for"),
    (tree_mod.TreeSpeculative, "seed_state", "seed_state"),
    (model_mod.Transformer, "run_layers", "run_layers (prefills too)"),
    (model_mod.Transformer, "fused_stack", "fused_stack"),
    (AnswerStore, "propose", "answer store proposal"),
    (KVCache, "keep", "cache.keep"),
    (Tree, "ancestors", "tree.ancestors"),
    (Tree, "add_copies", "tree.add_copies"),
    (VerifyFit, "add", "verify_fit.add"),
]:
    setattr(owner, name, timing(getattr(owner, name), key))
tree_mod.head_argmax = timing(tree_mod.head_argmax, "head_argmax")

t0, passes = time.perf_counter(), 0
for prompt in ids[1:]:
    passes += engine.generate_ids(prompt, "m2r2", GEN).stats["verify_passes"]
elapsed = time.perf_counter() - t0
print(
    f"{engine.kernel}, {threads} thread(s), MT-Bench first turns 2..{n_prompts}: {passes} passes, "
    f"{elapsed / passes * 1e3:.3f} ms a pass"
)
print("| part | ms a pass | calls | us a call |")
print("|---|--:|--:|--:|")
for key in sorted(spent, key=lambda k: -spent[k]):
    print(f"| {key} | {spent[key] / passes * 1e3:.3f} | {calls[key]} | {spent[key] / calls[key] * 1e6:.1f} |")
