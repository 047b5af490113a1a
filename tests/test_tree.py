"""The seeded fast stream and token-tree self-speculation: lossless on many tiny random models,
training and inference compute the same drafts, and the training store resumes and refuses bad data."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from tests.test_speculative import _exact_marginal, tiny_model

from m2r2.decoding.autoregressive import Autoregressive
from m2r2.decoding.base import GenerationConfig
from m2r2.decoding.lookup import PLAIN, SPLIT, NgramIndex
from m2r2.decoding.tree import (
    AGREES,
    DIFFERS,
    EVERY_MATCH,
    NO_OPINION,
    OPINION_PRIORS,
    STORE_CALIBS,
    DraftLedger,
    Tree,
    TreeCosts,
    TreeSpeculative,
    TreeState,
    VerifyFit,
    opinion_table,
)
from m2r2.errors import InputError, SettingsError, WeightsError
from m2r2.multirate.seeded import SeededConfig, SeededFastStream


def seeded_stream(
    model, depth: int, noise: float, seed: int, fold: bool, vocab: list[int] | None = None, gated: bool = False
):
    """A seeded fast stream over the last ``depth`` layers; ``noise`` perturbs fuse, adapters and (``gated``:
    the first fast layer is a grown one) its gates."""
    n = model.cfg.num_layers
    grown = [n - depth] if gated else None
    cfg = SeededConfig.build(n, depth=depth, rank=4, gated=grown, attention_only=grown if depth > 2 else None)
    fast = SeededFastStream(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    if vocab is not None:
        fast.draft_vocab = torch.tensor(sorted(vocab))
    return fast.freeze(merge=fold)


CASES = [
    # seed, depth, noise, max_nodes, width, branch, dtype
    (1, 1, 0.0, 1, 1, 1, torch.float32),
    (2, 2, 0.05, 4, 1, 1, torch.float32),
    (3, 1, 0.2, 8, 2, 2, torch.float32),
    (4, 3, 0.0, 12, 3, 2, torch.float32),
    (5, 1, 0.1, 6, 2, 3, torch.bfloat16),
    (6, 2, 0.3, 3, 1, 2, torch.bfloat16),
    (7, 1, 0.0, 16, 4, 4, torch.bfloat16),
    (8, 2, 0.02, 5, 2, 1, torch.float32),
    (9, 2, 0.1, 8, 2, 2, torch.float32),  # seeds >= 9: a grown stream, its gates folded (odd) or not
    (10, 3, 0.1, 6, 2, 2, torch.bfloat16),  # its grown layer runs attention only
]


@pytest.mark.parametrize("lookup", [0, 5])
@pytest.mark.parametrize(("seed", "depth", "noise", "nodes", "width", "branch", "dtype"), CASES)
def test_greedy_tree_speculation_equals_plain_greedy(seed, depth, noise, nodes, width, branch, dtype, lookup):
    """With prompt lookup on, prompts repeat a random phrase so that copied nodes join the trees."""
    rng = random.Random(seed)
    model = tiny_model(seed, dtype=dtype)
    fold = seed % 2 == 1
    vocab = rng.sample(range(64), 40) if fold else None
    fast = seeded_stream(model, depth, noise, seed, fold, vocab, gated=seed >= 9)
    strat = TreeSpeculative("m2r2", model, fast, [], None, nodes, rng.randint(1, 6), width, branch, lookup=lookup)
    passes = 0
    for _ in range(3):
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 30))]
        if lookup:
            prompt = (prompt * 3)[: rng.randint(len(prompt), 3 * len(prompt))]
        gen = GenerationConfig(max_new_tokens=rng.randint(1, 60))
        ref = Autoregressive(model, []).generate(prompt, gen)
        out = strat.generate(prompt, gen)
        assert out.tokens == ref.tokens
        assert out.stop_reason == ref.stop_reason
        passes += out.stats["verify_passes"]
        # the cache after a tree round holds exactly the verified sequence (compacted accepted path)
        full = torch.tensor([prompt + out.tokens[:-1]])
        fresh = model.new_cache(strat.last_cache.max_len)
        model(full, fresh, 0)
        n = len(prompt) + len(out.tokens) - 1
        assert strat.last_cache.length == n
        assert torch.allclose(strat.last_cache.k[:, :, :, :n].float(), fresh.k[:, :, :, :n].float(), atol=2e-2)


@pytest.mark.parametrize("fast_noise", [0.0, 3.0])
def test_prompt_lookup_copies_are_accepted_and_the_output_stays_plain_greedy(fast_noise):
    """A tiny random model's greedy output soon loops, which prompt lookup can copy: copied nodes are
    verified and accepted (alone when the fast stream is made useless by noise, or merged into its
    trees), the tokens stay plain greedy, and sampling never copies."""
    model = tiny_model(21)
    fast = seeded_stream(model, 1, fast_noise, 21, fold=True)
    prompt = [5, 9, 14, 2, 5, 9, 14, 2, 33]
    gen = GenerationConfig(max_new_tokens=80)
    ref = Autoregressive(model, []).generate(prompt, gen)
    plain = TreeSpeculative("m2r2", model, fast, [], None, 8, 4, 2, 2).generate(prompt, gen)
    copying = TreeSpeculative("m2r2", model, fast, [], None, 8, 4, 2, 2, lookup=6).generate(prompt, gen)
    assert copying.tokens == plain.tokens == ref.tokens
    assert plain.stats["copied_accepted_per_token"] == 0.0
    assert copying.stats["copied_accepted_per_token"] > 0.1, copying.stats
    if fast_noise:  # copies alone save passes; with a good fast stream they may merge with its drafts
        assert copying.stats["verify_passes"] < plain.stats["verify_passes"]
    sampled = GenerationConfig(max_new_tokens=40, temperature=0.8, seed=3)
    out = TreeSpeculative("m2r2", model, fast, [], None, 8, 4, 2, 2, lookup=6).generate(prompt, sampled)
    assert out.stats["copied_accepted_per_token"] == 0.0
    # the ablation without the fast stream: copies alone, no draft level run, the same tokens
    alone = TreeSpeculative("m2r2", model, fast, [], None, 8, 4, 2, 2, lookup=6, draft="never").generate(prompt, gen)
    assert alone.tokens == ref.tokens and alone.stats["draft_layers_per_token"] == 0.0
    assert alone.stats["copied_accepted_per_token"] > 0.1 and alone.stats["verify_passes"] < len(ref.tokens)
    # drafting only where no copy is proposed: fewer draft levels than always, none where every round copies
    uncopied = TreeSpeculative("m2r2", model, fast, [], None, 8, 4, 2, 2, lookup=6, draft="uncopied")
    out = uncopied.generate(prompt, gen)
    assert out.tokens == ref.tokens and out.stats["copied_accepted_per_token"] > 0.1
    assert out.stats["draft_layers_per_token"] < copying.stats["draft_layers_per_token"]
    with pytest.raises(SettingsError, match="draft must be one of"):
        TreeSpeculative("m2r2", model, fast, [], None, draft="sometimes")
    # copies priced by their match class alone or by depth alone (the ablations of the store's opinion): other rows,
    # the same tokens
    for price in ("match", "depth"):
        priced = TreeSpeculative("m2r2", model, fast, [], None, 8, 4, 2, 2, lookup=6, copy_price=price)
        out = priced.generate(prompt, gen)
        assert out.tokens == ref.tokens and out.stats["copied_accepted_per_token"] > 0.1
    with pytest.raises(SettingsError, match="copy_price must be one of"):
        TreeSpeculative("m2r2", model, fast, [], None, copy_price="cheap")


def test_a_copied_chain_is_priced_by_its_match_and_what_the_answer_store_says_of_it():
    """``copy_price="opinion"`` (the default): lookup's chain takes the hit rates of its match class and the store's
    opinion of its first token, asked after the same context (the same token, another, none); each table starts from
    its class and opinion's replayed rates, the first depth's and the later ones'. ``match`` and ``depth`` ignore the
    store."""

    class Store:  # proposes ``follow`` after any context
        def __init__(self, follow: list[int]) -> None:
            self.follow = follow

        def propose(self, context: list[int], k: int) -> tuple[list[int], list[float]]:
            return self.follow[:k], [0.5] * min(k, len(self.follow))

    model = tiny_model(seed=0)
    fast = SeededFastStream(model, SeededConfig.build(4, depth=2, rank=2)).eval()
    context = NgramIndex([5, 6, 7, 1, 2, 3, 9, 1, 2, 3])  # plain match: proposes [9, 1, ...]
    chain = context.propose(2)
    spec = TreeSpeculative("m2r2", model, fast, [], None, lookup=6)
    assert spec._copy_table(context, PLAIN, chain) == opinion_table(PLAIN, NO_OPINION)  # no store
    for follow, opinion in (([9, 4], AGREES), ([8], DIFFERS), ([], NO_OPINION)):
        spec.answers = Store(follow)
        assert spec._copy_table(context, PLAIN, chain) == opinion_table(PLAIN, opinion)
        assert spec._copy_table(context, SPLIT, chain) == opinion_table(SPLIT, opinion)
    spec.copy_price = "match"
    assert spec._copy_table(context, SPLIT, chain) == SPLIT
    spec.copy_price = "depth"
    assert spec._copy_table(context, SPLIT, chain) == EVERY_MATCH
    tables = TreeState().copies
    agrees, differs = tables[opinion_table(PLAIN, AGREES)], tables[opinion_table(PLAIN, DIFFERS)]
    first, later = OPINION_PRIORS[PLAIN][AGREES]
    assert agrees.path_probs(2) == pytest.approx([first, first * later])
    assert differs.path_probs(1)[0] < agrees.path_probs(1)[0]


def test_the_answer_store_s_chain_is_calibrated_for_its_first_node_and_its_later_ones_apart():
    """``store_calib="depth"`` (the default): a store chain's first node is as sure as the sequence's first-node
    calibration times its share, a later one (given its parent) as its later-node calibration times its share, and
    rounds move each by its own nodes; ``chain`` (the ablation): one factor on the shares' products. Tokens stay the
    plain greedy ones either way."""

    class Store:  # proposes the next tokens of a fixed cycle: right wherever the answer follows it
        def propose(self, context: list[int], k: int) -> tuple[list[int], list[float]]:
            last = context[-1]
            return [(last + 1 + i) % 64 for i in range(k)], [0.9] * k

    tree, state = Tree([7], [-1], [0], [1.0], [None]), TreeState(answer_calib=0.8, answer_deeper=0.5)
    TreeSpeculative._copy_in(tree, state, [], ([8, 9], [0.9, 0.9]))
    assert [tree.copy_probs[r] for r in (1, 2)] == pytest.approx([0.72, 0.72 * 0.45])
    tree = Tree([7], [-1], [0], [1.0], [None])
    TreeSpeculative._copy_in(tree, state, [], ([8, 9], [0.9, 0.9]), store_calib="chain")
    assert [tree.copy_probs[r] for r in (1, 2)] == pytest.approx([0.72, 0.8 * 0.81])
    model = tiny_model(seed=1)
    fast = SeededFastStream(model, SeededConfig.build(4, depth=2, rank=2)).eval()
    prompt, gen = [3, 9, 27, 17], GenerationConfig(max_new_tokens=30)
    ref = Autoregressive(model, []).generate(prompt, gen)
    for calib in STORE_CALIBS:
        spec = TreeSpeculative("m2r2", model, fast, [], None, lookup=6, answers=Store(), store_calib=calib)
        assert spec.generate(prompt, gen).tokens == ref.tokens
    with pytest.raises(SettingsError, match="store_calib must be one of"):
        TreeSpeculative("m2r2", model, fast, [], None, store_calib="none")


def test_the_draft_ledger_drafts_where_the_drafters_own_tokens_have_paid_for_its_time(tmp_path):
    """``draft="pays"``: per kind of round (greedy with a copy proposed or not, sampled), a drafting round's own tokens
    are weighed against
    its wall clock beyond an undrafted round of the rows the copies alone would have had; every third round skips
    until ``trials`` drafting rounds count, then the paying choice is taken with the other every ``retry``-th
    round. The ledger survives a process (``save``/``load``); a damaged file gives a fresh one."""
    ledger = DraftLedger()
    ledger.record(1, 3, 0.007, 5, gain=1, alone=3)  # no undrafted round of 3 rows yet: not counted
    assert ledger.drafted == [0, 0, 0]
    assert [ledger.pays(1) for _ in range(6)] == [True, True, False] * 2
    for _ in range(ledger.trials):
        # with copies: 2 tokens in 4 ms over 3 rows (500 a second); drafting adds 1 token for 3 ms more (333)
        ledger.record(1, 2, 0.004, 3)
        ledger.record(1, 3, 0.007, 5, gain=1, alone=3)
        # without: a plain round, 1 token in 3 ms (333 a second); drafting adds 1 token for 1.5 ms more (667)
        ledger.record(0, 1, 0.003, 1)
        ledger.record(0, 2, 0.0045, 3, gain=1, alone=1)
    assert ledger.drafted == [ledger.trials, ledger.trials, 0]
    # the retries come as many times rarer as one rate is the other: 500 / 333 = 1.5 with copies, 667 / 333 = 2 without
    copied = [ledger.pays(1) for _ in range(4 * ledger.retry)]  # rounds 7..134 of the kind: 48 and 96 draft
    assert [i for i, c in enumerate(copied) if c] == [48 - 7, 96 - 7]
    plain = [ledger.pays(0) for _ in range(4 * ledger.retry)]  # rounds 1..128: 64 and 128 skip
    assert [i for i, p in enumerate(plain) if not p] == [64 - 1, 128 - 1]
    for _ in range(200):  # the drafter gives nothing beside copies: retried 16 times rarer, no more
        ledger.record(1, 2, 0.004, 3)
        ledger.record(1, 2, 0.007, 5, gain=0, alone=3)
    later = [ledger.pays(1) for _ in range(2 * ledger.max_spread * ledger.retry)]
    assert sum(later) == 2
    path = tmp_path / "ledger-k.json"
    ledger.save(path)
    kept = DraftLedger.load(path)
    assert (kept.sums, kept.drafted, kept.rounds, kept.undrafted) == (
        ledger.sums,
        ledger.drafted,
        ledger.rounds,
        ledger.undrafted,
    )
    two_kinds = '{"sums": [[0, 0, 0, 0], [0, 0, 0, 0]], "drafted": [0, 0], "rounds": [0, 0], "undrafted": {}}'
    for damaged in ("{", '{"sums": [[1, 2]], "drafted": [0, 0], "rounds": [0, 0], "undrafted": {}}', "[]", two_kinds):
        path.write_text(damaged)
        assert DraftLedger.load(path).drafted == [0, 0, 0]
    assert DraftLedger.load(tmp_path / "missing.json").drafted == [0, 0, 0] and DraftLedger.load(None).sums[0][0] == 0
    # wired into a strategy: rounds of both kinds are counted, and the tokens stay plain greedy
    model = tiny_model(21)
    prompt, gen = [5, 9, 14, 2, 5, 9, 14, 2, 33], GenerationConfig(max_new_tokens=80)
    strategy = TreeSpeculative("m2r2", model, seeded_stream(model, 1, 0.0, 21, fold=True), [], None, lookup=6)
    assert strategy.generate(prompt, gen).tokens == Autoregressive(model, []).generate(prompt, gen).tokens
    assert strategy.draft_when == "pays" and strategy.ledger.rounds[1] > 0 and sum(strategy.ledger.drafted) > 0
    greedy_rounds = strategy.ledger.rounds[:2]
    strategy.generate(prompt, GenerationConfig(max_new_tokens=40, temperature=0.8, seed=3))  # sampled: a kind apart
    assert strategy.ledger.rounds[2] > 0 and strategy.ledger.rounds[:2] == greedy_rounds


def test_one_timing_cannot_turn_the_draft_ledger_for_long(tmp_path):
    """A slow undrafted round (a profiler's pause) moves the reference by at most twice the reference's weight, and a
    drafting round counts between 0 and twice the reference's seconds beyond it: drafting never looks cheaper than
    nothing, so a ledger whose drafter does not pay goes on not drafting. A kept ledger with negative sums (written
    before the clipping) is taken for damaged."""
    ledger = DraftLedger()
    ledger.record(0, 1, 0.003, 1)
    for _ in range(5):  # five undrafted rounds 20 times slower than the rest
        ledger.record(0, 1, 0.060, 1)
    assert ledger.undrafted[0, 1] <= 0.003 * 2
    ledger.record(0, 2, 0.0035, 1, gain=1, alone=1)  # a drafting round faster than the inflated reference
    assert ledger.sums[0][1] == 0.0
    for _ in range(3 * ledger.trials):  # the machine as it was: drafting gives 0.3 tokens for 1.5 ms (200 a second)
        ledger.record(0, 1, 0.003, 1)
        ledger.record(0, 1, 0.0045, 1, gain=0, alone=1)
        ledger.record(0, 2, 0.0045, 1, gain=1, alone=1)
        ledger.record(0, 1, 0.0045, 1, gain=0, alone=1)
    assert ledger.sums[0][1] > 0 and not ledger.pays(0)
    before, ref = ledger.sums[0][1], ledger.undrafted[0, 1]
    ledger.record(0, 2, 1.0, 1, gain=1, alone=1)  # a one-second hiccup in a drafting round: 2 references, no more
    assert ledger.sums[0][1] == pytest.approx(ledger.drafted_decay * before + 2 * ref)
    path = tmp_path / "ledger-negative.json"
    ledger.sums[0][1] = -2.6
    ledger.save(path)
    assert DraftLedger.load(path).drafted == [0, 0, 0]


def test_the_ledger_does_not_credit_drafts_the_next_rounds_copy_would_have_given():
    """Had a drafting round emitted only its first token, the next round would have been offered a copy; the drafted
    tokens after the first that this copy matches (and the round's next token) are not the drafter's gain."""
    model = tiny_model(21)
    strategy = TreeSpeculative("m2r2", model, seeded_stream(model, 1, 0.0, 21, fold=True), [], None, lookup=6)
    state = TreeState(context=NgramIndex([5, 9, 14, 2, 8, 5, 9]))
    # after 5 9 14: lookup copies "2 8 5 9"; the round drafted 14 2 8 and its next token was 5
    assert strategy._copied_after(state, [14, 2, 8, 5], 6) == 3
    assert strategy._copied_after(state, [14, 2, 7, 5], 6) == 1  # the copy is right once, then not
    assert strategy._copied_after(state, [3, 2, 8], 6) == 0  # after "9 3" nothing is copied
    assert strategy._copied_after(state, [14, 2, 8, 5, 9, 14, 3], 6) == 5  # the copy runs into 14, then ends
    assert strategy._copied_after(TreeState(), [14, 2], 6) == 0  # no context: no copies


def test_eos_inside_an_accepted_path_stops_where_plain_greedy_stops():
    model = tiny_model(11)
    fast = seeded_stream(model, 1, 0.0, 11, fold=False)
    prompt = [3, 4, 5]
    ref_long = Autoregressive(model, []).generate(prompt, GenerationConfig(max_new_tokens=30)).tokens
    eos = [ref_long[7]]
    ref = Autoregressive(model, eos).generate(prompt, GenerationConfig(max_new_tokens=30))
    out = TreeSpeculative("m2r2", model, fast, eos, None, 8, 5, 2, 2).generate(
        prompt, GenerationConfig(max_new_tokens=30)
    )
    assert out.tokens == ref.tokens and out.stop_reason == ref.stop_reason


def test_cost_model_declines_trees_that_do_not_pay_and_takes_them_when_verification_is_flat():
    model = tiny_model(12)
    fast = seeded_stream(model, 1, 0.0, 12, fold=False)
    flat = TreeCosts(draft=[0.01] * 4, verify=[1.0] * 9)
    steep = TreeCosts(draft=[0.5] * 4, verify=[1.0 + 2.0 * k for k in range(9)])
    prompt, gen = [5, 6, 7], GenerationConfig(max_new_tokens=40)
    ref = Autoregressive(model, []).generate(prompt, gen).tokens
    fixed = {"online_costs": False}  # these costs are not seconds: no correcting them by the wall clock
    cheap = TreeSpeculative("m2r2", model, fast, [], None, 8, 5, 2, 2, costs=flat, **fixed).generate(prompt, gen)
    dear = TreeSpeculative("m2r2", model, fast, [], None, 8, 5, 2, 2, costs=steep, **fixed).generate(prompt, gen)
    assert cheap.tokens == ref and dear.tokens == ref
    assert cheap.stats["verify_rows_per_pass"] > 2.0
    assert dear.stats["verify_rows_per_pass"] == 1.0


def test_drafting_is_judged_by_the_wall_clock_not_only_by_the_modeled_costs():
    """A drafting round that gains one token but takes three plain rounds' time stops drafting, although
    the modeled costs (free draft levels, flat verification) say it pays; one gaining three keeps on.
    Synthetic round times: the accounting is tested, not this machine's speed."""
    model = tiny_model(12)
    costs = TreeCosts(draft=[0.001] * 4, verify=[1.0] * 9)
    strategy = TreeSpeculative("m2r2", model, seeded_stream(model, 1, 0.0, 12, fold=False), [], None, costs=costs)
    for gained, expect in ((1, False), (3, True)):
        state = TreeState()
        strategy._account(state, 0.010, 0, n_rows=1, steps=0)  # a plain round: 10 ms
        assert state.step_s == pytest.approx(0.010)
        for _ in range(12):
            strategy._account(state, 0.030, gained, n_rows=4, steps=3)
        assert state.cost == pytest.approx(2.0, abs=0.2)
        assert strategy._worth_drafting(state) is expect


#: a measured curve in seconds, convex as measured ones are (a 10 ms pass, rows dearer the more there are)
MEASURED = TreeCosts(draft=[5e-4] * 4, verify=[0.010 * (1 + 0.04 * k + 0.004 * k * k) for k in range(9)])


def _feed(fit: VerifyFit, passes: int, seconds) -> None:
    """``passes`` verify passes over 1..6 rows in turn, each taking ``seconds(rows)``."""
    for i in range(passes):
        rows = 1 + i % 6
        fit.add(rows, seconds(rows), MEASURED.verify[rows - 1])


def test_the_online_verify_fit_recovers_base_and_slope_and_corrects_the_measured_curve():
    fit = VerifyFit()
    assert fit.corrected(MEASURED) is MEASURED  # nothing observed: the measured curve stands
    for _ in range(40):
        fit.add(4, 0.03, MEASURED.verify[3])
    assert fit.scales() is None  # passes of one size say nothing of the slope
    # a linear in-situ cost (a 20 ms pass, 4 ms a row) against a linear measured curve: corrected exactly
    linear = TreeCosts(draft=[5e-4] * 4, verify=[0.010 + 0.001 * k for k in range(9)])
    fit = VerifyFit()
    for i in range(7):
        fit.add(1 + i % 6, 0.020 + 0.004 * (i % 6), linear.verify[i % 6])
    assert fit.scales() is None  # too few passes
    for i in range(7, 40):
        fit.add(1 + i % 6, 0.020 + 0.004 * (i % 6), linear.verify[i % 6])
    base, per_row, *_ = fit.fit()
    assert base == pytest.approx(0.020) and per_row == pytest.approx(0.004)
    assert fit.scales() == pytest.approx((2.0, 4.0))
    assert fit.corrected(linear).verify == pytest.approx([0.020 + 0.004 * k for k in range(9)])
    assert fit.corrected(linear).draft == pytest.approx([2.0 * d for d in linear.draft])  # levels scale as one row
    # passes costing the measured curve times 1.5: the whole curve, shape and all, times 1.5
    fit = VerifyFit()
    _feed(fit, 40, lambda rows: 1.5 * MEASURED.verify[rows - 1])
    assert fit.scales() == pytest.approx((1.5, 1.5))
    assert fit.corrected(MEASURED).verify == pytest.approx([1.5 * v for v in MEASURED.verify])
    # rows that seem to save time are clamped to free; a stalled pass is counted at three times its cost
    fit = VerifyFit()
    _feed(fit, 40, lambda rows: 0.012 - 0.001 * rows)
    assert fit.fit()[1] == 0.0 and fit.fit()[0] > 0
    fit = VerifyFit()
    fit.add(1, 10.0, 0.010)
    assert fit.sums[3] == pytest.approx(0.030)


def test_rows_dearer_in_situ_than_measured_make_choose_verify_fewer():
    """A sequence whose verify passes show each extra row costing half a pass (a long context) verifies
    fewer rows of the same tree than the measured curve (a row at 4-7% of a pass) says; with
    ``online_costs`` off, or before its passes have been seen, it verifies what the measured curve says."""
    model = tiny_model(12)
    fast = seeded_stream(model, 1, 0.0, 12, fold=False)
    chain = Tree(list(range(9)), list(range(-1, 8)), list(range(9)), [0.9**d for d in range(9)])
    online = TreeSpeculative("m2r2", model, fast, [], None, costs=MEASURED)
    fixed = TreeSpeculative("m2r2", model, fast, [], None, costs=MEASURED, online_costs=False)
    state = TreeState()
    measured = online.choose(chain, 8, 1.0, 2, online.costs_for(state))
    assert len(measured) == 9  # all 8 drafts pay at the measured costs
    _feed(state.verify_fit, 30, lambda rows: 0.010 + 0.005 * (rows - 1))
    steep = online.costs_for(state)
    assert steep.verify[0] == pytest.approx(0.010, rel=0.05) and steep.verify[8] > 3 * MEASURED.verify[8]
    rows = online.choose(chain, 8, 1.0, 2, steep)
    assert 1 < len(rows) < len(measured) and rows == list(range(len(rows)))
    assert online._level_cost(steep) > online._level_cost()  # and drafting deeper pays off later
    assert fixed.costs_for(state) is MEASURED
    assert fixed.choose(chain, 8, 1.0, 2, fixed.costs_for(state)) == measured


def test_costs_timed_on_a_busier_machine_are_dropped(tmp_path, monkeypatch):
    """A sequence whose own verify passes ran well below the cached costs (their online correction's one-row
    scale under 0.8 over 16+ passes) deletes the cache file, so that the next build measures again; passes at
    or above the measured cost (a busy moment now, or longer contexts) keep it, as do short answers."""
    from m2r2.decoding import costs as costs_mod

    path = tmp_path / "tree-k.json"
    for scale, passes, dropped in ((0.6, 16, True), (0.6, 15, False), (0.85, 40, False), (2.0, 40, False)):
        path.write_text("{}")
        assert costs_mod.drop_loaded_costs(path, scale, passes) is dropped and path.exists() is not dropped
    assert not costs_mod.drop_loaded_costs(None, 0.1, 40) and not costs_mod.drop_loaded_costs(path, None, 40)
    # wired into generation: the scale the rounds decided with, averaged over them
    model = tiny_model(12)
    strategy = TreeSpeculative("m2r2", model, seeded_stream(model, 1, 0.5, 12, fold=False), [], None, costs=MEASURED)
    prompt, gen = [1, 5, 9, 2], GenerationConfig(max_new_tokens=60)
    for scale, kept in ((0.5, False), (1.0, True)):
        monkeypatch.setattr(VerifyFit, "scales", lambda self, scale=scale: (scale, 1.0))
        path.write_text("{}")
        strategy.cost_file = path
        out = strategy.generate(prompt, gen)
        assert out.stats["verify_passes"] >= 16 and out.stats["verify_scale_base"] == pytest.approx(scale)
        assert path.exists() is kept
    strategy.cost_file = None  # not cached (``cost_cache`` off): nothing to drop
    strategy.generate(prompt, gen)


@pytest.mark.parametrize("seed", [3, 9])
@pytest.mark.parametrize("slope", [0.0, 0.01])
def test_greedy_trees_stay_plain_greedy_with_online_costs(seed, slope):
    """Costs corrected from the first round (a sequence started with a fitted estimate of free or steep
    rows) and then by the rounds' own timings: the trees change, the tokens do not, and every greedy
    verify pass is observed."""
    rng = random.Random(seed)
    model = tiny_model(seed)
    fast = seeded_stream(model, 2, 0.1, seed, fold=True, gated=seed >= 9)
    strat = TreeSpeculative("m2r2", model, fast, [], None, 8, 5, 2, 2, costs=MEASURED, lookup=4)
    states: list[TreeState] = []

    def make_drafter(cache) -> TreeState:
        states.append(TreeState())
        _feed(states[-1].verify_fit, 12, lambda rows: 0.010 + slope * (rows - 1))
        return states[-1]

    strat.make_drafter = make_drafter
    for _ in range(3):
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 30))]
        gen = GenerationConfig(max_new_tokens=rng.randint(20, 60))
        ref = Autoregressive(model, []).generate(prompt, gen)
        out = strat.generate(prompt, gen)
        assert out.tokens == ref.tokens and out.stop_reason == ref.stop_reason
        assert states[-1].verify_fit.passes == 12 + out.stats["verify_passes"]
        assert out.stats["verify_scaled_share"] > 0 and out.stats["verify_scale_base"] > 0
        assert out.stats["verify_scale_row"] >= 0


