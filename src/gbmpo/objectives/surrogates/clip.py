"""The ratio clip family: token-level ``clip`` (PPO / GRPO, DAPO clip-higher, dual clip,
ratio cap) and its sequence-level form ``gspo``."""

from __future__ import annotations

import warnings
from dataclasses import InitVar, dataclass
from typing import ClassVar

import torch
from torch import Tensor

from gbmpo.objectives.surrogates.base import (
    _LOG_RATIO_CLAMP,
    SURROGATES,
    _check_clip_params,
    _eps_bounds,
    masked_clip_loss,
    prepare_inputs,
    sequence_log_ratio,
)

__all__ = ["ClipSurrogate", "GSPOSurrogate"]


def _init_ratio_clip(s: ClipSurrogate | GSPOSurrogate, delta: float | None) -> None:
    """``__post_init__`` of :class:`ClipSurrogate` / :class:`GSPOSurrogate`: the deprecated
    ``delta`` becomes ``ratio_cap`` (with a DeprecationWarning), ``eps_high=None`` becomes
    ``eps_low``, then the parameters are checked (errors name ``s.name``)."""
    if delta is not None:
        warnings.warn(
            f"surrogate {s.name!r}: parameter 'delta' is renamed 'ratio_cap' (a cap on the "
            "ratio; 'delta' names a trust-region radius, as in atr); 'delta' will be removed",
            DeprecationWarning,
            stacklevel=4,
        )
        if s.ratio_cap is not None and s.ratio_cap != delta:
            raise ValueError(
                f"{s.name}: give ratio_cap only (delta={delta!r} is its deprecated name, "
                f"ratio_cap={s.ratio_cap!r})"
            )
        object.__setattr__(s, "ratio_cap", delta)
    if s.eps_high is None:
        object.__setattr__(s, "eps_high", s.eps_low)
    _check_clip_params(s.name, s.eps_low, s.eps_high, s.dual_clip_c, s.ratio_cap)


@SURROGATES.register("clip")
@dataclass(frozen=True)
class ClipSurrogate:
    r"""Token-level ratio clip (PPO / GRPO; DAPO clip-higher, arXiv 2503.14476), optional dual
    clip (Ye et al. 2020) and optional ratio cap (TRL's ``delta``; INTELLECT-2 two-sided clip).

    :math:`\ell_{i,t} = -\min(\min(w,\rho_{\text{cap}})A_i,\
    \mathrm{clip}(w, 1-\varepsilon_{\text{low}}, 1+\varepsilon_{\text{high}})A_i)`, then
    :math:`\min(\ell, -cA_i)` for :math:`A_i<0` (see :func:`ppo_clip_loss`; docs/methods.md,
    section "Clipped surrogate").

    Args:
        eps_low: lower clip range, ratio floor ``1 - eps_low``; in [0, 1].
        eps_high: upper clip range (``None``: equal to ``eps_low``); >= 0. DAPO uses 0.28.
        dual_clip_c: dual-clip constant ``c > 1`` (verl default 3; ``None``: off).
        ratio_cap: cap :math:`\rho_{\text{cap}}` on the unclipped ratio (TRL's ``delta``); must
            be ``>= 1 + eps_high``.
        delta: deprecated name of ``ratio_cap`` (DeprecationWarning).
    """

    eps_low: float = 0.2
    eps_high: float | None = None
    dual_clip_c: float | None = None
    ratio_cap: float | None = None
    delta: InitVar[float | None] = None
    name: ClassVar[str] = "clip"

    def __post_init__(self, delta: float | None) -> None:
        _init_ratio_clip(self, delta)

    @property
    def bounds(self) -> tuple[float, float]:
        return _eps_bounds(self.eps_low, self.eps_high)

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        _, log_ratio, adv, m = prepare_inputs(logp, old_logp, advantages, mask)
        low, high = self.bounds
        return masked_clip_loss(
            torch.exp(log_ratio), adv, m, low, high, self.dual_clip_c, self.ratio_cap
        )


@SURROGATES.register("gspo")
@dataclass(frozen=True)
class GSPOSurrogate:
    r"""GSPO: the clip of :class:`ClipSurrogate` applied to the sequence ratio
    :math:`s_i = \exp(\frac{1}{|o_i|}\sum_t m_{i,t}\log w_{i,t})` (Zheng et al. 2025,
    arXiv 2507.18071; TRL ``importance_sampling_level="sequence"``; docs/methods.md, section
    "GSPO"), broadcast to every token of completion ``i``.

    Inside the trust region each token's log-prob receives :math:`-A_i s_i/|o_i|` (TRL's
    broadcast form; verl's "GSPO-token" form has the same value and total gradient). ``grpo``
    aggregation gives GSPO's :math:`\frac1B\sum_i \min(s_iA_i, \mathrm{clip}(s_i)A_i)`;
    token-sum modes weight each sequence by its length. Diagnostics are over tokens.

    Args:
        eps_low, eps_high: clip ranges; defaults 3e-4 / 4e-4 as reported for GSPO
            (docs/methods.md, section "GSPO"); ``eps_high=None`` means equal to ``eps_low``.
        dual_clip_c: dual clip on the sequence ratio (``None``: off).
        ratio_cap: cap on the unclipped sequence ratio (TRL's ``delta``).
        delta: deprecated name of ``ratio_cap`` (DeprecationWarning).
    """

    eps_low: float = 3e-4
    eps_high: float | None = 4e-4
    dual_clip_c: float | None = None
    ratio_cap: float | None = None
    delta: InitVar[float | None] = None
    name: ClassVar[str] = "gspo"

    def __post_init__(self, delta: float | None) -> None:
        _init_ratio_clip(self, delta)

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        _, log_ratio, adv, m = prepare_inputs(logp, old_logp, advantages, mask)
        seq = sequence_log_ratio(log_ratio, m).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        ratio = torch.exp(seq).expand_as(log_ratio)
        low, high = _eps_bounds(self.eps_low, self.eps_high)
        return masked_clip_loss(ratio, adv, m, low, high, self.dual_clip_c, self.ratio_cap)
