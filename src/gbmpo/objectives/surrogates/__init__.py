r"""Policy-gradient surrogates: per-token losses built from the importance ratio.

A surrogate is a callable taking keyword arguments only,
``surrogate(logp=, old_logp=, advantages=, mask=) -> (loss [B, T], diagnostics)``:

* ``logp`` ``[B, T]``: log-probs of the sampled tokens under the policy being trained (with grad);
* ``old_logp`` ``[B, T]``: the same under the behaviour policy that sampled them (treated as a
  constant, detached here);
* ``advantages``: ``[B]`` (one per completion, broadcast to its tokens) or ``[B, T]``;
  treated as constants;
* ``mask`` ``[B, T]``: {0, 1} float or bool completion mask.

The loss is 0 at masked positions (and gives no gradient there); aggregation over tokens is a
separate step (:mod:`gbmpo.objectives.aggregate`). Math runs in float32 whatever the input dtype
(float64 inputs stay float64, for gradient checks). The token log-ratio is clamped to
``[-20, 20]`` before ``exp`` (as verl does) so the ratio stays finite.

Diagnostics are detached 0-dim tensors, masked means over valid tokens (0 on an empty mask):
``clip_frac_low`` / ``clip_frac_high`` (tokens whose gradient the lower / upper clip removes),
``clip_frac_dual`` (tokens capped by the dual clip), ``ratio_mean``, ``ratio_min``, ``ratio_max``.

Names (registry :data:`SURROGATES`, built by :func:`get_surrogate`): ``clip``, ``gspo``, ``atr``,
``divergence_clip`` (clip by any policy divergence; ``atr`` is its ``measure="k3"``; the
``dppo_tv`` / ``dppo_kl`` measures give DPPO), ``rpg_clip``, ``rpg_reinforce``, and the baselines
``cispo`` (MiniMax-M1), ``sapo`` (soft gate), ``gmpo`` (geometric mean), ``vespo`` (gamma
weight of the sequence ratio), ``gpg`` (plain REINFORCE) and ``dro`` (REINFORCE with a quadratic
log-ratio penalty; both verl 0.9.1 policy losses).

The package keeps one module per kind of surrogate: :mod:`~gbmpo.objectives.surrogates.clip`
(``clip``, ``gspo``), :mod:`~gbmpo.objectives.surrogates.trust_region` (``atr``,
``divergence_clip``; the measures are in :mod:`gbmpo.objectives.clip_measures`),
:mod:`~gbmpo.objectives.surrogates.rpg` (``rpg_clip``, ``rpg_reinforce``) and
:mod:`~gbmpo.objectives.surrogates.baselines` (``cispo``, ``sapo``, ``gmpo``, ``vespo``, ``gpg``,
``dro``), on the
shared signature, registry, masking and diagnostics of :mod:`~gbmpo.objectives.surrogates.base`.
Importing the package registers them all; this module is their public API.
"""

from __future__ import annotations

from typing import Any

from gbmpo.objectives.clip_measures import atr_bounds
from gbmpo.objectives.surrogates.base import (
    SURROGATES,
    Surrogate,
    ppo_clip_loss,
    sequence_log_ratio,
)
from gbmpo.objectives.surrogates.baselines import (
    CISPOSurrogate,
    DROSurrogate,
    GMPOSurrogate,
    GPGSurrogate,
    SAPOSurrogate,
    VESPOSurrogate,
    cispo_loss,
    gmpo_clipped_log_ratio,
    sapo_gate,
    vespo_weight,
)
from gbmpo.objectives.surrogates.clip import ClipSurrogate, GSPOSurrogate
from gbmpo.objectives.surrogates.rpg import (
    RPG_VARIANTS,
    RPGClipSurrogate,
    RPGReinforceSurrogate,
    rpg_kl_component,
    rpg_regularized_advantage,
    rpg_reinforce_loss,
)
from gbmpo.objectives.surrogates.trust_region import (
    ATRSurrogate,
    DivergenceClipSurrogate,
    dppo_loss,
)

__all__ = [
    "RPG_VARIANTS",
    "SURROGATES",
    "ATRSurrogate",
    "CISPOSurrogate",
    "ClipSurrogate",
    "DROSurrogate",
    "GPGSurrogate",
    "DivergenceClipSurrogate",
    "GMPOSurrogate",
    "GSPOSurrogate",
    "RPGClipSurrogate",
    "RPGReinforceSurrogate",
    "SAPOSurrogate",
    "Surrogate",
    "VESPOSurrogate",
    "atr_bounds",
    "cispo_loss",
    "dppo_loss",
    "get_surrogate",
    "gmpo_clipped_log_ratio",
    "ppo_clip_loss",
    "rpg_kl_component",
    "rpg_regularized_advantage",
    "rpg_reinforce_loss",
    "sapo_gate",
    "sequence_log_ratio",
    "vespo_weight",
]


def get_surrogate(name: str, **params: Any) -> Surrogate:
    """Build the surrogate registered as ``name`` with ``params``.

    Raises :class:`gbmpo.registry.UnknownNameError` (listing valid names) for an unknown name and
    ``TypeError`` naming any parameter the surrogate does not take.
    """
    return SURROGATES.build(name, **params)  # type: ignore[no-any-return]