def test_online_costs_is_a_method_option_taking_0_and_1():
    from m2r2.decoding import check_options

    assert check_options("m2r2", {"online_costs": 0}) == {"online_costs": False}
    assert check_options("m2r2", {"online_costs": True}) == {"online_costs": True}
    for bad in (2, "maybe"):
        with pytest.raises(SettingsError, match=r"^online_costs must be"):
            check_options("m2r2", {"online_costs": bad})


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 4, 0.9)])
def test_tree_speculative_sampling_reproduces_the_target_distribution(temperature, top_k, top_p):
    vocab = 6
    model = tiny_model(3, vocab=vocab, layers=3)
    with torch.no_grad():
        model.embed.weight.div_(32)
    fast = seeded_stream(model, 1, 1.0, 3, fold=True, vocab=[0, 2, 3, 5])
    strategy = TreeSpeculative("m2r2", model, fast, [], None, 3, 3, 2, 2)
    prompt, n = [1, 2], 3000
    outs = []
    for seed in range(n):
        gen = GenerationConfig(max_new_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        outs.append(strategy.generate(prompt, gen).tokens)
    probe = GenerationConfig(max_new_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p)
    for step in (2, 3):
        expected = _exact_marginal(model, prompt, probe, step)
        counts = torch.zeros(vocab, dtype=torch.float64)
        for toks in outs:
            counts[toks[step - 1]] += 1
        keep = expected * n >= 5
        chi2 = float((((counts - expected * n) ** 2) / (expected * n))[keep].sum())
        assert chi2 < 20.6, (step, chi2, counts / n, expected)


def test_bad_tree_settings_are_refused():
    model = tiny_model(1)
    fast = seeded_stream(model, 1, 0.0, 1, fold=False)
    for kw in (
        {"max_nodes": 0},
        {"max_nodes": 40},
        {"width": 0},
        {"branch": 0},
        {"max_depth": 0},
        {"lookup": -1},
        {"lookup": 40},
    ):
        args = {"max_nodes": 8, "max_depth": 5, "width": 2, "branch": 2, **kw}
        with pytest.raises(SettingsError):
            TreeSpeculative("m2r2", model, fast, [], None, **args)
    with pytest.raises(SettingsError):
        SeededConfig.build(4, depth=5)


def test_wide_trees_near_the_end_of_the_context_fit_their_drafts_in_the_cache():
    """Draft nodes keep their fast K/V in the cache's free slots: near the model's context limit a wide
    tree drafts fewer levels instead of overflowing the cache, and stays lossless."""
    model = tiny_model(31)
    fast = seeded_stream(model, 2, 0.0, 31, fold=True)
    rng = random.Random(31)
    prompt = [rng.randrange(64) for _ in range(445)]  # capacity: the context, 512 (67 slots past the prompt)
    gen = GenerationConfig(max_new_tokens=60)
    ref = Autoregressive(model, []).generate(prompt, gen)
    out = TreeSpeculative("m2r2", model, fast, [], None, 31, 8, 16, 2).generate(prompt, gen)
    assert out.tokens == ref.tokens and len(out.tokens) == 60


@pytest.mark.parametrize("depth", [1, 2])
def test_training_chains_compute_what_inference_drafts(depth):
    """Step s of ``forward_chain`` at position p equals drafting s tokens after verified prefix p-s."""
    model = tiny_model(21, layers=4)
    fast = seeded_stream(model, depth, 0.1, 21, fold=False)
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(12)
    hidden = model.run_layers(model.embed_tokens(tokens), cache, 0)
    layers = fast.cfg.layers
    k, v = cache.k[layers], cache.v[layers]
    chain = fast.forward_chain(tokens, hidden, k, v, steps=3)
    slow = cache.k.clone(), cache.v.clone()
    for p in (3, 7, 11):
        for s in (1, 2, 3):
            verified = p - s + 1  # positions 0..p-s verified; drafts at p-s+1 .. p
            cache.k.copy_(slow[0]), cache.v.copy_(slow[1])  # drafts write their fast K/V past the verified slots
            cache.length = verified
            seed = hidden[:, verified - 1 : verified]
            for i in range(s):
                pos = torch.tensor([verified + i])
                vis = torch.ones(1, i + 1, dtype=torch.bool)
                states = fast.step(seed, tokens[:, verified + i : verified + i + 1], pos, cache, verified, i, vis)
                seed = states[-1]
            assert torch.allclose(states[-1][0, 0], chain[s - 1][-1][0, p], atol=1e-4)


def test_adapter_file_round_trip_and_refusals(tmp_path):
    from m2r2.multirate.io import load_adapters, save_adapters

    model = tiny_model(5)
    fast = seeded_stream(model, 2, 0.1, 5, fold=False, vocab=list(range(0, 64, 2)))
    path = save_adapters(tmp_path / "a.safetensors", fast, "fp-1", torch.float32)
    back = load_adapters(path, model, "fp-1")
    assert isinstance(back, SeededFastStream) and back.cfg == fast.cfg
    assert torch.equal(back.draft_vocab, fast.draft_vocab)
    for name, t in fast.state_dict().items():
        assert torch.equal(back.state_dict()[name], t)
    with pytest.raises(WeightsError, match="another base model"):
        load_adapters(path, model, "fp-2")
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(WeightsError, match="corrupt"):
        load_adapters(path, model, "fp-1")


@pytest.mark.parametrize("attention_only", [False, True])
def test_a_grown_stream_starts_at_its_shallower_stream_and_folds_its_gates(tmp_path, attention_only):
    """Growing a trained one-layer stream by a gated layer (whole, or attention only) changes no draft until
    the gates open; open, the folded form (gates scaled into the output projections) drafts what the
    unfolded one does."""
    from m2r2.multirate.io import load_adapters, save_adapters

    model = tiny_model(23, layers=4)
    one = seeded_stream(model, 1, 0.1, 23, fold=False)
    two = SeededFastStream(
        model, SeededConfig.build(4, depth=2, rank=4, gated=[2], attention_only=[2] if attention_only else None)
    )
    two.adopt(one)
    assert attention_only == ("A.up" not in two.adapters[0].state_dict())
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(12)
    hidden = model.run_layers(model.embed_tokens(tokens), cache, 0)
    a = one.forward_chain(tokens, hidden, cache.k[[3]], cache.v[[3]], steps=3)
    b = two.forward_chain(tokens, hidden, cache.k[[2, 3]], cache.v[[2, 3]], steps=3)
    for s in range(3):
        assert torch.equal(a[s][-1], b[s][-1])
    with torch.no_grad():
        two.gates["2"].normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    cache.length = 6
    args = (hidden[:, 5:6], tokens[:, 6:7], torch.tensor([6]), cache, 6, 0, torch.ones(1, 1, dtype=torch.bool))
    unfolded = two.freeze(merge=False).step(*args)[-1]
    folded = two.freeze(merge=True).step(*args)[-1]
    assert torch.allclose(unfolded, folded, atol=1e-5)
    assert not torch.allclose(unfolded, one.step(*args)[-1], atol=1e-3)
    back = load_adapters(save_adapters(tmp_path / "g.safetensors", two.freeze(False), "fp", torch.float32), model, "fp")
    assert back.cfg == two.cfg and torch.equal(back.gates["2"], two.gates["2"])
    with pytest.raises(SettingsError, match="cannot start"):  # a lower rank would drop trained ranks
        SeededFastStream(model, SeededConfig.build(4, depth=2, rank=2, gated=[2])).adopt(one)
    with pytest.raises(SettingsError, match="cannot start"):  # the new layer must be gated
        SeededFastStream(model, SeededConfig.build(4, depth=2, rank=4)).adopt(one)
    with pytest.raises(SettingsError, match="gated layers"):
        SeededConfig.build(4, depth=2, gated=[1])
    with pytest.raises(SettingsError, match="attention-only layers"):  # a file's config, as read back
        SeededConfig.from_dict({**two.cfg.to_dict(), "attention_only": [0]})
    if attention_only:  # an attention-only layer cannot give back the FFN adapters a whole layer needs
        with pytest.raises(SettingsError, match="cannot start"):
            SeededFastStream(model, SeededConfig.build(4, depth=2, rank=4, gated=[2])).adopt(two)


def test_a_stream_grown_to_a_higher_rank_drafts_what_it_did_and_trains_its_new_ranks():
    """Widening a trained stream (rank 4 -> 12, the capacity ablation of docs/TRAINING.md) keeps its drafts
    exactly, and the loss reaches the new ranks (their B columns get gradients), so training can use them."""
    model = tiny_model(29, layers=4)
    one = seeded_stream(model, 1, 0.1, 29, fold=False)
    wide = SeededFastStream(model, SeededConfig.build(4, depth=1, rank=12))
    wide.adopt(one)
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache(12)
    with torch.no_grad():  # the frozen slow stream, as the training store holds it
        hidden = model.run_layers(model.embed_tokens(tokens), cache, 0)
        a = one.forward_chain(tokens, hidden, cache.k[[3]], cache.v[[3]], steps=2)
    wide.train()
    b = wide.forward_chain(tokens, hidden, cache.k[[3]], cache.v[[3]], steps=2)
    for s in range(2):
        assert torch.allclose(a[s][-1], b[s][-1], atol=1e-6)
    b[1][-1].square().sum().backward()
    assert float(wide.adapters[0].B["q"].grad[:, 4:].abs().sum()) > 0
    assert torch.equal(wide.adapters[0].A["q"].detach()[:4], one.adapters[0].A["q"])


def _conversations(path, n: int) -> None:
    rng = random.Random(0)
    words = ["the", "a", "sea", "fox", "blue", "red", "one", "two", "three", "poem", "write", "short"]
    with open(path, "w") as f:
        for i in range(n):
            msgs = [
                {"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(2, 9)))},
                {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(rng.randint(2, 20)))},
            ]
            f.write(json.dumps({"id": f"s:{i}", "source": "lima" if i % 2 else "gsm8k", "messages": msgs}) + "\n")


def _engine_and_store(tmp_path, tiny_model):
    """The tiny model's engine and a training store (K/V of its last layer) of 9 conversations at tmp_path/st."""
    from m2r2.engine import Engine
    from m2r2.training.store import StoreSettings, build_store

    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    conv = tmp_path / "conv.jsonl"
    _conversations(conv, 9)
    build_store(
        e.model,
        e.fingerprint,
        e.tokenizer.encode_conversation,
        tmp_path / "st",
        StoreSettings(data=str(conv), max_len=32, kv_layers=1),
    )
    return e


def test_store_resumes_after_a_kill_without_duplicates_and_refuses_bad_stores(tmp_path, tiny_model):
    from m2r2.engine import Engine
    from m2r2.machine import cpu_has
    from m2r2.training.store import StoreSettings, TrainStore, build_store, store_precision

    data = tmp_path / "conv.jsonl"
    _conversations(data, 23)
    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    enc = e.tokenizer.encode_conversation
    s = StoreSettings(data=str(data), max_len=32, batch=3, shard_sequences=5, kv_layers=1)
    one = build_store(e.model, e.fingerprint, enc, tmp_path / "whole", s)
    # a "killed" build: stopped after 2 shards, then resumed
    build_store(e.model, e.fingerprint, enc, tmp_path / "split", s, limit=10)
    two = build_store(e.model, e.fingerprint, enc, tmp_path / "split", s)
    assert one["conversations_done"] == two["conversations_done"] == 23
    a, b = TrainStore(tmp_path / "whole", e.fingerprint), TrainStore(tmp_path / "split", e.fingerprint)
    assert a.tokens == b.tokens and [x["sha256"] for x in a.shards] == [x["sha256"] for x in b.shards]
    toks = [q["tokens"].tolist() for i in range(len(a.shards)) for q in a.sequences(a.load_shard(i))]
    assert len(toks) == 23
    with pytest.raises(WeightsError, match="another base model"):
        TrainStore(tmp_path / "whole", "someone-else")
    shard = tmp_path / "whole" / a.shards[1]["file"]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(WeightsError, match="corrupt"):
        a.load_shard(1)
    with pytest.raises(SettingsError, match="other data or settings"):
        build_store(
            e.model, e.fingerprint, enc, tmp_path / "whole", StoreSettings(data=str(data), max_len=16, kv_layers=1)
        )
    bf16 = StoreSettings(data=str(data), max_len=32, batch=3, shard_sequences=5, kv_layers=1, precision="bf16")
    with pytest.raises(SettingsError, match="other data or settings"):  # `store --dtype bf16` resuming an fp32 store
        build_store(e.model, e.fingerprint, enc, tmp_path / "whole", bf16)
    assert "precision" not in s.to_dict() and bf16.to_dict()["precision"] == "bf16"  # older fp32 stores still resume
    # without --dtype a resumed store keeps its own precision; a new one gets the machine's choice
    assert store_precision(tmp_path / "whole") == "fp32"
    build_store(e.model, e.fingerprint, enc, tmp_path / "b", bf16, limit=5)
    assert store_precision(tmp_path / "b") == "bf16"
    native = torch.cuda.is_available() or cpu_has("avx512_bf16") or cpu_has("amx_bf16")
    assert store_precision(tmp_path / "fresh") == ("bf16" if native else "fp32")
    with pytest.raises(InputError, match="not a training store"):
        TrainStore(tmp_path / "nothing")


@pytest.mark.parametrize("kernel", ["plain", "mkldnn"])
def test_certified_head_argmax_equals_row_by_row_argmax(kernel):
    """The one-pass head argmax of a verify pass equals each row's one-row argmax, near-ties included."""
    from m2r2.kernels import head_argmax, mkldnn_usable, use_kernels

    model = tiny_model(31, vocab=64, dtype=torch.bfloat16)
    if kernel == "mkldnn" and not mkldnn_usable(model):
        pytest.skip("oneDNN bf16 kernels unavailable here")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # tokens 3 and 5 score almost the same for inputs along token 3's row: near-ties
        w = model.lm_head.weight
        w[5] = w[3] + 1e-3 * torch.randn(w.shape[1], generator=g).to(w.dtype)
        d = w[3].float() / w[3].float().norm()
    use_kernels(model, kernel)
    noise = torch.randn(1, 24, model.cfg.hidden_size, generator=g)
    h = (8 * d + 0.05 * noise).to(torch.bfloat16)
    with torch.inference_mode():
        ref = torch.cat([model.head(h[:, i : i + 1]).argmax(-1) for i in range(24)], dim=1)
        got = head_argmax(model, h)
        batched = model.lm_head(model.norm(h)).float()
    assert torch.equal(got, ref)
    assert set(ref[0].tolist()) <= {3, 5}  # the rows really are near-ties between the two tokens
    top = batched.topk(2, dim=-1).values[0]
    assert float((top[:, 0] - top[:, 1]).min()) < 0.05


@pytest.mark.parametrize("bf16", [False, True])
def test_store_takes_the_models_own_answers_and_training_reads_several_stores(tmp_path, tiny_model, bf16):
    from m2r2.engine import Engine
    from m2r2.training.seeded_train import SeededTrainSettings, chain_losses, pad_batch, targets, train_seeded
    from m2r2.training.store import StoreSettings, TrainStore, build_store

    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    conv, own = tmp_path / "conv.jsonl", tmp_path / "answers.jsonl"
    _conversations(conv, 9)
    with open(own, "w") as f:
        for i in range(7):
            f.write(
                json.dumps({"id": f"o:{i}", "source": "lima", "prompt_ids": [1, 5, 7], "answer_ids": [9] * (i + 2)})
            )
            f.write("\n")
    enc = e.tokenizer.encode_conversation
    for data, out in ((conv, "a"), (own, "b")):
        build_store(e.model, e.fingerprint, enc, tmp_path / out, StoreSettings(data=str(data), max_len=32, kv_layers=2))
    b = TrainStore(tmp_path / "b", e.fingerprint)
    got = sorted(q["tokens"].tolist() for q in b.sequences(b.load_shard(0)))
    assert got == sorted([1, 5, 7] + [9] * (i + 2) for i in range(7))
    s = SeededTrainSettings(
        store=f"{tmp_path / 'a'},{tmp_path / 'b'}",
        out=tmp_path / "run",
        steps=2,
        batch=4,
        holdout=2,
        chain=2,
        rank=2,
        bf16=bf16,
    )
    stream = train_seeded(e.model, e.fingerprint, s, None)
    meta = json.loads((tmp_path / "run" / "adapters.json").read_text())
    assert meta["train"]["store_tokens"] == TrainStore(tmp_path / "a").tokens + b.tokens
    assert isinstance(stream, SeededFastStream)
    # grown by one layer from that run: the new layer is gated, the trained one carried over
    n = e.model.cfg.num_layers
    grown = train_seeded(
        e.model,
        e.fingerprint,
        replace(s, out=tmp_path / "grown", depth=2, init=str(tmp_path / "run" / "adapters")),
        None,
    )
    assert grown.cfg.layers == [n - 2, n - 1] and grown.cfg.gated == [n - 2] and not grown.cfg.attention_only
    assert json.loads((tmp_path / "grown" / "adapters.json").read_text())["config"]["gated"] == [n - 2]
    # that grown layer, continued as attention only
    init = str(tmp_path / "grown" / "adapters")
    lean = train_seeded(
        e.model, e.fingerprint, replace(s, out=tmp_path / "lean", depth=2, init=init, attention_only=True), None
    )
    assert lean.cfg.attention_only == [n - 2] and lean.cfg.gated == [n - 2]
    with pytest.raises(SettingsError, match="--attention-only"):
        train_seeded(e.model, e.fingerprint, replace(s, out=tmp_path / "x", attention_only=True), None)
    # the hard top-1 term is the cross-entropy on the full model's top token at every drafted position
    batch = pad_batch(list(b.sequences(b.load_shard(0))), 1)
    out = chain_losses(stream, batch, 1)
    w, _, top = targets(stream, batch["hidden"])
    states = stream.forward_chain(batch["tokens"], batch["hidden"], batch["k"], batch["v"], 1)
    m = batch["valid"] & (torch.arange(batch["tokens"].shape[1]) >= 1)
    logits = F.linear(stream.base.norm(states[0][-1]), w)
    assert torch.allclose(out["top1"], F.cross_entropy(logits[m], top[m]))
    hard = train_seeded(e.model, e.fingerprint, replace(s, out=tmp_path / "hard", top1_w=1.0, align_w=0.0), None)
    assert isinstance(hard, SeededFastStream)
    with pytest.raises(SettingsError, match="loss weights"):
        train_seeded(e.model, e.fingerprint, replace(s, out=tmp_path / "y", top1_w=-1.0), None)


def test_a_run_stopped_by_its_wall_clock_budget_ends_its_learning_rate_cosine_there(tmp_path, tiny_model):
    """Until the 24th round a run stopped by --minutes long before --steps (100,000 by default) kept its
    peak learning rate to the end; now the cosine ends where the budget stops the run."""
    from m2r2.training.seeded_train import HORIZON_PROBE, SeededTrainSettings, _lr, time_horizon, train_seeded

    s = SeededTrainSettings(store="x", out=tmp_path, lr=1e-3, warmup=4, steps=100)
    assert _lr(0, s, 50) == pytest.approx(2.5e-4) and _lr(4, s, 50) == pytest.approx(1e-3)
    assert _lr(50, s, 50) == pytest.approx(1e-4) and _lr(80, s, 50) == pytest.approx(1e-4)
    assert _lr(27, s, 50) == pytest.approx(5.5e-4)  # half way through the cosine
    assert time_horizon(8, 8, 8.0, 1.0, 100_000) == 60  # 1 s a step, 52 s left
    assert time_horizon(8, 8, 8.0, 1.0, 20) == 20  # --steps comes first
    assert time_horizon(8, 8, 70.0, 1.0, 100_000) == 9  # already over budget: the next step ends it
    e = _engine_and_store(tmp_path, tiny_model)
    lrs: list[float] = []
    run = SeededTrainSettings(
        store=str(tmp_path / "st"), out=tmp_path / "run", minutes=0.03, batch=2, holdout=1, rank=2, warmup=2
    )
    train_seeded(e.model, e.fingerprint, run, None, lambda d: lrs.append(d["lr"]))
    horizon = json.loads((tmp_path / "run" / "adapters.json").read_text())["train"]["lr_horizon"]
    assert HORIZON_PROBE < horizon < 100_000 and len(lrs) > HORIZON_PROBE + 2
    assert lrs[HORIZON_PROBE - 1] == pytest.approx(run.lr, rel=1e-2) and lrs[-1] < 0.5 * run.lr
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert saved["horizon"] == horizon  # what --resume continues on


@pytest.mark.parametrize("kernel", ["plain", "mkldnn"])
def test_a_verify_pass_gives_each_row_its_one_token_step_bits(kernel):
    """Whatever the machine's probes chose (stacked attention rows, batched GEMM rows, or one call
    per row), every row of a 20-row bf16 pass equals the one-token decoding step at its position."""
    from m2r2.kernels import mkldnn_usable, use_kernels

    model = tiny_model(32, vocab=64, dtype=torch.bfloat16, head_dim=64)
    if kernel == "mkldnn" and not mkldnn_usable(model):
        pytest.skip("oneDNN bf16 kernels unavailable here")
    use_kernels(model, kernel)
    tokens = torch.randint(0, 64, (1, 60), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        one, many = model.new_cache(64), model.new_cache(64)
        model(tokens[:, :40], one, 0)
        model(tokens[:, :40], many, 0)
        steps = torch.cat(
            [model.run_layers(model.embed_tokens(tokens[:, p : p + 1]), one, p) for p in range(40, 60)], 1
        )
        block = model.run_layers(model.embed_tokens(tokens[:, 40:60]), many, 40)
    assert torch.equal(block, steps)


def test_a_tapped_stream_starts_at_its_plain_stream_and_trains_on_the_stores_taps(tmp_path, tiny_model):
    """``--taps``: the store keeps the tap layers' outputs (exactly the base pass's), a stream grown from a
    plain one fuses them through columns that start at 0 (so it drafts what the plain one did), and a
    store without those taps is refused."""
    from m2r2.engine import Engine
    from m2r2.training.seeded_train import SeededTrainSettings, train_seeded
    from m2r2.training.store import StoreSettings, TrainStore, build_store

    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    conv = tmp_path / "conv.jsonl"
    _conversations(conv, 9)
    enc = e.tokenizer.encode_conversation
    build_store(
        e.model, e.fingerprint, enc, tmp_path / "t", StoreSettings(str(conv), max_len=32, kv_layers=1, taps=[0])
    )
    build_store(e.model, e.fingerprint, enc, tmp_path / "p", StoreSettings(str(conv), max_len=32, kv_layers=1))
    store = TrainStore(tmp_path / "t", e.fingerprint)
    seq = next(store.sequences(store.load_shard(0)))
    layers: list[torch.Tensor] = []
    with torch.no_grad():
        cache = e.model.new_cache(len(seq["tokens"]))
        e.model.run_layers(e.model.embed_tokens(seq["tokens"][None]), cache, 0, layers)
    assert store.taps == [0] and torch.equal(seq["taps"][:, 0], layers[0][0].to(torch.bfloat16))
    s = SeededTrainSettings(store=tmp_path / "p", out=tmp_path / "plain", steps=2, batch=4, holdout=2, rank=2)
    plain = train_seeded(e.model, e.fingerprint, s, None)
    tapped = SeededFastStream(e.model, SeededConfig.build(e.model.cfg.num_layers, rank=2, taps=[0]))
    tapped.adopt(plain)
    tokens = seq["tokens"][None]
    hidden = seq["hidden"][None].float()
    n = e.model.cfg.num_layers
    kv = (cache.k[[n - 1]], cache.v[[n - 1]])
    a = plain.forward_chain(tokens, hidden, *kv, steps=2)
    b = tapped.forward_chain(tokens, hidden, *kv, steps=2, taps=seq["taps"][None].float())
    assert all(torch.equal(x[-1], y[-1]) for x, y in zip(a, b, strict=True))
    with pytest.raises(SettingsError, match="tap features"):
        tapped.forward_chain(tokens, hidden, *kv, steps=1)
    init = str(tmp_path / "plain" / "adapters")
    grown = train_seeded(e.model, e.fingerprint, replace(s, store=tmp_path / "t", init=init, taps=[0]), None)
    assert grown.cfg.taps == [0] and grown.fuse.in_features == 3 * e.model.cfg.hidden_size
    with pytest.raises(SettingsError, match="not of all of"):
        train_seeded(e.model, e.fingerprint, replace(s, out=tmp_path / "x", taps=[0]), None)


def _tapped_stream(seed: int, **taps: list[int]):
    """A 4-layer tiny model, a one-layer seeded stream with ``taps``/``token_taps`` (random, unmerged) and a 12-token
    sequence run through the model: ``model, fast, tokens, cache, layers, hidden``."""
    model = tiny_model(seed, layers=4)
    fast = SeededFastStream(model, SeededConfig.build(4, depth=1, rank=4, **taps))
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    fast.freeze(merge=False)
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(seed))
    cache, layers = model.new_cache(12), []
    hidden = model.run_layers(model.embed_tokens(tokens), cache, 0, layers)
    return model, fast, tokens, cache, layers, hidden


def test_a_tapped_stream_drafts_with_the_verified_positions_taps_and_stays_lossless():
    """Inference seeds a tapped stream's drafts with the tap layers' outputs at the last verified position,
    exactly what ``forward_chain`` trains on; greedy output stays plain greedy."""
    model, fast, tokens, cache, layers, hidden = _tapped_stream(31, taps=[0, 2])
    taps = torch.stack([layers[0], layers[2]], dim=2)  # [1, T, 2, d]
    chain = fast.forward_chain(tokens, hidden, cache.k[[3]], cache.v[[3]], steps=1, taps=taps)
    strat = TreeSpeculative("m2r2", model, fast, [], None, 6, 3, 2, 2)
    seen = []
    step = fast.step
    fast.step = lambda *a: seen.append(a[-1]) or step(*a)  # type: ignore[method-assign]
    slow = cache.k.clone(), cache.v.clone()
    for p in (4, 9):
        cache.k.copy_(slow[0]), cache.v.copy_(slow[1])  # drafts write their fast K/V past the verified slots
        cache.length = p
        state = strat.seed_state(hidden, layers, p - 1)  # the last verified position's final state and taps
        assert state.shape[-1] == 3 * model.cfg.hidden_size
        strat.drafter.start(state, cache, p)
        f = strat.drafter._level(Tree([int(tokens[0, p])], [-1], [0], [1.0], [None]), [0])
        assert torch.equal(seen[-1][0, 0], taps[0, p - 1])
        assert torch.allclose(f[0], chain[0][-1][0, p], atol=1e-4)
    fast.step = step  # type: ignore[method-assign]
    rng = random.Random(31)
    for _ in range(3):
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 20))]
        gen = GenerationConfig(max_new_tokens=rng.randint(1, 40))
        assert strat.generate(prompt, gen).tokens == Autoregressive(model, []).generate(prompt, gen).tokens


