"""Clips by a trust-region radius: ``atr`` (the KL3 radius of ATR-GRPO) and
``divergence_clip`` (the ratio kept where a policy divergence stays within ``delta``; the DPPO
measures drop tokens instead), with the measures of :mod:`gbmpo.objectives.clip_measures`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from gbmpo.objectives.clip_measures import (
    CLIP_MEASURE_REGISTRY,
    ClipMeasure,
    atr_bounds,
    dppo_valid_mask,
)
from gbmpo.objectives.mirror import as_mirror_map
from gbmpo.objectives.surrogates.base import (
    SURROGATES,
    _check_dual,
    _finite_number,
    clip_diagnostics,
    masked_clip_loss,
    prepare_inputs,
)

__all__ = ["ATRSurrogate", "DivergenceClipSurrogate", "dppo_loss"]


def _dppo_names() -> list[str]:
    """The registered measures that bring DPPO's loss."""
    return [n for n in CLIP_MEASURE_REGISTRY.names() if CLIP_MEASURE_REGISTRY.get(n).dppo]


def dppo_loss(
    logp: Tensor, ratio: Tensor, adv: Tensor, valid: Tensor, is_cap: float | None
) -> Tensor:
    r"""DPPO per-token loss (Qi et al., "Rethinking the Trust Region in LLM Reinforcement
    Learning", arXiv 2602.04879; verl ``dppo_tv`` / ``dppo_kl``):

    .. math::
        \ell = -A\,\mathrm{SG}\big(\min(w, C)\big)\,M\,\log\pi_\theta,

    with :math:`M` the trust-region mask of
    :func:`~gbmpo.objectives.clip_measures.dppo_valid_mask` and :math:`C` the truncated-importance-
    sampling cap (DPPO §5.4 uses truncation instead of PPO's dual clip; ``None``: no cap). Its
    gradient :math:`-A\min(w, C)M\nabla\log\pi_\theta` is PPO's inside the region (up to the cap)
    and 0 where the mask drops the token.
    """
    w = ratio.detach()
    if is_cap is not None:
        w = w.clamp(max=is_cap)
    return -(adv * w * valid.to(w.dtype)) * logp


