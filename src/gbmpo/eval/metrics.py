"""Evaluation metrics: the unbiased pass@k estimator, accuracy with its standard error, and the
number of distinct final answers per problem."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["default_ks", "distinct_answers", "final_answer", "mean_and_stderr", "pass_at_k"]


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
    """The k reported for ``samples`` per problem, a pass@k curve: 1, 2, 4, 8, ... (powers of
    two) up to ``samples``, and ``samples`` itself."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    ks, k = set(), 1
    while k <= samples:
        ks.add(k)
        k *= 2
    return sorted(ks | {samples})


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(completion: str, details: dict[str, Any] | None = None) -> str:
    """The final answer of one sample, for counting distinct answers: the task's extracted
    answer where its grade reports one (``extracted``: GSM8K, reasoning-gym), the extracted
    program of a code task (``program``), else the last number in the completion (arithmetic
    and number-answer tasks; commas dropped), else the whole completion with its whitespace
    collapsed. An unparseable extraction (None) counts as the empty answer."""
    d = details or {}
    for key in ("extracted", "program"):
        if key in d:
            value = d[key]
            return "" if value is None else " ".join(str(value).split())
    numbers = _NUMBER.findall(completion)
    if numbers:
        return numbers[-1].replace(",", "")
    return " ".join(completion.split())


def distinct_answers(
    completions: Sequence[str], details: Sequence[dict[str, Any]] | None = None
) -> int:
    """How many different final answers (:func:`final_answer`) the samples of one problem
    give: 1 when they all agree, ``len(completions)`` when they all differ (a diversity
    measure next to pass@k: DPH-RL, arXiv 2509.07430, reads diversity collapse from it)."""
    ds = list(details) if details is not None else [{} for _ in completions]
    return len({final_answer(c, d) for c, d in zip(completions, ds, strict=True)})