def test_a_token_tapped_stream_drafts_with_the_base_layers_run_on_each_draft_node_and_stays_lossless():
    """``--token-taps``: a draft node's seed reads the base's first layers run on the node itself (over the slow
    cache and its ancestors), exactly the features ``forward_chain`` trains on at the token's own position, at the
    first draft and down a chain of drafts; those layers' K/V in the node's slots are the slow ones; greedy output
    stays plain greedy."""
    model, fast, tokens, cache, layers, hidden = _tapped_stream(32, token_taps=[0, 1])
    assert fast.fuse.in_features == 4 * model.cfg.hidden_size
    own = torch.stack([layers[0], layers[1]], dim=2)  # [1, T, 2, d]: the token taps at every position
    chain = fast.forward_chain(tokens, hidden, cache.k[[3]], cache.v[[3]], steps=2, taps=own)
    strat = TreeSpeculative("m2r2", model, fast, [], None, 6, 3, 2, 2)
    slow = cache.k.clone(), cache.v.clone()
    for p in (4, 9):
        cache.k.copy_(slow[0]), cache.v.copy_(slow[1])
        cache.length = p
        strat.drafter.start(hidden[:, p - 1 : p], cache, p)
        tree = Tree([int(tokens[0, p])], [-1], [0], [1.0], [None])
        f = strat.drafter._level(tree, [0])
        assert torch.allclose(f[0], chain[0][-1][0, p], atol=1e-4)
        assert torch.allclose(cache.k[:2, :, :, p], slow[0][:2, :, :, p], atol=1e-5)  # the slow K/V of layers 0, 1
        tree.add(int(tokens[0, p + 1]), 0, 1.0)  # the true next token as the first draft: draft 2 of a chain
        f = strat.drafter._level(tree, [1])
        assert torch.allclose(f[0], chain[1][-1][0, p + 1], atol=1e-4)
    rng = random.Random(32)
    for _ in range(3):
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 20))]
        gen = GenerationConfig(max_new_tokens=rng.randint(1, 40))
        assert strat.generate(prompt, gen).tokens == Autoregressive(model, []).generate(prompt, gen).tokens
    with pytest.raises(SettingsError, match="token taps must be base layers below"):
        SeededConfig.build(4, depth=2, token_taps=[2])


