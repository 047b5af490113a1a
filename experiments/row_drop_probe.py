"""Could a verify pass drop its rejected rows part-way up the stack? A probe, replayed inside real `m2r2` generation
on MT-Bench first turns: for each verify pass that is a chain, the rows' outputs of every block are taken (the same
pass run again on a copy of the cache, op by op), and for each drafted row i the logit lens of row i-1 at block L
(the final norm and the LM head on that block's output) scores row i's token: its logit minus the best one. A row
is wasted when some row up to it was not what the full model picked. Prints, per block L and threshold on that score,
the share of wasted rows the threshold would have dropped from block L on and the share of accepted rows it would
have lost (and with them their tokens), and what a pass's layers would have saved.

    python experiments/row_drop_probe.py [PROMPTS] [THREADS]
"""

import sys

import torch
from warmed import GEN, warmed_first_turns

from m2r2.decoding import tree as tree_mod

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 20
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine, ids = warmed_first_turns(n_prompts + 1, threads)
model = engine.model
BLOCKS = (10, 15, 20, 25)
chains: list[list[tuple[list[float], bool]]] = []  # per chain pass, per drafted row: its scores, whether accepted
real = tree_mod.greedy_verify


def probed(m, tokens, cache, pos, positions=None, mask=None):
    out, h = real(m, tokens, cache, pos, positions, mask)
    if positions is None and len(tokens) > 1:  # a chain: row i verifies tokens[i + 1]
        copy = m.new_cache(cache.max_len)
        copy.k.copy_(cache.k)
        copy.v.copy_(cache.v)
        layers: list[torch.Tensor] = []
        m.run_layers(m.embed_tokens(torch.tensor([tokens])), copy, pos, layers)
        target = out if isinstance(out, list) else out.tolist()
        scores = []
        for b in BLOCKS:
            logits = m.head(layers[b - 1])[0]  # [T, V] float32
            best = logits.max(-1).values
            scores.append([float(logits[i - 1, tokens[i]] - best[i - 1]) for i in range(1, len(tokens))])
        ok, rows = True, []
        for i in range(1, len(tokens)):
            ok = ok and tokens[i] == target[i - 1]
            rows.append(([s[i - 1] for s in scores], ok))
        chains.append(rows)
    return out, h


tree_mod.greedy_verify = probed
with torch.inference_mode():
    for prompt in ids[1:]:
        engine.generate_ids(prompt, "m2r2", GEN)
tree_mod.greedy_verify = real
records = [r for rows in chains for r in rows]
wasted = sum(1 for _, ok in records if not ok)
kept = len(records) - wasted
print(f"{engine.kernel}, {threads} thread(s), MT-Bench first turns 2..{n_prompts + 1}: {len(chains)} chain passes,")
print(f"{len(records)} drafted rows, {kept} accepted, {wasted} wasted. A row scoring below the threshold is dropped")
print("from block L on with every row after it; dropping saves (30 - L) / 30 of a row's layers")
print("| block L | dropped when score < | wasted rows dropped | accepted rows lost | wasted rows' layers saved |")
print("|--:|--:|--:|--:|--:|")
for j, b in enumerate(BLOCKS):
    for thr in (-8.0, -4.0, -2.0, -1.0):
        drop_w = drop_a = 0
        for rows in chains:
            cut = next((i for i, (sc, _) in enumerate(rows) if sc[j] < thr), len(rows))
            drop_w += sum(1 for _, ok in rows[cut:] if not ok)
            drop_a += sum(1 for _, ok in rows[cut:] if ok)
        share_w = drop_w / max(wasted, 1)
        print(f"| {b} | {thr:g} | {share_w:.2f} | {drop_a / max(kept, 1):.2f} | {share_w * (30 - b) / 30:.2f} |")
