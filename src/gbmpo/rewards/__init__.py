"""Verifiable rewards: final-answer math (math-verify) and code run in a hardened sandbox.

Reward functions follow TRL's convention ``fn(prompts, completions, **columns) ->
list[float | None]`` and are registered by name in :data:`REWARDS`:

* ``math``: :func:`gbmpo.rewards.math.math_reward_fn` (column ``answer``);
* ``code_pass_fraction``: fraction of tests passed (columns ``tests``, ``setup``, ``prefix``,
  ``entry_point``; see :mod:`gbmpo.rewards.code`);
* ``code_all_pass``: 1.0 iff every test passed;
* ``code_shaped``: the GBMPO authors' shaped MBPP reward (docs/methods.md, section "Shaped MBPP
  reward"; see :mod:`gbmpo.rewards.code_shaping`);
* ``exact``: final answer equals column ``answer`` as a string
  (:func:`gbmpo.rewards.resolve.exact_match_reward`).

Plugins add names through the ``gbmpo.rewards`` entry-point group; :func:`resolve_reward` also
takes an import path ``module:function`` (see :mod:`gbmpo.rewards.resolve`).
"""

from __future__ import annotations

from gbmpo.rewards.code import (
    build_program,
    code_all_pass,
    code_pass_fraction,
    code_shaped,
    extract_code,
    grade_code,
    make_code_reward,
)
from gbmpo.rewards.math import extract_answer, math_reward, math_reward_fn, parse_number
from gbmpo.rewards.resolve import (
    REWARD_ALIASES,
    REWARDS,
    RewardFn,
    exact_match_reward,
    resolve_reward,
)


def get_reward(name: str) -> RewardFn:
    """The reward function registered as ``name`` (unknown names list the valid ones)."""
    return REWARDS.get(name)


__all__ = [
    "REWARDS",
    "REWARD_ALIASES",
    "exact_match_reward",
    "resolve_reward",
    "RewardFn",
    "build_program",
    "code_all_pass",
    "code_pass_fraction",
    "code_shaped",
    "extract_answer",
    "extract_code",
    "get_reward",
    "grade_code",
    "make_code_reward",
    "math_reward",
    "math_reward_fn",
    "parse_number",
]