def test_bad_taps_are_refused_before_any_work(tmp_path, tiny_model, capsys):
    """``--taps`` that is not a list of layer numbers is a usage error; taps outside the model's layers are
    refused by the store (before its base pass) and by a stream's config."""
    from m2r2.cli import main
    from m2r2.engine import Engine
    from m2r2.training.store import StoreSettings, build_store

    with pytest.raises(SystemExit) as exc:
        main(["store", "--taps", "7,x", "--out", str(tmp_path / "s")])
    assert exc.value.code == 2 and "comma-separated layer numbers" in capsys.readouterr().err
    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    conv = tmp_path / "conv.jsonl"
    _conversations(conv, 2)
    with pytest.raises(SettingsError, match="taps must be base layers"):
        build_store(
            e.model,
            e.fingerprint,
            e.tokenizer.encode_conversation,
            tmp_path / "s",
            StoreSettings(str(conv), kv_layers=1, taps=[99]),
        )
    assert not (tmp_path / "s" / "manifest.json").exists()
    with pytest.raises(SettingsError, match="taps must be base layers"):
        SeededConfig.build(4, taps=[4])


def test_positions_a_copy_already_drafts_weigh_copy_w_in_the_stream_loss(tmp_path, tiny_model):
    """`train-seeded --copy-w`: a draft where prompt lookup or the answer store is right already is redundant
    in m2r2's tree, so those positions weigh less in the CE and alignment losses."""
    from m2r2.decoding.answer_store import AnswerStore
    from m2r2.training.copy_weights import copied_positions, copy_weights
    from m2r2.training.seeded_train import SeededTrainSettings, chain_losses, pad_batch, targets, train_seeded
    from m2r2.training.store import TrainStore

    # lookup: at position 4 the 2-gram (5, 6) occurred before and was followed by 7, the next token
    assert copied_positions([5, 6, 7, 5, 6, 7, 8], None).tolist() == [0, 0, 0, 0, 1, 0, 0]
    store = AnswerStore.build([[1, 2, 3, 4], [1, 2, 3, 4]])  # (1, 2) -> 3, (1, 2, 3) -> 4
    assert copied_positions([1, 2, 3, 9], store).tolist() == [0, 1, 0, 0]
    assert copy_weights([1, 2, 3, 9], store, 0.25).tolist() == [1.0, 0.25, 1.0, 1.0]

    e = _engine_and_store(tmp_path, tiny_model)
    s = SeededTrainSettings(store=str(tmp_path / "st"), out=tmp_path / "run", steps=2, batch=2, holdout=1, rank=2)
    stream = train_seeded(e.model, e.fingerprint, replace(s, copy_w=0.5), None)
    meta = json.loads((tmp_path / "run" / "adapters.json").read_text())
    assert meta["train"]["copy_w"] == 0.5
    st = TrainStore(tmp_path / "st", e.fingerprint)
    seqs = list(st.sequences(st.load_shard(0)))[:3]
    plain = chain_losses(stream, pad_batch(seqs, 1), 1)
    for q in seqs:
        q["weight"] = torch.full((len(q["tokens"]),), 3.0)
    same = chain_losses(stream, pad_batch(seqs, 1), 1)  # equal weights: the plain means
    assert torch.allclose(same["ce"], plain["ce"]) and torch.allclose(same["align"], plain["align"])
    for q in seqs:
        q["weight"] = torch.zeros(len(q["tokens"]))
    seqs[1]["weight"][2] = 1.0  # one position carries the whole loss
    batch = pad_batch(seqs, 1)
    one = chain_losses(stream, batch, 1)
    w, p, _ = targets(stream, batch["hidden"])
    states = stream.forward_chain(batch["tokens"], batch["hidden"], batch["k"], batch["v"], 1)
    logp = F.linear(stream.base.norm(states[0][-1]), w).log_softmax(-1)
    assert torch.allclose(one["ce"], -(p[1, 2] * logp[1, 2]).sum())
    with pytest.raises(SettingsError, match="copy-w"):
        train_seeded(e.model, e.fingerprint, replace(s, out=tmp_path / "x", copy_w=0.0), None)
    with pytest.raises(WeightsError, match="answer store"):  # a missing --copy-answers, before any training
        train_seeded(
            e.model, e.fingerprint, replace(s, out=tmp_path / "z", copy_w=0.5, copy_answers=str(tmp_path / "no")), None
        )
    assert not (tmp_path / "z" / "checkpoint.pt").exists()
    with pytest.raises(SettingsError, match="copy_w"):  # a resume must keep the weighting
        train_seeded(e.model, e.fingerprint, replace(s, copy_w=0.25, resume=True), None)


