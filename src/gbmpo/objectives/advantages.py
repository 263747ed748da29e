"""Group-relative advantages for outcome rewards (GRPO family).

Every completion ``i`` of a prompt gets one scalar advantage ``A_i`` that the surrogates broadcast
to all its tokens. Rewards arrive flat, ordered group by group: ``rewards[g * G:(g + 1) * G]`` are
the ``G = group_size`` completions of prompt ``g``.

NaN rewards (a reward function that abstains returns ``None``, which becomes NaN, TRL convention)
are left out of every statistic and get advantage exactly 0, like TRL's nan-aware ``nanmean`` /
``nanstd``. Groups whose valid rewards are all equal (including groups with a single valid reward)
get advantage exactly 0, never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor

from gbmpo.objectives.tensors import compute_dtype
from gbmpo.registry import Registry

__all__ = [
    "ADVANTAGES",
    "ADVANTAGE_SCALES",
    "AdvantageFn",
    "as_reward_tensor",
    "group_advantages",
]

#: The ``scale`` modes of :func:`group_advantages`.
ADVANTAGE_SCALES: tuple[str, ...] = ("group", "batch", "none")

#: ``fn(rewards, group_size, eps=...) -> advantages``.
AdvantageFn = Callable[..., Tensor]

#: Named advantage estimators; each entry is :func:`group_advantages` with ``scale`` fixed.
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")


def as_reward_tensor(rewards: Tensor | Sequence[float | None]) -> Tensor:
    """Return ``rewards`` as a 1-D floating tensor; ``None`` entries become NaN (TRL convention).

    Integer tensors are converted to float32. Infinite rewards are rejected (``ValueError``):
    they are a bug in the reward function, not an abstention.
    """
    if isinstance(rewards, Tensor):
        r = rewards if rewards.is_floating_point() else rewards.to(torch.float32)
    else:
        r = torch.tensor(
            [math.nan if x is None else float(x) for x in rewards], dtype=torch.float32
        )
    if r.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D (one reward per completion), got shape {tuple(r.shape)}"
        )
    if torch.isinf(r).any():
        raise ValueError("rewards contain +/-inf; use None/NaN for an abstaining reward function")
    return r



def _abs_max(x: Tensor, valid: Tensor, dim: int | None) -> Tensor:
    """max |x| over the valid entries (1 where there is none or it is 0): a safe scale."""
    a = torch.where(valid, x.abs(), torch.zeros_like(x))
    m = a.amax(dim, keepdim=True) if dim is not None else a.amax()
    return torch.where(m > 0, m, torch.ones_like(m))


def _unbiased_std_of_centered(c: Tensor, count: Tensor) -> Tensor:
    """sqrt(sum c^2 / (n - 1)) of already-centered values (0 at invalid entries) summed over
    the last dim, or over everything when ``count`` is 0-dim; 0 where n < 2."""
    sq = (c * c).sum(-1, keepdim=True) if count.dim() else (c * c).sum()
    var = sq / (count - 1).clamp_min(1)
    return torch.where(count >= 2, var.sqrt(), torch.zeros_like(var))


def _over(eps: float, scale: Tensor) -> Tensor:
    """``eps / scale`` elementwise as a tensor division (a Python scalar over a tensor is
    computed through the reciprocal, and ``0 * (1 / denormal) = 0 * inf`` is NaN)."""
    return torch.full_like(scale, eps) / scale


def group_advantages(
    rewards: Tensor | Sequence[float | None],
    group_size: int,
    scale: str = "group",
    eps: float = 1e-6,
) -> Tensor:
    r"""Group-relative advantages of flat rewards ``[N]`` ordered group by group (``N`` a
    multiple of ``group_size``), with :math:`\bar r_g` the group's mean of valid rewards:

    * ``group`` (GRPO, Shao et al. 2024): :math:`(r_i - \bar r_g) / (\sigma_g + \epsilon)`,
      :math:`\sigma_g` the unbiased std (verl's and TRL's; TRL's eps 1e-4, verl's 1e-6);
    * ``batch`` (TRL ``scale_rewards="batch"``): the batch's unbiased std instead;
    * ``none`` (Dr. GRPO, Liu et al. 2025): :math:`r_i - \bar r_g`.

    NaN / ``None`` rewards get 0 and are left out of the mean and std; a group whose valid
    rewards are all equal gets 0 everywhere, so the result is finite. float32 (float64 stays).
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(
            f"unknown advantage scale {scale!r}; valid scales: {', '.join(ADVANTAGE_SCALES)}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    r = as_reward_tensor(rewards)
    n = r.numel()
    if n % group_size != 0:
        raise ValueError(
            f"len(rewards)={n} is not divisible by group_size={group_size}; rewards must hold "
            "whole groups, ordered group by group"
        )
    r = r.to(compute_dtype(r))
    g = r.view(-1, group_size)  # [num_groups, G]
    valid = ~torch.isnan(g)
    zero = torch.zeros_like(g)
    count = valid.sum(-1, keepdim=True).to(g.dtype)

    # Statistics are computed on rewards divided by the group's max |r| (values in [-1, 1]),
    # so squares neither overflow nor underflow whatever the reward scale.
    gscale = _abs_max(g, valid, dim=-1)
    u = torch.where(valid, g / gscale, zero)
    cu = torch.where(valid, u - u.sum(-1, keepdim=True) / count.clamp_min(1), zero)

    # A group whose valid rewards are all equal is exactly zero (r - mean can be a rounding
    # residue like 1e-17 otherwise, which the std division would blow up).
    inf = torch.full_like(g, math.inf)
    gmax = torch.where(valid, g, -inf).amax(-1, keepdim=True)
    gmin = torch.where(valid, g, inf).amin(-1, keepdim=True)
    constant = gmax <= gmin  # also true for groups with 0 or 1 valid rewards
    cu = torch.where(constant, zero, cu)  # cu = (r - mean_g) / gscale

    if scale == "group":
        std_u = _unbiased_std_of_centered(cu, count)  # = std_g / gscale
        adv = cu / (std_u + _over(eps, gscale))
    elif scale == "batch":
        bscale = _abs_max(g, valid, dim=None)
        ub = torch.where(valid, g / bscale, zero)
        n_valid = valid.sum().to(g.dtype)
        db = torch.where(valid, ub - ub.sum() / n_valid.clamp_min(1), zero)
        std_b = _unbiased_std_of_centered(db, n_valid)  # = std_batch / bscale
        adv = (cu * (gscale / bscale)) / (std_b + _over(eps, bscale))
    else:
        adv = cu * gscale
    # 0 / (0 + eps=0) would be NaN; those entries are exact zeros by construction.
    adv = torch.where(cu == 0, zero, adv)
    return adv.reshape(n)


ADVANTAGES.register("grpo", partial(group_advantages, scale="group"))
ADVANTAGES.register("batch", partial(group_advantages, scale="batch"))
ADVANTAGES.register("dr_grpo", partial(group_advantages, scale="none"))
# RPG's ``adv_estimator=rpg``: group-mean baseline without std division, i.e. Dr. GRPO.
ADVANTAGES.register("rpg", partial(group_advantages, scale="none"))
