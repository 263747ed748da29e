"""score_completions: per-sample failures -> 0 + counted; whole-batch failures -> RewardError."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gbmpo.rewards.scoring import RewardError, score_completions

PROMPTS = ["p0", "p1", "p2", "p3"]
COMPLETIONS = ["a", "bb", "ccc", "dddd"]
COLUMNS = {"answer": ["1", "2", "3", "4"]}


def test_good_rewards_pass_through():
    out = score_completions(
        lambda prompts, completions, answer: [0.0, 1.0, 0.5, 1], PROMPTS, COMPLETIONS, COLUMNS
    )
    assert out.rewards == [0.0, 1.0, 0.5, 1.0] and out.failures == 0


def test_numpy_scalars_are_accepted():
    out = score_completions(
        lambda **kw: list(np.array([1.0, 0.0, 1.0, 0.0])), PROMPTS, COMPLETIONS, COLUMNS
    )
    assert out.rewards == [1.0, 0.0, 1.0, 0.0]


def test_none_nan_inf_and_junk_become_zero_and_are_counted():
    out = score_completions(
        lambda **kw: [None, math.nan, math.inf, 1.0], PROMPTS, COMPLETIONS, COLUMNS
    )
    assert out.rewards == [0.0, 0.0, 0.0, 1.0]
    assert out.failures == 3
    assert set(out.failure_kinds) == {"None", "NaN", "inf"}
    out = score_completions(lambda **kw: ["x", 1.0, [2], 0.0], PROMPTS, COMPLETIONS, COLUMNS)
    assert out.rewards == [0.0, 1.0, 0.0, 0.0] and out.failures == 2


def test_batch_exception_is_retried_per_sample():
    def reward(prompts, completions, answer):
        if any(c == "ccc" for c in completions):
            raise ValueError("cannot grade ccc")
        return [float(len(c)) for c in completions]

    out = score_completions(reward, PROMPTS, COMPLETIONS, COLUMNS)
    assert out.rewards == [1.0, 2.0, 0.0, 4.0]
    assert out.failures == 1 and "ValueError: cannot grade ccc" in out.failure_kinds[0]


def test_columns_are_passed_by_name_and_sliced_per_sample():
    seen = []

    def reward(prompts, completions, answer):
        seen.append(list(answer))
        if len(completions) > 1:
            raise RuntimeError("force the per-sample path")
        return [float(answer[0])]

    out = score_completions(reward, PROMPTS, COMPLETIONS, COLUMNS)
    assert out.rewards == [1.0, 2.0, 3.0, 4.0]
    assert seen == [["1", "2", "3", "4"], ["1"], ["2"], ["3"], ["4"]]


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (
            lambda **kw: 1 / 0,
            "raised for every one of the 4 completions; first error: ZeroDivisionError",
        ),
        (lambda **kw: [None] * 4, "no usable reward for any of the 4 completions"),
        (lambda **kw: [1.0, 0.0], "returned 2 values for 4 completions"),
        (lambda **kw: 1.0, "returned float"),
        (lambda **kw: "1111", "returned str"),
    ],
)
def test_whole_batch_failures_raise(fn, message):
    with pytest.raises(RewardError, match=message):
        score_completions(fn, PROMPTS, COMPLETIONS, COLUMNS)


def test_column_length_mismatch_is_a_bug():
    with pytest.raises(ValueError, match="column 'answer' has 3 entries for 4"):
        score_completions(lambda **kw: [0.0] * 4, PROMPTS, COMPLETIONS, {"answer": ["1"] * 3})