def test_a_store_built_on_the_decoding_kernel_holds_each_sequence_s_own_pass_and_keeps_its_kernel(tmp_path, tiny_model):
    """``store --kernel auto``: the stream then trains on the states it is seeded with at inference, so each
    stored sequence must hold the bits of a decoding-kernel pass over it alone and of its one-token steps, whatever
    the store's batch (and not a prompt's prefill bits: ``amx.decoding_bits``); a resume on another kernel is
    refused."""
    from m2r2 import amx
    from m2r2.engine import Engine
    from m2r2.training.store import StoreSettings, TrainStore, build_store

    d = tiny_model(hidden_size=64, intermediate_size=128, vocab_size=320, layers=3)
    e = Engine(str(d), dtype="bf16", kernel="auto", quiet=True)
    if not e.kernel.startswith("q4"):
        pytest.skip(f"auto picks {e.kernel} here, not a 4-bit decoding kernel")
    data = tmp_path / "conv.jsonl"
    _conversations(data, 7)
    enc = e.tokenizer.encode_conversation
    s = StoreSettings(data=str(data), max_len=96, batch=3, kv_layers=1, precision="bf16", kernel=e.kernel)
    build_store(e.model, e.fingerprint, enc, tmp_path / "st", s)
    st = TrainStore(tmp_path / "st", e.fingerprint)
    seqs = [q for i in range(len(st.shards)) for q in st.sequences(st.load_shard(i))]
    assert len(seqs) == 7 and len({len(q["tokens"]) for q in seqs}) > 1  # batches padded to their longest
    with torch.inference_mode(), amx.decoding_bits():
        for q in seqs:
            ids = q["tokens"].long()[None]
            cache = e.model.new_cache(ids.shape[1])
            h = e.model.run_layers(e.model.embed_tokens(ids), cache, 0)
            assert torch.equal(q["hidden"], h[0].to(torch.bfloat16))
        ids = seqs[0]["tokens"].long()  # and what one-token decoding steps give
        cache = e.model.new_cache(len(ids))
        steps = [e.model.run_layers(e.model.embed_tokens(ids[None, i : i + 1]), cache, i) for i in range(len(ids))]
        assert torch.equal(seqs[0]["hidden"], torch.cat(steps, 1)[0].to(torch.bfloat16))
    assert s.to_dict()["kernel"] == e.kernel and "kernel" not in StoreSettings(data=str(data)).to_dict()
    with pytest.raises(SettingsError, match="other data or settings"):
        other = StoreSettings(data=str(data), max_len=96, batch=3, kv_layers=1, precision="bf16", kernel="mkldnn")
        build_store(e.model, e.fingerprint, enc, tmp_path / "st", other)


