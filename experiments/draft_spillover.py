"""Does a draft cost the rounds after it? Copies-alone `m2r2` answers (``draft=never``; bundled model, MT-Bench first
turns after a warm-up), each given twice, alternately first: plain, and with a dummy draft call (the fast stream's
whole tree under the round's root, thrown away) before every third round. The tokens are the same; the answer with the
dummies takes longer by the dummies' own time plus whatever they cost the rounds around them (weights and cache lines
they push out, the core's state). The spillover per dummy is that excess, in plain rounds of the same answers.

    python experiments/draft_spillover.py [PROMPTS] [THREADS]
"""

import statistics
import sys
import time

from warmed import GEN, warmed_first_turns

from m2r2.decoding import tree as tree_mod

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 30
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine, ids = warmed_first_turns(n_prompts, threads)
one_round = tree_mod.TreeSpeculative.round
dummy = {"on": False, "rounds": 0, "calls": 0, "seconds": 0.0}


def round_with_dummy(self, state, cache, tok, stopper, accept_rate, gen, sampler):
    dummy["rounds"] += 1
    if dummy["on"] and dummy["rounds"] % 3 == 0 and cache.max_len - cache.length > self.max_nodes + 1:
        t = time.perf_counter()
        self.draft(state.h_last, tok, cache, self.max_nodes, gen, state.calib, self.costs)
        dummy["seconds"] += time.perf_counter() - t
        dummy["calls"] += 1
    return one_round(self, state, cache, tok, stopper, accept_rate, gen, sampler)


tree_mod.TreeSpeculative.round = round_with_dummy
plain_s, dummy_s, excess, rounds_plain, all_calls = [], [], [], 0, 0
for i, prompt in enumerate(ids[1:]):
    times, tokens = {}, {}
    for on in (False, True) if i % 2 == 0 else (True, False):
        dummy.update(on=on, rounds=0, calls=0, seconds=0.0)
        t = time.perf_counter()
        out = engine.generate_ids(prompt, "m2r2", GEN, draft="never")
        times[on], tokens[on] = time.perf_counter() - t, out.tokens
        if on:
            calls, called_s = dummy["calls"], dummy["seconds"]
        else:
            rounds_plain += dummy["rounds"]
    assert tokens[True] == tokens[False], "a dummy draft changed the answer"
    plain_s.append(times[False])
    dummy_s.append(called_s)
    all_calls += calls
    if calls:
        excess.append((times[True] - times[False] - called_s) / calls)
round_s = sum(plain_s) / rounds_plain
print(f"{engine.kernel} kernel, {threads} thread(s), MT-Bench first turns 2..{n_prompts}, 128 tokens, draft=never")
print(
    f"a round of the plain answers: {round_s * 1e3:.2f} ms; a dummy draft call: {sum(dummy_s) / all_calls * 1e3:.2f} ms"
)
print(
    f"spillover per dummy draft, per answer: median {statistics.median(excess) * 1e3:.3f} ms "
    f"({statistics.median(excess) / round_s:.3f} of a round), mean {statistics.fmean(excess) * 1e3:.3f} ms "
    f"({statistics.fmean(excess) / round_s:.3f}); answers {len(excess)}"
)
