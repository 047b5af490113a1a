"""How often each copy source's first token is right, by the rounds of copies-alone answers (``draft=never``; MT-Bench
first turns 2..PROMPTS, greedy, 128 tokens): rounds where prompt lookup proposes a chain (and, where its first token
is wrong, whether the answer store's would have been right), rounds where the answer store alone proposes one, and
rounds with no copy. Counts only.

    python experiments/copy_first_token.py [PROMPTS]
"""

import sys

from warmed import GEN, warmed_first_turns

from m2r2.decoding import tree as tree_mod
from m2r2.decoding.lookup import DEFAULT_LOOKUP, NgramIndex

engine, ids = warmed_first_turns(int(sys.argv[1]) if len(sys.argv) > 1 else 30, 2)
one_round = tree_mod.TreeSpeculative.round
n = dict.fromkeys(("rounds", "lookup", "lookup wrong", "store right there", "store", "store wrong", "none"), 0)


def counted_round(self, state, cache, tok, *args):
    context = [*state.context.tokens, tok]
    looked = NgramIndex(context).propose(DEFAULT_LOOKUP)
    stored = self.answers.propose(context, DEFAULT_LOOKUP)[0] if self.answers is not None else []
    out = one_round(self, state, cache, tok, *args)
    first = out[0][0]  # the round's first emitted token: the full model's next token after the root
    n["rounds"] += 1
    if looked:
        n["lookup"] += 1
        if looked[0] != first:
            n["lookup wrong"] += 1
            n["store right there"] += bool(stored) and stored[0] == first
    elif stored:
        n["store"] += 1
        n["store wrong"] += stored[0] != first
    else:
        n["none"] += 1
    return out


tree_mod.TreeSpeculative.round = counted_round
tokens = sum(len(engine.generate_ids(p, "m2r2", GEN, draft="never").tokens) for p in ids[1:])
print(f"{engine.kernel} kernel, MT-Bench first turns 2..{len(ids)}, {tokens} tokens, copies alone")
print(" | ".join(f"{k} {v}" for k, v in n.items()))
