"""A distribution-free confidence interval for a median (the sign test's), for the benchmark's per-prompt ratios.

Why: on a shared 2-vCPU VM per-prompt speedups spread by +-15% from run to run, so a median alone cannot say whether
1.21x against 1.25x is a difference. Of n sorted values, ``[x_(k), x_(n+1-k)]`` covers the population's median with
probability ``1 - 2 P(Binomial(n, 1/2) <= k - 1)`` whatever their distribution: no bootstrap (no randomness in a
report) and no assumption of normality.
"""

from __future__ import annotations

from collections.abc import Iterable
from math import comb


def median_interval(values: Iterable[float], level: float = 0.95) -> tuple[float, float] | None:
    """The narrowest order-statistic interval that covers the median with at least ``level`` probability, or None
    where no interval of these values can (fewer than 6 values at 95%)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    xs = sorted(values)
    n, below, k = len(xs), 0.0, 0
    for j in range(n // 2 + 1):  # below: P(Binomial(n, 1/2) <= j)
        below += comb(n, j) / 2**n
        if 1.0 - 2.0 * below < level:
            break
        k = j + 1
    return (xs[k - 1], xs[n - k]) if k else None
