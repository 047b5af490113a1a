"""What the experiments that time parts of real generation share: an engine, MT-Bench first turns as chat token
ids, and one warm-up answer per method (which also measures the tree's costs), so the timed answers start warm.

    from warmed import GEN, warmed_first_turns   # in a script run as python experiments/NAME.py
"""

import torch

from m2r2.bench.datasets import load_dataset
from m2r2.cache import KVCache
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine

#: the answers these experiments time: greedy, up to 128 new tokens
GEN = GenerationConfig(max_new_tokens=128)


def warmed_first_turns(n_prompts: int, threads: int, first: int = 0) -> tuple[Engine, list[list[int]]]:
    """An engine on ``threads`` threads and MT-Bench prompts ``first..first+n_prompts-1`` (first turns, as chat
    ids), after `vanilla` and `m2r2` have each answered the first of them once."""
    engine = Engine(threads=threads, quiet=True)
    prompts = load_dataset("mt_bench", first + n_prompts).prompts[first:]
    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p.turns[0]}]) for p in prompts]
    for method in ("vanilla", "m2r2"):
        engine.generate_ids(ids[0], method, GEN)
    return engine, ids


def filled_context(model, prompt: list[int], ctx: int) -> tuple[KVCache, torch.Tensor]:
    """A bfloat16 cache with room for 64 more rows, prefilled with ``prompt`` repeated to ``ctx`` tokens, and
    those tokens ``[1, ctx]``: the real context the experiments that time one pass run their rows after."""
    cache = KVCache(model.cfg, ctx + 64, dtype=torch.bfloat16)
    toks = torch.tensor([(prompt * (ctx // len(prompt) + 1))[:ctx]])
    with torch.no_grad():
        model.run_layers(model.embed_tokens(toks), cache, 0)
    return cache, toks
