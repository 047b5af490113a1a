"""Tokens per verify pass of `m2r2` under several answer stores (`none` = off), side by side on the same
prompts (first turns, or both with TURNS=2), one thread; outputs checked identical. Built for the
thirteenth round's store sizes and min-count choices (docs/TRAINING.md).

    python experiments/answer_store_ab.py DATASET N TURNS none STORE.safetensors [STORE ...]
"""

import sys

from m2r2.bench.datasets import load_dataset
from m2r2.decoding.base import GenerationConfig
from m2r2.engine import Engine

engine = Engine(threads=1, quiet=True)
ds, N, turns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
variants = sys.argv[4:]
prompts = load_dataset(ds, N).prompts
gen = GenerationConfig(max_new_tokens=128)
strats = {v: engine.strategy("m2r2", answers=v) for v in variants}
tot = {v: [0, 0, 0.0, 0.0] for v in variants}
for pi, p in enumerate(prompts):
    outs = {}
    for v, s in strats.items():
        msgs = []
        for t in p.turns[:turns]:
            msgs.append({"role": "user", "content": t})
            ids = engine.tokenizer.encode_chat(msgs)
            r = s.generate(ids, gen)
            msgs.append({"role": "assistant", "content": engine.tokenizer.decode(r.tokens)})
            outs.setdefault(v, []).append(r.tokens)
            if pi == 0:
                continue
            x = tot[v]
            x[0] += len(r.tokens)
            x[1] += r.stats["verify_passes"]
            x[2] += r.seconds
            x[3] += r.stats["copied_accepted_per_token"] * len(r.tokens)
    assert all(o == outs[variants[0]] for o in outs.values()), "outputs differ"
for v, (n, ps, sec, c) in tot.items():
    print(f"{v:45s} tokens {n} tokens/pass {n / ps:.3f} copied/token {c / n:.3f} secs {sec:.1f}")
