"""Which text should the answer store hold? The model's own answers, the corpus's real responses, or both?

REST (He et al. 2024) drafts from a datastore of *human/assistant text*; our store held only the base
model's own greedy answers to training prompts (1.35M tokens shipped for SmolLM2). The corpus in
``../shared/data/train`` holds ~5M tokens of real assistant responses: several times more text, but not
this model's phrasing. This replays a model's greedy answers to the 60 MT-Bench first turns (as
``answer_store_replay.py`` does) against stores built from each source, and prints per source: how
often it proposes, how often its first token is right, tokens accepted per position, the same where
prompt lookup has nothing (the tree asks the store only then), and prompt lookup's chain where it has
one, else the store's (what the tree offers).

    python experiments/store_sources.py [--model NAME] [--eval ANSWERS.jsonl] [--own ANSWERS.jsonl ...]
        [--shipped STORE]

``--eval``: the model's greedy answers to MT-Bench (``m2r2 eval-align --answers FILE`` writes them).
"""

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from answer_store_replay import accepted

from m2r2.decoding.answer_store import AnswerStore, load_answer_store, read_answers
from m2r2.decoding.lookup import NgramIndex
from m2r2.loading import fingerprint, resolve_model
from m2r2.paths import shipped_conversations
from m2r2.tokenizer import ChatTokenizer
from m2r2.training.store import assistant_turns

K = 4


def replay(store: AnswerStore | None, evals: list[dict]) -> Counter:
    s: Counter = Counter()
    for r in evals:
        p, a = r["prompt_ids"], r["answer_ids"]
        idx = NgramIndex(p)
        for i in range(len(a)):
            ctx, truth = p + a[:i], a[i : i + K]
            lk = idx.propose(K)
            ds = store.propose(ctx, K)[0] if store is not None else []
            la, da = accepted(lk, truth), accepted(ds, truth)
            s["positions"] += 1
            s["proposes"] += bool(ds)
            s["first"] += da > 0
            s["tokens"] += da
            if not lk:  # the tree asks the store only where lookup has nothing
                s["tokens_where_no_lookup"] += da
            s["lookup_else_store"] += la if lk else da
            idx.extend([a[i]])
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--eval", default="runs/eval/mt_bench-60-96-fp32.jsonl")
    ap.add_argument("--own", nargs="*", default=["runs/distill/answers-fresh-snap1.jsonl"])
    ap.add_argument("--shipped", default="src/m2r2/adapters/smollm2-135m-answers.safetensors")
    args = ap.parse_args()
    model_dir = resolve_model(args.model, quiet=True)
    fp = fingerprint(model_dir)
    evals = [json.loads(x) for x in Path(args.eval).read_text().splitlines()]
    own = read_answers([Path(f) for f in args.own]) if args.own else []
    t0 = time.time()
    texts = assistant_turns(shipped_conversations())
    hf = ChatTokenizer(model_dir).hf
    corpus = [
        ids
        for i in range(0, len(texts), 2048)
        for ids in hf(texts[i : i + 2048], add_special_tokens=False)["input_ids"]
    ]
    print(f"corpus: {len(corpus):,} responses, {sum(map(len, corpus)):,} tokens ({time.time() - t0:.0f} s to tokenize)")
    stores = {"none (prompt lookup alone)": lambda: None}
    if args.shipped:
        stores["shipped"] = lambda: load_answer_store(Path(args.shipped), fp)
    if own:
        stores[f"own answers ({len(own):,})"] = lambda: AnswerStore.build(own)
    stores["corpus responses"] = lambda: AnswerStore.build(corpus)
    stores["corpus responses, n-grams seen 3+ times"] = lambda: AnswerStore.build(corpus, min_count=3)
    if own:
        stores["corpus + own answers x4"] = lambda: AnswerStore.build(corpus + own * 4)
        stores["corpus + own answers x16"] = lambda: AnswerStore.build(corpus + own * 16)
    if own and args.shipped:
        stores["shipped over corpus + own x4"] = lambda: load_answer_store(Path(args.shipped), fp).over(
            AnswerStore.build(corpus + own * 4)
        )
        stores["shipped over corpus + own x4, 3+ times"] = lambda: load_answer_store(Path(args.shipped), fp).over(
            AnswerStore.build(corpus + own * 4, min_count=3)
        )
    n_pos = sum(len(r["answer_ids"]) for r in evals)
    print(f"{n_pos} answer positions ({args.eval}: greedy answers to MT-Bench first turns)")
    print("| store | n-grams | proposes | first right | tokens/position | where no lookup | lookup, else store |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for name, make in stores.items():
        store = make()
        s = replay(store, evals)
        n = s["positions"]
        print(
            f"| {name} | {len(store) if store is not None else 0:,} | {s['proposes'] / n:.3f} | {s['first'] / n:.3f} |"
            f" {s['tokens'] / n:.3f} | {s['tokens_where_no_lookup'] / n:.3f} | {s['lookup_else_store'] / n:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
