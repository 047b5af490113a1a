"""Would an answer store (n-grams of the model's own answers) draft what prompt lookup misses?

Replays the base model's greedy answers to all 60 MT-Bench first turns (teacher-forced, as
`eval-align` does) and, at every answer position, asks two copy sources for up to 4 tokens:
- prompt lookup: the continuation of the latest earlier occurrence of the context's last 3- or
  2-gram (:class:`m2r2.decoding.lookup.NgramIndex`, what `m2r2` offers its tree today);
- the answer store (:mod:`m2r2.decoding.answer_store`) built from the base model's own answers to
  *training* prompts (distill-data files): the most frequent follower of the longest matching
  4/3/2-gram seen at least twice, token after token.
Prints how often each proposes, how often its first token is right, tokens accepted per position,
and what the store adds where lookup has nothing right; then, where lookup has nothing, how often a
store token is right by its share of its n-gram's followers (tenths) and depth in the chain: the
calibration the tree's weighing of store chains rests on. (It cannot see the fast stream: what the store
adds end to end is measured by `m2r2 bench`, BENCHMARKS.md "Thirteenth round".)

    python experiments/answer_store_replay.py ANSWERS.jsonl [ANSWERS.jsonl ...]
"""

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from m2r2.decoding.answer_store import AnswerStore, read_answers
from m2r2.decoding.lookup import NgramIndex

EVAL = "runs/eval/mt_bench-60-96-fp32.jsonl"
K = 4


def accepted(prop: list[int], truth: list[int]) -> int:
    n = 0
    for a, b in zip(prop, truth, strict=False):
        if a != b:
            break
        n += 1
    return n


def main() -> None:
    answers = read_answers([Path(f) for f in sys.argv[1:]])
    store = AnswerStore.build(answers)
    print(f"answer store: {len(answers)} answers, {sum(map(len, answers)):,} tokens, {len(store):,} n-gram entries")
    stats: Counter = Counter()
    by_share: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])  # (depth, tenth) -> [right, tried]
    for line in Path(EVAL).read_text().splitlines():
        r = json.loads(line)
        p, a = r["prompt_ids"], r["answer_ids"]
        idx = NgramIndex(p)
        for i in range(len(a)):
            ctx, truth = p + a[:i], a[i : i + K]
            lk = idx.propose(K)
            ds, shares = store.propose(ctx, K)
            if not lk:  # the store's tokens in order, until the first wrong one
                for d, (t, share) in enumerate(zip(ds, shares, strict=True)):
                    if d >= len(truth):
                        break
                    cell = by_share[(d, min(int(share * 10), 9))]
                    cell[0] += t == truth[d]
                    cell[1] += 1
                    if t != truth[d]:
                        break
            la, da = accepted(lk, truth), accepted(ds, truth)
            stats["positions"] += 1
            stats["lookup_proposes"] += bool(lk)
            stats["lookup_first"] += la > 0
            stats["lookup_tokens"] += la
            stats["store_proposes"] += bool(ds)
            stats["store_first"] += da > 0
            stats["store_tokens"] += da
            stats["store_first_where_lookup_not"] += da > 0 and la == 0
            stats["best_tokens"] += max(la, da)
            idx.extend([a[i]])
    n = stats["positions"]
    print(f"{n} answer positions (MT-Bench 60 first turns, 96-token greedy answers)")
    for src in ("lookup", "store"):
        pr = stats[f"{src}_proposes"]
        print(
            f"{src:7s}: proposes at {pr / n:.3f} of positions; first token right {stats[f'{src}_first'] / n:.3f}"
            f" of positions ({stats[f'{src}_first'] / max(pr, 1):.3f} of its proposals);"
            f" {stats[f'{src}_tokens'] / n:.3f} tokens accepted per position"
        )
    print(
        f"store right where lookup is not: {stats['store_first_where_lookup_not'] / n:.3f} of positions;"
        f" the better of the two: {stats['best_tokens'] / n:.3f} tokens per position"
    )
    print("where lookup has nothing: a store token right / tried, by its share (tenths) and depth in the chain")
    print("share  " + "  ".join(f"{'depth ' + str(d + 1):>15s}" for d in range(K)))
    for b in range(10):
        cells = [by_share[(d, b)] for d in range(K)]
        row = "  ".join(f"{r:5d}/{t:5d} {r / t if t else 0:.2f}" for r, t in cells)
        print(f"{b / 10:.1f}+   {row}")


if __name__ == "__main__":
    main()
