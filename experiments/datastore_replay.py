"""Would a datastore of the model's own answers draft what prompt lookup misses? (REST-style retrieval)

Replays the base model's greedy answers to all 60 MT-Bench first turns (teacher-forced, as
`eval-align` does) and, at every answer position, asks two copy sources for up to 4 tokens:
- prompt lookup: the continuation of the latest earlier occurrence of the context's last 3- or
  2-gram (:class:`m2r2.decoding.lookup.NgramIndex`, what `m2r2` offers its tree today);
- a datastore: an n-gram model of the base model's own answers to *training* prompts (the distill
  files), proposing greedily the most frequent next token after the longest matching 4/3/2-gram
  (count >= MIN_COUNT), token after token.
Prints how often each proposes, how often its first token is right, tokens accepted per position,
and what the datastore adds where lookup has nothing right.

    python experiments/datastore_replay.py ANSWERS.jsonl [ANSWERS.jsonl ...]
"""

import json
import sys
from collections import Counter

import numpy as np

from m2r2.decoding.lookup import NgramIndex

EVAL = "runs/eval/mt_bench-60-96-fp32.jsonl"
K, NS, MIN_COUNT = 4, (4, 3, 2), 2
MUL = np.int64(1_000_003)


def keys_of(windows: np.ndarray) -> np.ndarray:
    """int64 hash of each row of n tokens (wrapping arithmetic; collisions are negligible here)."""
    key = np.zeros(len(windows), dtype=np.int64)
    for j in range(windows.shape[1]):
        key = key * MUL + windows[:, j].astype(np.int64) + 1
    return key


class Datastore:
    def __init__(self, seqs: list[list[int]]) -> None:
        self.tables = {}
        for n in NS:
            ks, nx = [], []
            for s in seqs:
                a = np.asarray(s, dtype=np.int64)
                if len(a) <= n:
                    continue
                win = np.lib.stride_tricks.sliding_window_view(a[:-1], n)
                ks.append(keys_of(win))
                nx.append(a[n:])
            k, x = np.concatenate(ks), np.concatenate(nx)
            order = np.lexsort((x, k))
            k, x = k[order], x[order]
            pair_start = np.flatnonzero(np.r_[True, (k[1:] != k[:-1]) | (x[1:] != x[:-1])])
            counts = np.diff(np.r_[pair_start, len(k)])
            pk, px = k[pair_start], x[pair_start]
            # per key: the most frequent next token (last among ties after a stable sort by count)
            o = np.lexsort((counts, pk))
            pk, px, counts = pk[o], px[o], counts[o]
            last = np.flatnonzero(np.r_[pk[1:] != pk[:-1], True])
            keep = counts[last] >= MIN_COUNT
            self.tables[n] = (pk[last][keep], px[last][keep])
        self.size = sum(len(t[0]) for t in self.tables.values())

    def next(self, ctx: list[int]) -> int | None:
        for n in NS:
            if len(ctx) < n:
                continue
            key = keys_of(np.asarray(ctx[-n:], dtype=np.int64)[None, :])[0]
            ks, xs = self.tables[n]
            i = np.searchsorted(ks, key)
            if i < len(ks) and ks[i] == key:
                return int(xs[i])
        return None

    def propose(self, ctx: list[int], k: int) -> list[int]:
        out: list[int] = []
        for _ in range(k):
            t = self.next(ctx + out)
            if t is None:
                break
            out.append(t)
        return out


def accepted(prop: list[int], truth: list[int]) -> int:
    n = 0
    for a, b in zip(prop, truth, strict=False):
        if a != b:
            break
        n += 1
    return n


def main() -> None:
    files = sys.argv[1:]
    seqs = [json.loads(x)["answer_ids"] for f in files for x in open(f) if x.strip()]
    store = Datastore(seqs)
    print(f"datastore: {len(seqs)} answers, {sum(map(len, seqs)):,} tokens, {store.size:,} n-gram entries")
    stats: Counter = Counter()
    for line in open(EVAL):
        r = json.loads(line)
        p, a = r["prompt_ids"], r["answer_ids"]
        idx = NgramIndex(p)
        for i in range(len(a)):
            ctx, truth = p + a[:i], a[i : i + K]
            lk = idx.propose(K)
            ds = store.propose(ctx, K)
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


if __name__ == "__main__":
    main()