@SURROGATES.register("atr")
@dataclass(frozen=True)
class ATRSurrogate:
    r"""ATR-GRPO: the token clip with the KL3 trust-region bounds of :func:`atr_bounds`
    (UCF, arXiv 2602.05494; docs/methods.md, section "ATR-GRPO"), the alias of
    ``divergence_clip(measure="k3", delta=delta)`` (:class:`DivergenceClipSurrogate`, same bits):
    :math:`\ell = -\min(wA, \mathrm{clip}(w, l_\delta, u_\delta)A)`, i.e. the ratio's gradient
    is removed once :math:`w - 1 - \log w > \delta` in the direction the advantage pushes.

    Args:
        delta: KL3 radius ``> 0`` (required: the paper's value was not recovered; 0.0177 /
            0.0231 / 0.0331 reproduce the PPO-0.2 upper / lower and DAPO-0.28 upper bound).
        dual_clip_c: optional dual clip ``c > 1``.
    """

    delta: float
    dual_clip_c: float | None = None
    name: ClassVar[str] = "atr"
    #: :func:`atr_bounds` of ``delta``, solved once (not per call: scipy's Lambert W is not
    #: traced by ``torch.compile``)
    _bounds: tuple[float, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_bounds", atr_bounds(self.delta))
        _check_dual("atr", "dual_clip_c", self.dual_clip_c)

    @property
    def bounds(self) -> tuple[float, float]:
        return self._bounds

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        _, log_ratio, adv, m = prepare_inputs(logp, old_logp, advantages, mask)
        low, high = self.bounds
        return masked_clip_loss(torch.exp(log_ratio), adv, m, low, high, self.dual_clip_c)


@SURROGATES.register("divergence_clip")
@dataclass(frozen=True)
class DivergenceClipSurrogate:
    r"""Clip by any policy divergence: ATR-GRPO's unified clipping framework (arXiv 2602.05494)
    with GBMPO's Bregman divergences (arXiv 2602.04380) as further measures.

    The token ratio :math:`w` is kept in :math:`\{w : f(w) \le \delta\}` of the measure
    :math:`f` (``measure``, :mod:`gbmpo.objectives.clip_measures`, :math:`f(1) = 0`), the
    interval :math:`[l, u]`, and the loss is PPO's clip with these bounds,
    :math:`\ell = -\min(wA, \mathrm{clip}(w, l, u)A)` (:func:`ppo_clip_loss`, dual clip
    optional): the gradient of a token is removed once :math:`f(w) > \delta` in the direction
    its advantage pushes. ``measure="k3"`` is the ``atr`` surrogate (same bits), ``"ratio"``
    with ``delta=eps`` is ``clip``. ``prob_l2`` and ``neural_mirror`` bounds depend on the old
    probability :math:`p = \pi_{\text{old}}(o_t)` (ProbL2: :math:`|w - 1| \le \sqrt\delta / p`).

    DPPO (``dppo_tv``, ``dppo_kl``; Qi et al., arXiv 2602.04879; radii 0.15 and 0.05 in its
    authors' recipe): DPPO's loss :math:`\ell = -A\,\mathrm{SG}(\min(w, C))\,M\log\pi_\theta`
    (:func:`dppo_loss`), the mask :math:`M` dropping the tokens outside the binary-TV / binary-KL
    trust region; ``clip_frac_high`` / ``clip_frac_low`` count masked tokens with
    :math:`A > 0` / :math:`A < 0`, ``clip_frac_dual`` kept tokens the cap :math:`C` truncates.

    Args:
        measure: one of ``ratio`` (:math:`|w-1|`), ``k1`` (:math:`|\log w|`), ``k2``
            (:math:`\frac12\log^2 w`), ``k3`` (:math:`w - 1 - \log w`), ``prob_l2``
            (:math:`(wp - p)^2`), ``neural_mirror`` (:math:`D_h(wp, p)`), ``dppo_tv``
            (:math:`|wp - p|`), ``dppo_kl`` (binary KL).
        delta: radius :math:`\delta > 0` of both sides.
        delta_low, delta_high: per-side radii (override ``delta``): the lower end :math:`l`
            uses ``delta_low``, the upper end :math:`u` uses ``delta_high``.
        dual_clip_c: optional dual clip ``c > 1`` for negative advantages (not with the DPPO
            measures, which truncate the weight instead: ``is_cap``).
        mirror: ``neural_mirror`` only: a :class:`~gbmpo.objectives.mirror.NeuralMirrorMap`, a
            path to a saved map (as the ``neural_mirror`` regularizer takes), or ``None`` for
            ``NeuralMirrorMap.random(0.01, seed=42)``.
        is_cap: DPPO measures only: the cap :math:`C > 1` of the stopped weight
            :math:`\min(w, C)` (verl's ``clip_ratio_c``, 20 by default in its DPPO code; the
            authors' recipe sets 1e4, i.e. off); ``None``: no cap.
    """

    measure: str
    delta: float | None = None
    delta_low: float | None = None
    delta_high: float | None = None
    dual_clip_c: float | None = None
    mirror: Any = None
    is_cap: float | None = None
    name: ClassVar[str] = "divergence_clip"

    def __post_init__(self) -> None:
        cls = self.name
        if not isinstance(self.measure, str) or self.measure not in CLIP_MEASURE_REGISTRY:
            raise ValueError(
                f"{cls}: unknown measure {self.measure!r}; valid: "
                f"{', '.join(CLIP_MEASURE_REGISTRY.names())}"
            )
        spec = CLIP_MEASURE_REGISTRY.get(self.measure)
        object.__setattr__(self, "_spec", spec)
        for key in ("delta", "delta_low", "delta_high"):
            value = getattr(self, key)
            if value is not None and _finite_number(cls, key, value) <= 0:
                raise ValueError(f"{cls}: {key} must be > 0, got {value!r}")
        if self.radii[0] is None or self.radii[1] is None:
            raise ValueError(
                f"{cls}: give delta (both sides) or both delta_low and delta_high; got "
                f"delta={self.delta!r}, delta_low={self.delta_low!r}, "
                f"delta_high={self.delta_high!r}"
            )
        _check_dual(cls, "dual_clip_c", self.dual_clip_c)
        if spec.dppo:
            if self.dual_clip_c is not None:
                raise ValueError(
                    f"{cls}: measure {self.measure!r} (DPPO) truncates the importance weight "
                    "instead of a dual clip: set dual_clip_c=None and use is_cap"
                )
            if self.is_cap is not None and _finite_number(cls, "is_cap", self.is_cap) <= 1.0:
                raise ValueError(f"{cls}: is_cap must be > 1, got {self.is_cap!r}")
        elif self.is_cap is not None:
            raise ValueError(
                f"{cls}: is_cap (DPPO's truncated importance weight) is used only with the "
                f"measures {', '.join(_dppo_names())}, not {self.measure!r}"
            )
        if spec.needs_mirror:
            object.__setattr__(self, "_mirror_map", as_mirror_map(self.mirror))
        elif self.mirror is not None:
            raise ValueError(
                f"{cls}: mirror is used only with measure='neural_mirror', not {self.measure!r}"
            )
        if not spec.per_token:
            self.bounds  # noqa: B018 - computes (and so checks) the interval once

    @property
    def radii(self) -> tuple[float | None, float | None]:
        """``(delta_low, delta_high)`` after defaulting each to ``delta``."""
        lo = self.delta_low if self.delta_low is not None else self.delta
        hi = self.delta_high if self.delta_high is not None else self.delta
        return lo, hi

    @property
    def per_token(self) -> bool:
        """True when the bounds depend on the token's old probability (``prob_l2``,
        ``neural_mirror``)."""
        return bool(self._spec.per_token)  # type: ignore[attr-defined]

    @property
    def bounds(self) -> tuple[float, float]:
        """``(l, u)`` of a measure whose interval is the same for every token."""
        fn = self._spec.bounds  # type: ignore[attr-defined]
        if fn is None:
            raise ValueError(
                f"{self.name}: measure {self.measure!r} has per-token bounds; use "
                "interval(old_logp)"
            )
        # solved once (k3's Lambert W is scipy's, which torch.compile does not trace)
        cached: tuple[float, float] | None = getattr(self, "_bounds", None)
        if cached is None:
            lo, hi = self.radii
            assert lo is not None and hi is not None
            cached = fn(lo, hi)
            object.__setattr__(self, "_bounds", cached)
        return cached

    def interval(self, old_logp: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token ``(l, u)`` (float64, the shape of ``old_logp``) for the tokens whose old
        log-probs are ``old_logp``; constant tensors for the token-independent measures."""
        lo, hi = self.radii
        assert lo is not None and hi is not None
        p_old = torch.exp(old_logp.detach().to(torch.float64))
        spec: ClipMeasure = self._spec  # type: ignore[attr-defined]
        if spec.interval is not None:
            return spec.interval(p_old, lo, hi, getattr(self, "_mirror_map", None))
        low, high = self.bounds
        return torch.full_like(p_old, low), torch.full_like(p_old, high)

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        lp, log_ratio, adv, m = prepare_inputs(logp, old_logp, advantages, mask)
        ratio = torch.exp(log_ratio)
        if self._spec.dppo:  # type: ignore[attr-defined]
            old = torch.where(m, old_logp.detach().to(lp.dtype), 0.0)
            return self._dppo(lp, old, ratio, adv, m)
        if self.per_token:
            old = torch.where(m, old_logp.detach().to(torch.float64), 0.0)
            lo_t, hi_t = self.interval(old)
            low, high = lo_t.to(lp.dtype), hi_t.to(lp.dtype)
        else:
            low, high = self.bounds
        return masked_clip_loss(ratio, adv, m, low, high, self.dual_clip_c)

    def _dppo(
        self, lp: Tensor, old: Tensor, ratio: Tensor, adv: Tensor, m: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """DPPO's loss (:func:`dppo_loss`) and diagnostics; ``old``: 0 where masked."""
        lo, hi = self.radii
        assert lo is not None and hi is not None
        valid = dppo_valid_mask(self.measure, lp, old, adv, lo, hi)
        loss = torch.where(m, dppo_loss(lp, ratio, adv, valid, self.is_cap), 0.0)
        r = ratio.detach()
        dropped = ~valid
        capped = None if self.is_cap is None else valid & (r > self.is_cap)
        return loss, clip_diagnostics(r, m, dropped & (adv < 0), dropped & (adv > 0), capped)