def test_exact_agreement_counts_only_the_models_own_token(tmp_path, tiny_model):
    """``eval-align``'s exact agreement: a position counts only where the stream's draft is the full model's
    top-1 over its whole vocabulary; over the draft vocabulary alone a position whose token lies outside it
    would count when the stream picks the model's best guess inside it."""
    from m2r2.training.seeded_train import chain_losses, exact_top, pad_batch, targets
    from m2r2.training.store import TrainStore

    e = _engine_and_store(tmp_path, tiny_model)
    st = TrainStore(tmp_path / "st", e.fingerprint)
    batch = pad_batch(list(st.sequences(st.load_shard(0))), 1)
    stream = SeededFastStream(e.model, SeededConfig.build(e.model.cfg.num_layers, depth=1, rank=2))
    with torch.no_grad():
        full = e.model.lm_head(e.model.norm(batch["hidden"])).argmax(-1)
    assert torch.equal(exact_top(stream, batch["hidden"], full), full)  # no draft vocabulary: the same
    common = full[batch["valid"]].bincount().argsort(descending=True)[:3]  # the model's three commonest picks
    stream.draft_vocab = torch.cat([common, torch.tensor([v for v in range(40) if v not in common.tolist()])]).sort()[0]
    _, _, top = targets(stream, batch["hidden"])
    got = exact_top(stream, batch["hidden"], top)
    inside = torch.isin(full, stream.draft_vocab)
    assert torch.equal(got >= 0, inside) and torch.equal(stream.draft_vocab[got[inside]], full[inside])
    assert bool(inside[batch["valid"]].any()) and not bool(inside[batch["valid"]].all())
    out = chain_losses(stream, batch, 2, exact=True)
    assert len(out["agree_exact"]) == 2 and all(x <= a for x, a in zip(out["agree_exact"], out["agree"], strict=True))
    assert "agree_exact" not in chain_losses(stream, batch, 2)


