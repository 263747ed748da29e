r"""A controlled regularizer coefficient: the coefficient of one term moves, step by step, so
that a measure of the policy's drift tracks a target (the adaptive KL controller of Ziegler et
al. 2019, arXiv 1909.08593, section 2.2, for any term in any placement).

In the objective spec a term gets a ``control:`` mapping; its ``coef`` is then the coefficient
of the first step::

    regularizer:
      name: prob_l2
      coef: 0.05
      control: {target: 0.02, measure: kl, horizon: 10, min: 1.0e-6, max: 1000.0}

* ``target``: the value the measure should hold (``> 0``);
* ``measure``: ``kl`` (the common drift measure: the token mean of k3,
  :math:`e^{r} - 1 - r` with :math:`r = \log\pi_{ref} - \log\pi_{old}`, on the rollout's
  sampled tokens, against the frozen reference: the ``reg/kl_k3`` every engine logs) or
  ``term`` (the term's own divergence, its sampled-token formula on the rollout against the
  reference: the term's ``reg/<name>``);
* ``horizon``: in steps (RL steps of the own engine, optimizer steps of TRL): with the error
  clipped to :data:`ERROR_CLIP`, the coefficient moves by at most a factor
  :math:`1 \pm 0.2/\text{horizon}` per step;
* ``min`` / ``max``: the coefficient's bounds (default :data:`COEF_MIN`, :data:`COEF_MAX`).

:func:`proportional_coef` is the update; :class:`DriftControl` the setting; the engines hold
the state (the current coefficient), log it as ``drift_coef/<term>`` beside the measure it read
(``drift_measure/<term>``) every step, and save it in their checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = [
    "COEF_MAX",
    "COEF_MIN",
    "ERROR_CLIP",
    "KEYS",
    "MEASURES",
    "DriftControl",
    "proportional_coef",
]

#: the measures a controller can track: the common drift (k3 against the reference) or the
#: term's own divergence
MEASURES: tuple[str, ...] = ("kl", "term")
#: Ziegler et al.'s clip of the proportional error
ERROR_CLIP = 0.2
#: default bounds of a controlled coefficient: positive (a controlled term never switches
#: off, so the loss keeps its terms as built), and far beyond any coefficient the seeds use
COEF_MIN = 1e-6
COEF_MAX = 1e3


def proportional_coef(
    coef: float, measure: float, *, target: float, horizon: float,
    coef_min: float = COEF_MIN, coef_max: float = COEF_MAX,
) -> float:  # fmt: skip
    r"""One step of the proportional controller of Ziegler et al. 2019 (arXiv 1909.08593,
    eq. in section 2.2; verl's ``AdaptiveKLController`` with one step per update):

    .. math::
        e_t = \mathrm{clip}\Big(\frac{m_t - m^*}{m^*}, -0.2, 0.2\Big), \qquad
        \beta_{t+1} = \mathrm{clip}\big(\beta_t\,(1 + e_t / H),\ \beta_{\min}, \beta_{\max}\big)

    with :math:`m_t` the measure of step :math:`t`, :math:`m^*` the target and :math:`H` the
    horizon in steps (Ziegler's :math:`K_\beta = 1/H`). A measure that is not finite leaves
    the coefficient as it is (nothing to correct from); the result is a Python float."""
    if not math.isfinite(measure):
        return coef
    error = min(max((measure - target) / target, -ERROR_CLIP), ERROR_CLIP)
    return min(max(coef * (1.0 + error / horizon), coef_min), coef_max)


class DriftControl(NamedTuple):
    """The setting of one controlled coefficient (see the module docstring); the term's
    ``coef`` is the coefficient of the first step. Build it with :meth:`from_dict`, which
    checks the values."""

    target: float
    measure: str = "kl"
    horizon: float = 10.0
    coef_min: float = COEF_MIN
    coef_max: float = COEF_MAX

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], number: Any) -> DriftControl:
        """From the ``control:`` mapping (keys :data:`KEYS`); ``number(value, key)`` parses a
        float (the spec's rule). ``target`` is required; an unknown key is a ``KeyError``
        naming the valid ones, a bad value a ``ValueError``."""
        unknown = [k for k in d if k not in KEYS]
        if unknown:
            raise KeyError(f"unknown key {unknown[0]!r}; valid keys: {', '.join(KEYS)}")
        if "target" not in d:
            raise KeyError("'target' is required (the value the measure should hold)")
        kw: dict[str, Any] = {"target": number(d["target"], "target")}
        if "measure" in d:
            kw["measure"] = d["measure"]
        for key, name in (("horizon", "horizon"), ("min", "coef_min"), ("max", "coef_max")):
            if key in d:
                kw[name] = number(d[key], key)
        control = cls(**kw)
        control.check()
        return control

    def check(self, coef: float | None = None) -> None:
        """``ValueError`` for a value out of range (and for a first coefficient ``coef``
        outside ``[min, max]``)."""
        for key, v in (("target", self.target), ("horizon", self.horizon),
                       ("min", self.coef_min), ("max", self.coef_max)):  # fmt: skip
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"{key} must be finite and > 0, got {v!r}")
        if self.measure not in MEASURES:
            raise ValueError(f"measure must be one of {', '.join(MEASURES)}, got {self.measure!r}")
        if self.coef_min > self.coef_max:
            raise ValueError(f"min {self.coef_min:g} is above max {self.coef_max:g}")
        if coef is not None and not self.coef_min <= coef <= self.coef_max:
            raise ValueError(
                f"the first coefficient (coef) {coef:g} is outside [min, max] = "
                f"[{self.coef_min:g}, {self.coef_max:g}]"
            )

    def to_dict(self) -> dict[str, Any]:
        """The ``control:`` mapping :meth:`from_dict` reads back."""
        return {"target": self.target, "measure": self.measure, "horizon": self.horizon,
                "min": self.coef_min, "max": self.coef_max}  # fmt: skip

    def monitor(self, term_name: str) -> str:
        """The monitored regularizer (``reg/<name>``) this control reads for the term
        ``term_name``: ``kl_k3`` for ``measure: kl``, the term's own for ``measure: term``."""
        return "kl_k3" if self.measure == "kl" else term_name

    def step(self, coef: float, measure: float) -> float:
        """:func:`proportional_coef` with this control's target, horizon and bounds."""
        return proportional_coef(coef, measure, target=self.target, horizon=self.horizon,
                                 coef_min=self.coef_min, coef_max=self.coef_max)  # fmt: skip


#: the keys of the ``control:`` mapping
KEYS: tuple[str, ...] = ("target", "measure", "horizon", "min", "max")
