"""Whether the fast stream's draft probabilities are calibrated where `m2r2` verifies them: inside real greedy
generation on MT-Bench first turns (bundled model, shipped stream, after a warm-up), every verified drafted node
(copies excluded) whose parent lies on the accepted path is counted, by depth and by its own draft probability
given its parent, with whether the full model chose it. The tree prices a node at ``calib`` times its path
probability (one running scalar a sequence), which is right only if the accepted share tracks the probability
across bins, not just on average. Noise-free counts; the cores may be shared.

    python experiments/draft_calibration.py [PROMPTS] [THREADS]
"""

import collections
import sys

from warmed import GEN, warmed_first_turns

from m2r2.decoding import tree as tree_mod

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 30
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
engine, ids = warmed_first_turns(n_prompts, threads)
counts: dict[tuple[int, int], list[float]] = collections.defaultdict(lambda: [0, 0, 0.0])  # n, accepted, sum of p
accept = tree_mod.TreeSpeculative._accept


def counted(tree, rows, out, gen, sampler, exit_threshold=None):
    """``_accept``, then each verified drafted node under the accepted path counted in its (depth, probability) bin."""
    path, nxt = accept(tree, rows, out, gen, sampler, exit_threshold)
    target, on_path = out.tolist(), set(path)
    for r in rows[1:]:
        if tree.scores[r] <= 0 or r in tree.copy_probs or tree.parents[r] not in on_path:
            continue
        p = tree.own(r)
        c = counts[(min(tree.depths[r], 3), min(int(p * 10), 9))]
        c[0] += 1
        c[1] += tree.tokens[r] == target[rows.index(tree.parents[r])]
        c[2] += p
    return path, nxt


tree_mod.TreeSpeculative._accept = staticmethod(counted)
for prompt in ids[1:]:
    engine.generate_ids(prompt, "m2r2", GEN)
print(
    f"{engine.kernel} kernel, MT-Bench first turns 2..{n_prompts}, shipped stream; drafted nodes under the accepted"
    " path"
)
print("| depth | own draft p | nodes | mean p | accepted | accepted / p |")
print("|---|---|--:|--:|--:|--:|")
for depth in (1, 2, 3):
    total = [0, 0, 0.0]
    for b in range(10):
        n, hits, p = counts[(depth, b)]
        total = [total[0] + n, total[1] + hits, total[2] + p]
        if n:
            label = f"{depth}+" if depth == 3 else str(depth)
            print(
                f"| {label} | {b / 10:.1f}-{(b + 1) / 10:.1f} | {n} | {p / n:.3f} | {hits / n:.3f} | {hits / p:.2f} |"
            )
    if total[0]:
        print(
            f"| {depth}{'+' if depth == 3 else ''} | all | {total[0]} | {total[2] / total[0]:.3f} | "
            f"{total[1] / total[0]:.3f} | {total[1] / total[2]:.2f} |"
        )