def test_flat_oov_target_teaches_no_token_where_the_models_pick_lies_outside_the_vocabulary(tmp_path, tiny_model):
    """``--oov flat``: where the full model's top-1 lies outside the draft vocabulary the soft target is
    uniform (its cross-entropy is the mean of ``-log q``) and the hard top-1 term is dropped; elsewhere the
    losses are those of the renormalized target. Without a draft vocabulary the two are the same."""
    from m2r2.training.seeded_train import chain_losses, pad_batch
    from m2r2.training.store import TrainStore

    e = _engine_and_store(tmp_path, tiny_model)
    st = TrainStore(tmp_path / "st", e.fingerprint)
    batch = pad_batch(list(st.sequences(st.load_shard(0))), 1)
    stream = SeededFastStream(e.model, SeededConfig.build(e.model.cfg.num_layers, depth=1, rank=2))
    torch.manual_seed(0)
    for p in stream.parameters():  # a stream whose drafts differ from position to position
        p.data.normal_(0, 0.05)
    with torch.no_grad():
        same = [chain_losses(stream, batch, 1, oov=o) for o in ("renorm", "flat")]
    assert all(torch.equal(same[0][k], same[1][k]) for k in ("ce", "top1", "arla"))
    with torch.no_grad():
        full = e.model.lm_head(e.model.norm(batch["hidden"])).argmax(-1)
    common = full[batch["valid"]].bincount().argsort(descending=True)[:3]
    stream.draft_vocab = torch.cat([common, torch.tensor([v for v in range(40) if v not in common.tolist()])]).sort()[0]
    trained = batch["valid"] & (torch.arange(full.shape[1]) >= 1)  # a first draft needs a verified position
    inside = torch.isin(full, stream.draft_vocab) & trained
    outside = ~torch.isin(full, stream.draft_vocab) & trained
    assert bool(inside.any()) and bool(outside.any())
    with torch.no_grad():
        renorm, flat = (chain_losses(stream, batch, 1, oov=o) for o in ("renorm", "flat"))
        # the same losses, computed by hand on the positions of each kind
        h = stream.forward_chain(batch["tokens"], batch["hidden"], batch["k"], batch["v"], 1)[0][-1]
        w = stream.head_weight().float()
        logq = F.linear(stream.base.norm(h), w).log_softmax(-1)
        p = F.linear(stream.base.norm(batch["hidden"]), w).softmax(-1)
    want_ce = torch.cat([-(p * logq).sum(-1)[inside], -logq.mean(-1)[outside]]).mean()
    top = p.argmax(-1)
    want_top1 = (-logq.gather(-1, top[..., None])[..., 0])[inside].mean()
    torch.testing.assert_close(flat["ce"], want_ce)
    torch.testing.assert_close(flat["top1"], want_top1)
    assert not torch.allclose(renorm["ce"], flat["ce"])
    with pytest.raises(SettingsError, match="--oov"):
        from m2r2.training.seeded_train import SeededTrainSettings, train_seeded

        train_seeded(
            e.model, e.fingerprint, SeededTrainSettings(store=tmp_path / "st", out=tmp_path / "o", oov="x"), None
        )


