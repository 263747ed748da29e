r"""Summary statistics over seeds: mean, sample standard deviation, range, step-aligned bands.

Every spread in the comparison reports is the **sample** standard deviation over seeds
(Bessel's correction, ``ddof=1``): with :math:`n` seeds and values :math:`x_1..x_n`,

.. math::
    \bar x = \frac1n\sum_i x_i,\qquad
    s = \sqrt{\frac{1}{n-1}\sum_i (x_i-\bar x)^2}\quad (n \ge 2;\ \text{undefined for } n = 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

__all__ = [
    "Spread",
    "StepBand",
    "bootstrap_std_interval",
    "moving_average",
    "paired_differences",
    "paired_t_test",
    "spread",
    "std_interval",
    "step_band",
    "variance_ratio_test",
]


@dataclass(frozen=True)
class Spread:
    """Mean, sample std (``None`` for fewer than two values), min, max and count of values."""

    n: int
    mean: float
    std: float | None
    min: float
    max: float

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def spread(values: Iterable[float]) -> Spread:
    r"""Mean :math:`\bar x`, sample std :math:`s` (ddof = 1, module docstring), min and max.

    Raises ``ValueError`` for no values or a non-finite value (a missing measurement must be
    dropped by the caller, not averaged in).
    """
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("spread() of no values")
    bad = [v for v in xs if not math.isfinite(v)]
    if bad:
        raise ValueError(f"spread() got non-finite values {bad}")
    n = len(xs)
    mean = math.fsum(xs) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in xs) / (n - 1)) if n >= 2 else None
    return Spread(n=n, mean=mean, std=std, min=min(xs), max=max(xs))


def moving_average(values: Sequence[float], window: int) -> list[float]:
    r"""Trailing moving average :math:`y_t = \frac{1}{|W_t|}\sum_{u\in W_t} x_u` with
    :math:`W_t = \{\max(0, t-w+1), \dots, t\}` (shorter windows at the start; ``window=1`` is
    the identity)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out: list[float] = []
    acc = 0.0
    for t, v in enumerate(values):
        acc += v
        if t >= window:
            acc -= values[t - window]
        out.append(acc / min(t + 1, window))
    return out


@dataclass(frozen=True)
class StepBand:
    """A learning curve over seeds: at each ``steps[j]``, the mean and sample std of the seeds'
    values (``std[j]`` is ``None`` with one seed)."""

    steps: list[int]
    mean: list[float]
    std: list[float | None]
    n: int


def step_band(series: Sequence[Mapping[int, float]]) -> StepBand:
    """Align per-seed curves ``{step: value}`` by step and summarise them with :func:`spread`.

    Only the steps present in **every** series are kept, so each point averages the same seeds
    (runs stopped by a time budget end at different steps; their tails are dropped rather than
    averaged over fewer seeds).
    """
    if not series:
        raise ValueError("step_band() of no series")
    common = set(series[0])
    for s in series[1:]:
        common &= set(s)
    steps = sorted(common)
    mean: list[float] = []
    std: list[float | None] = []
    for step in steps:
        sp = spread(s[step] for s in series)
        mean.append(sp.mean)
        std.append(sp.std)
    return StepBand(steps=steps, mean=mean, std=std, n=len(series))


def paired_differences(
    values: Mapping[int, float], baseline: Mapping[int, float]
) -> tuple[list[int], Spread | None]:
    """Per-seed differences ``values[seed] - baseline[seed]`` over the seeds both have, and their
    :func:`spread` (``None`` when no seed is shared)."""
    seeds = sorted(set(values) & set(baseline))
    if not seeds:
        return [], None
    return seeds, spread(values[s] - baseline[s] for s in seeds)


