"""Calling a reward function on a batch of completions, with per-sample failure handling.

Reward functions follow TRL's convention ``fn(prompts=..., completions=..., **columns) ->
list[float | None]``. :func:`score_completions` calls it once for the whole batch:

* a value that is ``None``, NaN, infinite or not a number is a *per-sample failure*: the
  sample gets reward 0 and is counted;
* if the batch call raises, every completion is scored on its own; completions whose call
  raises are per-sample failures;
* if **every** completion failed, or the function returns the wrong number of values,
  :class:`RewardError` is raised (a broken reward function must not look like a bad policy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RewardError", "ScoredBatch", "score_completions"]

RewardFn = Callable[..., Sequence[Any]]


class RewardError(ValueError):
    """The reward function is broken for the whole batch (message names the cause)."""


@dataclass
class ScoredBatch:
    """Rewards (failures replaced by 0.0) and the per-sample failures."""

    rewards: list[float]
    failures: int = 0
    #: one short description per failure kind, e.g. "None", "NaN", "ValueError: ..."
    failure_kinds: list[str] = field(default_factory=list)
    #: per completion: why its reward is unusable (a failure kind), or None
    failed: list[str | None] = field(default_factory=list)


def _fn_name(fn: Any) -> str:
    """The function's name; a task's ``reward`` method whose task has ``reward_name`` (the user's
    reward spec, e.g. ``my_rewards.py:score``) is named by it."""
    named = getattr(getattr(fn, "__self__", None), "reward_name", None)
    if isinstance(named, str) and named:
        return named
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _check_value(value: Any) -> tuple[float | None, str | None]:
    if value is None:
        return None, "None"
    try:  # numpy / torch scalars convert; a bool is no reward
        if isinstance(value, bool):
            raise TypeError
        v = float(value)
    except OverflowError:  # an int beyond float range
        return None, "inf"
    except Exception:  # noqa: BLE001 - whatever the value's __float__ raises
        return None, f"non-numeric {type(value).__name__}"
    if math.isnan(v):
        return None, "NaN"
    if math.isinf(v):
        return None, "inf"
    return v, None


def _call(
    fn: RewardFn, prompts: list[str], completions: list[str], columns: dict[str, list[Any]]
) -> list[Any]:
    out = fn(prompts=prompts, completions=completions, **columns)
    if out is None or isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
        raise RewardError(
            f"reward function {_fn_name(fn)} returned {type(out).__name__}, expected a list of "
            f"{len(completions)} floats"
        )
    values = list(out)
    if len(values) != len(completions):
        raise RewardError(
            f"reward function {_fn_name(fn)} returned {len(values)} values for "
            f"{len(completions)} completions"
        )
    return values


def score_completions(
    fn: RewardFn,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list[Any]],
) -> ScoredBatch:
    """Score ``completions`` (see the module docstring for the failure rules)."""
    n = len(completions)
    for key, col in columns.items():
        if len(col) != n:
            raise ValueError(f"column {key!r} has {len(col)} entries for {n} completions")
    try:
        raw: list[Any] = _call(fn, prompts, completions, columns)
        errors: list[str | None] = [None] * n
    except RewardError:
        raise
    except Exception as batch_err:  # noqa: BLE001 - retried per sample below
        raw, errors = [], []
        for i in range(n):
            try:
                (value,) = _call(
                    fn, [prompts[i]], [completions[i]], {k: [v[i]] for k, v in columns.items()}
                )
                raw.append(value)
                errors.append(None)
            except RewardError:
                raise
            except Exception as err:  # noqa: BLE001 - a per-sample failure
                raw.append(None)
                errors.append(f"{type(err).__name__}: {err}")
        if all(e is not None for e in errors):
            raise RewardError(
                f"reward function {_fn_name(fn)} raised for every one of the {n} completions; "
                f"first error: {type(batch_err).__name__}: {batch_err}"
            ) from batch_err
    rewards: list[float] = []
    kinds: list[str] = []
    failed: list[str | None] = []
    for value, err in zip(raw, errors, strict=True):
        if err is not None:
            rewards.append(0.0)
            kinds.append(err)
            failed.append(err)
            continue
        v, kind = _check_value(value)
        if v is None:
            rewards.append(0.0)
            kinds.append(str(kind))
            failed.append(str(kind))
        else:
            rewards.append(v)
            failed.append(None)
    if len(kinds) == n:
        raise RewardError(
            f"reward function {_fn_name(fn)} gave no usable reward for any of the {n} "
            f"completions (e.g. {kinds[0]}); check the function and the data columns "
            f"{sorted(columns)}"
        )
    return ScoredBatch(rewards=rewards, failures=len(kinds), failure_kinds=sorted(set(kinds)),
                       failed=failed)