def test_first_draft_agreement_compares_each_first_draft_with_the_models_next_pick(tiny_model):
    """The inference-form measure seeds the drafter at every answer position with the state of the position
    before and the position's own token, and scores its top draft against the model's pick there: a drafter
    that drafts the pick scores 1, one a position late only where the model picks the same token twice."""
    from m2r2.engine import Engine
    from m2r2.kernels import head_argmax
    from m2r2.training.evaluate import first_draft_agreement

    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    prompt, answer = [1, 5, 7, 9], [11, 13, 11, 12, 30, 30]
    full = prompt + answer
    with torch.inference_mode():
        h = e.model.run_layers(e.model.embed_tokens(torch.tensor([full])), e.model.new_cache(len(full)), 0)
        picks = head_argmax(e.model, h)[0].tolist()

    class Drafter:
        def __init__(self, shift: int) -> None:
            self.shift, self.p = shift, None

        def start(self, h, cache, verified: int) -> None:
            self.p = verified

        def top(self, tree, frontier, k):
            return torch.tensor([[picks[self.p + self.shift]]]), None

    assert first_draft_agreement(e.model, Drafter(0), [(prompt, answer)]) == 1.0
    late = sum(picks[p - 1] == picks[p] for p in range(len(prompt), len(full))) / len(answer)
    assert late < 1 and first_draft_agreement(e.model, Drafter(-1), [(prompt, answer)]) == late


def test_eval_align_as_drafted_adds_the_first_draft_as_m2r2_runs_it(tmp_path, capsys, tiny_model):
    """``eval-align --as-drafted``: beside the float32 training-form figures, the first draft of the stream in the
    form ``m2r2`` builds on the decoding engine, scored on that engine's own greedy answers: the same figure as
    :func:`first_draft_agreement` over :func:`greedy_records`; refused for a file that is not a seeded stream."""
    from tests.test_cli import assert_one_line_error, run_cli

    from m2r2.engine import Engine
    from m2r2.multirate.io import save_adapters
    from m2r2.training.evaluate import first_draft_agreement, greedy_records

    model_dir = str(tiny_model(0))
    e = Engine(model_dir, dtype="bf16", quiet=True)
    fast = seeded_stream(e.model, 1, 0.02, 7, fold=False, vocab=list(range(0, e.model.cfg.vocab_size, 2)))
    path = save_adapters(tmp_path / "s.safetensors", fast, e.fingerprint, torch.float32)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [f"write {i} words"]}) + "\n" for i in range(3)))
    args = ["--model", model_dir, "--dataset", str(prompts), "--max-new-tokens", "12"]
    rc, out, err = run_cli(capsys, "eval-align", *args, "--adapters", str(path), "--as-drafted", "--head-bits", "8")
    assert rc == 0, err
    rep = json.loads(out)
    records = greedy_records(e, [f"write {i} words" for i in range(3)], 12)
    drafter = e.strategy("m2r2", adapters=str(path), head_bits=8).drafter
    assert rep["first_draft_as_drafted"] == first_draft_agreement(e.model, drafter, records)
    assert rep["decoding_kernel"] == e.kernel and rep["as_drafted_positions"] == sum(len(a) for _, a in records)
    inside = sum(t % 2 == 0 for _, a in records for t in a) / rep["as_drafted_positions"]
    assert rep["answer_tokens_in_draft_vocab"] == inside and 0 < inside < 1 and rep["first_draft_as_drafted"] > 0
    assert len(rep["agree_exact_per_draft_position"]) == 4
    rc, out, err = run_cli(capsys, "eval-align", *args, "--as-drafted")
    assert_one_line_error(rc, out, err, "seeded stream")


def test_first_drafts_are_what_a_drafter_sees_after_a_verify_pass(tiny_model):
    """Teacher-forced first drafts over whole answers equal those drafted from a cache holding only the verified
    positions, as after decoding's verify pass: a draft's fast K/V must not stay in the slow slot it borrowed
    (as ``draft_head.py`` let it until the thirty-fourth round, which read agreement ~0.02-0.04 low)."""
    from m2r2.decoding.tree import SeededDrafter, Tree
    from m2r2.engine import Engine
    from m2r2.training.distill import generate_batch
    from m2r2.training.evaluate import first_drafts

    e = Engine(str(tiny_model(0)), dtype="fp32", quiet=True)
    m, g = e.model, torch.Generator().manual_seed(5)
    prompts = [[1, *torch.randint(2, 60, (6,), generator=g).tolist()] for _ in range(2)]
    records = [(p, generate_batch(m, [p], 16, [])[0]) for p in prompts]
    stream = SeededFastStream(m, SeededConfig.build(m.cfg.num_layers, depth=1, rank=4))
    with torch.no_grad():
        for p in stream.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    drafter = SeededDrafter(stream.freeze(merge=True))
    got = first_drafts(m, drafter, records)
    want = []
    with torch.inference_mode():
        for prompt, answer in records:
            full, row = prompt + answer, []
            for p in range(len(prompt), len(full)):
                cache = m.new_cache(len(full) + 8)
                h = m.run_layers(m.embed_tokens(torch.tensor([full[:p]])), cache, 0)
                drafter.start(h[:, -1:], cache, p)
                row.append(int(drafter.top(Tree([full[p]], [-1], [0], [1.0]), [0], 1)[0][0, 0]))
            want.append(row)
    assert got == want and len({t for row in got for t in row}) > 3