def paired_t_test(differences: Sequence[float]) -> tuple[float, float] | None:
    r"""Two-sided paired t-test of "mean difference = 0" (Student 1908) on per-seed
    differences :math:`d_1..d_n`:

    .. math::
        t = \frac{\bar d}{s_d/\sqrt n},\qquad p = 2\,P(T_{n-1} \ge |t|),

    with :math:`s_d` the sample std (ddof = 1) and :math:`T_{n-1}` Student's t with
    :math:`n - 1` degrees of freedom (``scipy.stats.t``). Returns ``(t, p)``, or ``None`` for
    fewer than two differences or :math:`s_d = 0` (no spread: the test is undefined). With
    three seeds it detects only large effects; report it next to the differences themselves.
    """
    # deferred: scipy.stats takes seconds to import; `gbmpo --help` imports this module
    from scipy.stats import t as student_t

    sp = spread(differences)
    if sp.n < 2 or not sp.std:
        return None
    t = sp.mean / (sp.std / math.sqrt(sp.n))
    p = float(2.0 * student_t.sf(abs(t), sp.n - 1))
    return t, min(p, 1.0)


def std_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    r"""Confidence interval for the standard deviation :math:`\sigma` of normal values from
    their sample std :math:`s` (ddof = 1), through :math:`(n-1)s^2/\sigma^2 \sim \chi^2_{n-1}`:

    .. math::
        \Big[\, s\sqrt{\tfrac{n-1}{\chi^2_{n-1,\,1-\alpha/2}}},\;
               s\sqrt{\tfrac{n-1}{\chi^2_{n-1,\,\alpha/2}}} \,\Big],\qquad \alpha = 1 - \text{level}

    (the textbook interval, e.g. NIST/SEMATECH e-Handbook of Statistical Methods, 7.2.3).
    ``None`` for fewer than two values. It assumes normal seed-to-seed variation; with 5 seeds
    the 95% interval spans about 0.6 s to 2.9 s.
    """
    # deferred: scipy.stats takes seconds to import; `gbmpo --help` imports this module
    from scipy.stats import chi2

    sp = spread(values)
    if sp.n < 2 or sp.std is None:
        return None
    alpha = 1.0 - level
    df = sp.n - 1
    lo = sp.std * math.sqrt(df / float(chi2.ppf(1.0 - alpha / 2.0, df)))
    hi = sp.std * math.sqrt(df / float(chi2.ppf(alpha / 2.0, df)))
    return lo, hi


def variance_ratio_test(a: Sequence[float], b: Sequence[float]) -> tuple[float, float] | None:
    r"""Two-sided F-test of equal variances of two independent normal samples (Snedecor's F):

    .. math::
        F = s_a^2 / s_b^2,\qquad p = 2\,\min\big(P(F_{n_a-1,n_b-1} \le F),\;
        P(F_{n_a-1,n_b-1} \ge F)\big).

    Returns ``(F, p)``; ``None`` for fewer than two values in either sample or a zero
    variance in ``b`` (the ratio is undefined). Sensitive to non-normality; report it next to
    the standard deviations and their intervals, not alone.
    """
    # deferred: scipy.stats takes seconds to import; `gbmpo --help` imports this module
    from scipy.stats import f as f_dist

    sa, sb = spread(a), spread(b)
    if sa.n < 2 or sb.n < 2 or sa.std is None or not sb.std:
        return None
    ratio = sa.std**2 / sb.std**2
    d1, d2 = sa.n - 1, sb.n - 1
    p = 2.0 * min(float(f_dist.cdf(ratio, d1, d2)), float(f_dist.sf(ratio, d1, d2)))
    return ratio, min(p, 1.0)


def bootstrap_std_interval(
    values: Sequence[float], level: float = 0.95, n_boot: int = 10_000, seed: int = 0
) -> tuple[float, float] | None:
    r"""Percentile bootstrap interval (Efron 1979) for the sample std (ddof = 1): resample the
    :math:`n` values with replacement ``n_boot`` times, take each resample's :math:`s`, and
    return the :math:`\alpha/2` and :math:`1-\alpha/2` quantiles. Distribution-free, but with
    a handful of seeds it is narrow where the data are (it never exceeds the largest spread a
    resample of the observed values can show). ``None`` for fewer than two values."""
    xs = np.asarray([float(v) for v in values], dtype=float)
    if xs.size < 2:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, xs.size, size=(n_boot, xs.size))
    stds = xs[idx].std(axis=1, ddof=1)
    alpha = 1.0 - level
    lo, hi = np.quantile(stds, [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(lo), float(hi)
