"""Evaluation metrics: the unbiased pass@k estimator and accuracy with its standard error."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["default_ks", "mean_and_stderr", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    r"""Unbiased pass@k of one problem with ``c`` correct among ``n`` samples.

    .. math:: \widehat{\text{pass@}k} = 1 - \binom{n-c}{k} \Big/ \binom{n}{k}
              = 1 - \prod_{i=n-c+1}^{n} \Big(1 - \frac{k}{i}\Big)

    (Chen et al., 2021, "Evaluating Large Language Models Trained on Code", eq. 1 and its
    numerically stable product form). It is 1 when ``n - c < k``.
    """
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError("n, c and k must be integers")
    if n < 1 or k < 1:
        raise ValueError(f"pass@k needs n >= 1 and k >= 1, got n={n}, k={k}")
    if not 0 <= c <= n:
        raise ValueError(f"the number correct c={c} must lie in [0, n={n}]")
    if k > n:
        raise ValueError(f"pass@{k} needs at least k samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    r"""Mean and standard error :math:`s/\sqrt{m}` (sample std, ``ddof=1``; 0 for one value)."""
    m = len(values)
    if m == 0:
        raise ValueError("no values")
    mean = sum(values) / m
    if m == 1:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (m - 1)
    return mean, math.sqrt(var / m)


def default_ks(samples: int) -> list[int]:
    """The k reported for ``samples`` per problem: 1, 5, 10, 20, 50, 100 up to ``samples``,
    and ``samples`` itself."""
    return sorted({k for k in (1, 5, 10, 20, 50, 100) if k <= samples} | {samples})
