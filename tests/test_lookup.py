"""Prompt lookup's index and its per-depth acceptance rates (the tree verifier's use of them is
tested in tests/test_tree.py)."""

from __future__ import annotations

import random

import pytest

from m2r2.decoding.lookup import LONG, PLAIN, SPLIT, LookupStats, NgramIndex


def _slow_propose(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The definition, by scanning: the longest final n-gram's latest earlier occurrence, continued."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        tail = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == tail:
                return tokens[end : end + k]
    return []


@pytest.mark.parametrize("seed", range(5))
def test_index_proposes_what_a_scan_of_the_context_finds(seed):
    rng = random.Random(seed)
    max_n, min_n = rng.choice([(3, 2), (3, 1), (4, 3)])
    index = NgramIndex(max_n=max_n, min_n=min_n)
    tokens: list[int] = []
    for _ in range(300):
        new = [rng.randrange(6) for _ in range(rng.randint(1, 3))]
        tokens += new
        index.extend(new)
        k = rng.randint(1, 8)
        assert index.propose(k) == _slow_propose(tokens, k, max_n, min_n)


@pytest.mark.parametrize("seed", range(3))
def test_a_proposal_after_one_more_token_is_what_extending_by_it_would_propose(seed):
    """``propose_after(t, k)``: the next round's copy had this one emitted ``t`` alone (the draft ledger's
    counterfactual), without touching the index; an occurrence that runs into ``t`` itself ends with it."""
    rng = random.Random(seed)
    max_n, min_n = rng.choice([(3, 2), (3, 1), (4, 3)])
    tokens: list[int] = []
    index = NgramIndex(max_n=max_n, min_n=min_n)
    for _ in range(300):
        t, k = rng.randrange(5), rng.randint(1, 8)
        assert index.propose_after(t, k) == NgramIndex([*tokens, t], max_n, min_n).propose(k)
        new = [rng.randrange(5) for _ in range(rng.randint(1, 3))]
        tokens += new
        index.extend(new)
    assert NgramIndex([7, 7], 3, 2).propose_after(7, 4) == [7]  # (7, 7) ended at 2: nothing after it but t


def test_index_copies_the_latest_occurrence_and_refuses_bad_sizes():
    index = NgramIndex([1, 2, 3, 4, 1, 2, 3, 9, 8, 1, 2, 3])
    assert index.propose(3) == [9, 8, 1]  # the later of the two earlier "1 2 3"
    assert NgramIndex([1, 2, 3]).propose(4) == []
    with pytest.raises(ValueError):
        NgramIndex(max_n=1, min_n=2)


def test_stats_learn_per_depth_rates_and_count_only_depths_really_tried():
    stats = LookupStats()
    assert stats.path_probs(2) == [0.5, 0.25]
    for _ in range(8):
        stats.record(offered=4, accepted=1)  # depth 1 always right, depth 2 always wrong, 3-4 never reached
    p = stats.path_probs(4)
    assert p[0] == pytest.approx(9 / 10)
    assert p[1] == pytest.approx(9 / 10 * 1 / 10)
    assert stats.tries[2:] == [0.0, 0.0]  # past the first miss nothing was tried
    assert p[0] > p[1] > p[2] > p[3]


def _slow_split(tokens: list[int], max_n: int, min_n: int) -> set[tuple[int, ...]]:
    """The definition, by scanning: the n-grams two of whose occurrences are followed by different tokens."""
    after: dict[tuple[int, ...], set[int]] = {}
    for n in range(min_n, max_n + 1):
        for end in range(n, len(tokens)):
            after.setdefault(tuple(tokens[end - n : end]), set()).add(tokens[end])
    return {gram for gram, nxt in after.items() if len(nxt) > 1}


@pytest.mark.parametrize("seed", range(3))
def test_index_knows_which_ngrams_were_followed_by_different_tokens(seed):
    rng = random.Random(seed)
    index, tokens = NgramIndex(), []
    for _ in range(200):
        new = [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        tokens += new
        index.extend(new)
        assert index.split == _slow_split(tokens, 3, 2)


def test_a_proposal_s_match_class_says_how_far_back_it_matches_and_whether_it_split():
    """``LONG``: the occurrence's 8 tokens before the proposal equal the context's; ``SPLIT``: the matched n-gram was
    followed by different tokens before; ``PLAIN``: any other proposal, or none."""
    ten = list(range(1, 11))
    assert NgramIndex([*ten, 20, *ten]).match_class() == LONG  # "1 .. 10" again: copy "20 1 2 ..."
    plain = NgramIndex([5, 6, 7, 1, 2, 3, 9, 1, 2, 3])  # "1 2 3" matched 3 tokens back (7 != 9)
    assert plain.propose(2) == [9, 1] and plain.match_class() == PLAIN
    split = NgramIndex([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3])  # "1 2 3" was followed by 4, then by 5
    assert split.propose(1) == [5] and split.match_class() == SPLIT
    assert NgramIndex([1, 2, 3]).match_class() == PLAIN  # nothing proposed


def test_stats_start_every_depth_at_their_prior():
    """A match class's prior hit rate (worth two rounds) prices a chain until its rounds are counted; ``deeper``
    starts the depths after the first at another rate."""
    assert LookupStats(prior=0.9).path_probs(2) == pytest.approx([0.9, 0.81])
    stats = LookupStats(prior=0.9)
    stats.record(offered=1, accepted=0)
    assert stats.path_probs(1) == pytest.approx([1.8 / 3])
    stats = LookupStats(prior=0.5, deeper=0.8)
    assert stats.path_probs(3) == pytest.approx([0.5, 0.4, 0.32])
    stats.record(offered=2, accepted=1)  # depth 1 right, depth 2 wrong
    assert stats.path_probs(2) == pytest.approx([2 / 3, 2 / 3 * 1.6 / 3])
