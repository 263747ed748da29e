"""Mean / sample std / range over seeds, moving average, step alignment: hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gbmpo.experiments.stats import moving_average, paired_differences, spread, step_band


def test_spread_hand_computed():
    # mean 0.76; deviations -0.06, -0.01, 0.07; squares sum 0.0086; / (n-1) = 0.0043
    sp = spread([0.70, 0.75, 0.83])
    assert sp.n == 3
    assert sp.mean == pytest.approx(0.76)
    assert sp.std == pytest.approx(math.sqrt(0.0043))
    assert sp.std == pytest.approx(0.065574385, rel=1e-8)
    assert (sp.min, sp.max) == (0.70, 0.83)


def test_spread_uses_sample_not_population_std():
    sp = spread([1.0, 3.0])  # population std would be 1.0
    assert sp.std == pytest.approx(math.sqrt(2.0))


def test_spread_single_value_has_no_std():
    sp = spread([0.5])
    assert sp.mean == 0.5 and sp.std is None and sp.min == sp.max == 0.5


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [float("inf")]])
def test_spread_rejects_empty_and_non_finite(bad):
    with pytest.raises(ValueError):
        spread(bad)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=2, max_size=12),
    st.floats(-100, 100, allow_nan=False),
)
def test_spread_matches_numpy_and_is_shift_invariant(xs, shift):
    sp = spread(xs)
    assert sp.mean == pytest.approx(float(np.mean(xs)), abs=1e-9)
    assert sp.std == pytest.approx(float(np.std(xs, ddof=1)), abs=1e-7)
    shifted = spread([x + shift for x in xs])
    assert shifted.std == pytest.approx(sp.std, abs=1e-6)


def test_moving_average_trailing_window():
    assert moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert moving_average([3.0, 6.0, 9.0], 3) == [3.0, 4.5, 6.0]
    assert moving_average([1.0, 2.0], 1) == [1.0, 2.0]
    with pytest.raises(ValueError):
        moving_average([1.0], 0)


def test_step_band_keeps_only_steps_every_seed_reached():
    a = {1: 0.2, 2: 0.4, 3: 0.6}
    b = {1: 0.4, 2: 0.8}  # stopped earlier (time budget)
    band = step_band([a, b])
    assert band.steps == [1, 2]
    assert band.mean == pytest.approx([0.3, 0.6])
    assert band.std[0] == pytest.approx(math.sqrt(0.02))  # (0.1^2 + 0.1^2) / 1
    assert band.std[1] == pytest.approx(math.sqrt(0.08))
    assert band.n == 2
    one = step_band([a])
    assert one.std == [None, None, None]


def test_paired_differences_over_shared_seeds():
    seeds, sp = paired_differences({0: 0.8, 1: 0.7, 2: 0.9}, {0: 0.75, 1: 0.75, 3: 0.1})
    assert seeds == [0, 1]
    assert sp is not None
    assert sp.mean == pytest.approx(0.0)  # +0.05 and -0.05
    assert sp.std == pytest.approx(math.sqrt(0.005))
    assert paired_differences({0: 1.0}, {1: 1.0}) == ([], None)


def test_std_interval_matches_chi_square_formula():
    from scipy.stats import chi2

    from gbmpo.experiments.stats import std_interval

    xs = [0.70, 0.75, 0.83, 0.78, 0.72]
    s = float(np.std(xs, ddof=1))
    lo, hi = std_interval(xs)
    assert lo == pytest.approx(s * math.sqrt(4 / chi2.ppf(0.975, 4)))
    assert hi == pytest.approx(s * math.sqrt(4 / chi2.ppf(0.025, 4)))
    assert lo < s < hi
    assert std_interval([0.5]) is None


def test_variance_ratio_test_hand_computed():
    from gbmpo.experiments.stats import variance_ratio_test

    # variances 2.5 and 0.625 -> F = 4 with (4, 4) degrees of freedom; P(F_{4,4} >= 4) = 0.104
    f, p = variance_ratio_test([1, 2, 3, 4, 5], [1, 1.5, 2, 2.5, 3])
    assert f == pytest.approx(4.0)
    assert p == pytest.approx(0.208, abs=1e-3)
    # symmetric: swapping the samples inverts F and keeps p
    f2, p2 = variance_ratio_test([1, 1.5, 2, 2.5, 3], [1, 2, 3, 4, 5])
    assert f2 == pytest.approx(0.25) and p2 == pytest.approx(p)
    assert variance_ratio_test([1, 2], [3, 3]) is None  # zero variance in the denominator
    assert variance_ratio_test([1], [1, 2]) is None


def test_bootstrap_std_interval_is_seeded_and_brackets_the_sample_std():
    from gbmpo.experiments.stats import bootstrap_std_interval

    xs = [0.70, 0.75, 0.83, 0.78, 0.72]
    a = bootstrap_std_interval(xs, n_boot=2000, seed=1)
    assert a == bootstrap_std_interval(xs, n_boot=2000, seed=1)
    lo, hi = a
    assert 0.0 <= lo < float(np.std(xs, ddof=1)) < hi
    assert bootstrap_std_interval([0.5]) is None
