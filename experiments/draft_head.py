"""What the seeded drafter's head costs and buys: draft vocabulary size x head kernel bits.

    python experiments/draft_head.py [N_PROMPTS] [--threads N] [--model NAME --answers OWN_ANSWERS.jsonl]
                                     [--adapters SEEDED_FILE --sizes shipped]

For each variant the shipped seeded stream (inference form: folded layers, the decoding kernel) is
teacher-forced on the bundled model's own greedy answers to the first N MT-Bench prompts (what `m2r2 bench`
verifies): at every answer position it is seeded with the true final slow state of the previous
position and the true token, and its top-1 draft is compared with the model's next token (draft 1,
as a tree's first level sees it; :func:`m2r2.training.evaluate.first_draft_agreement`). Until the
thirty-fourth round this script left each draft's fast K/V in the slow cache slot it borrowed, so later
positions read a fast key among the slow ones and agreement read ~0.04 low (0.379 for 0.424 today).
Also printed: how many answer tokens the draft vocabulary holds,
and the time of one draft level over 1 and 2 open nodes relative to a one-token step (every
variant and the step timed in turn, minimum of 30 rounds), on this machine.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from m2r2.bench.datasets import shared_eval_dir
from m2r2.decoding.base import GenerationConfig
from m2r2.decoding.tree import Tree
from m2r2.engine import Engine
from m2r2.kernels import head_argmax, linear_like
from m2r2.paths import shared_data
from m2r2.training.evaluate import first_draft_agreement
from m2r2.training.vocab import build_from_files

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("prompts", nargs="?", type=int, default=10)
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--answers", default="runs/distill/answers-1920.jsonl", help="own answers the vocabulary counts")
parser.add_argument("--model", default=None, help="bundled model name (default: smollm2-135m)")
parser.add_argument("--sizes", default="shipped,8192,4096,2048,1024", help="draft vocabularies to try")
parser.add_argument("--adapters", default=None, help="a seeded stream's file instead of the shipped one")
args = parser.parse_args()

engine = Engine(args.model, threads=args.threads, quiet=True)
model, tok = engine.model, engine.tokenizer
drafter = engine.strategy("m2r2", **({"adapters": args.adapters} if args.adapters else {})).drafter
fast = drafter.fast
rows = [json.loads(x) for x in (shared_eval_dir() / "mt_bench.jsonl").open()][: args.prompts]
seqs = []
for row in rows:
    ids = tok.encode_chat([{"role": "user", "content": row["turns"][0]}])
    out = engine.generate_ids(ids, "vanilla", GenerationConfig(max_new_tokens=96)).tokens
    seqs.append((ids, out))
answer_tokens = [t for _, a in seqs for t in a]

train_prompts = shared_data("train") / "prompts.jsonl"


def vocabulary(size: int) -> torch.Tensor:
    """The ``size`` most frequent tokens, counted as `m2r2 draft-vocab` counts them."""

    def encode(texts: list[str]) -> list[list[int]]:
        return tok.hf(texts, add_special_tokens=False)["input_ids"]

    return build_from_files(Path(args.answers), train_prompts, size, model.cfg.vocab_size, tok.eos_ids, encode)


def set_head(vocab: torch.Tensor | None, bits: int) -> None:
    """Point the drafter's head at ``vocab`` rows with the 8-bit head kernel or the layers' 4-bit one."""
    fast.draft_vocab = vocab
    template = model.lm_head if bits == 8 else model.layers[0].mlp.w2
    fast.sub_head = linear_like(template, fast.head_weight().float())


def timings(variants: list[tuple[torch.Tensor, torch.nn.Module]]) -> tuple[list[float], list[float], float]:
    """Per variant, one draft level over 1 and 2 open nodes, and one one-token step (seconds): minimum
    of 30 rounds in which every variant and the step run in turn, so machine noise hits all alike."""
    ctx = 200
    cache = model.new_cache(ctx + 8)
    h = torch.zeros(1, 1, model.cfg.hidden_size, dtype=model.dtype)
    one = torch.ones(1, 1, dtype=torch.long)

    def level(variant: tuple[torch.Tensor, torch.nn.Module], r: int) -> None:
        fast.draft_vocab, fast.sub_head = variant
        drafter.start(h, cache, ctx)
        drafter.top(Tree([1] * r, [-1] * r, [0] * r, [1.0] * r), list(range(r)), 2)

    calls = [lambda: drafter.start(h, cache, ctx)]
    calls.append(lambda: head_argmax(model, model.run_layers(model.embed_tokens(one), cache, ctx)))
    calls += [lambda v=v, r=r: level(v, r) for v in variants for r in (1, 2)]
    best = [float("inf")] * len(calls)
    with torch.inference_mode():
        model(torch.arange(ctx)[None], cache, 0, last_only=True)
        for _ in range(30):
            for i, f in enumerate(calls):
                t = time.perf_counter()
                f()
                best[i] = min(best[i], time.perf_counter() - t)
    levels = [b - best[0] for b in best[2:]]
    return levels[0::2], levels[1::2], best[1]


shipped = fast.draft_vocab
rows, variants = [], []
for size in [None if x == "shipped" else int(x) for x in args.sizes.split(",")]:
    vocab = shipped if size is None else vocabulary(size)
    inside = set(vocab.tolist())
    cover = sum(t in inside for t in answer_tokens) / len(answer_tokens)
    for bits in (8, 4):
        set_head(vocab, bits)
        name = f"shipped ({len(vocab)})" if size is None else f"top {size}"
        rows.append((name, bits, cover, first_draft_agreement(model, drafter, seqs)))
        variants.append((fast.draft_vocab, fast.sub_head))
one_node, two_nodes, step = timings(variants)
print(f"{len(seqs)} MT-Bench first turns, {len(answer_tokens)} answer tokens; {args.threads} thread(s)")
print("| draft vocabulary | head | answer tokens inside | agree @1 | level, 1 node | 2 nodes |")
print("|---|---|--:|--:|--:|--:|")
for (name, bits, cover, a), l1, l2 in zip(rows, one_node, two_nodes, strict=True):
    print(
        f"| {name} | {bits}-bit | {cover:.3f} | {a:.3f} | {l1 * 1e3:.2f} ms ({l1 / step:.3f}) "
        f"| {l2 * 1e3:.2f} ms ({l2 / step:.3f}) |"
    )
print(f"one-token step {step * 1e3:.2f} ms")
