#!/usr/bin/env bash
# Verify-pass costs v(k) at an earlier commit and at the working tree, alternating (a checkout of COMMIT in
# runs/ab-COMMIT, each run importing its own tree's m2r2, so each builds and uses its own C++ kernels), twice
# per thread count: one session's machine for both, since this VM's speed moves between sessions.
#
#   experiments/verify_ab.sh COMMIT        (from the repository root, after ./scripts/setup.sh)
set -euo pipefail
commit=$(git rev-parse --short "$1")
old="runs/ab-$commit"
[ -d "$old" ] || git worktree add -q "$old" "$commit"
for threads in 1 2; do
  for repeat in 1 2; do
    for tree in "$old" .; do
      label=$([ "$tree" = . ] && echo "this tree" || echo "$commit")
      echo "== threads $threads, $label, repeat $repeat"
      (cd "$tree" && PYTHONPATH="$PWD/src" "$OLDPWD/.venv/bin/python" experiments/verify_cost.py --kernels q4-avx2 \
        --rows 1,2,3,4,6,8 --threads "$threads" --repeats 5 2>&1 | grep "certified head")
    done
  done
done
git worktree remove --force "$old"
