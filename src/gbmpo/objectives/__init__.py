"""Objectives: advantages, surrogates, regularizers, aggregation (pure torch, selectable by name).

Each family is a :class:`gbmpo.registry.Registry` whose unknown-name error lists the valid names:

* :data:`ADVANTAGES` (:func:`group_advantages`): ``grpo``, ``batch``, ``dr_grpo``, ``rpg``;
* :data:`SURROGATES` (:func:`get_surrogate`): ``clip``, ``gspo``, ``atr``, ``divergence_clip``
  (measures in :mod:`gbmpo.objectives.clip_measures`), ``rpg_clip``, ``rpg_reinforce``;
* :data:`REGULARIZERS` (:func:`get_regularizer`): KL estimators, ProbL2, neural mirror, RPG forms,
  f-divergences (:mod:`gbmpo.objectives.f_divergences`: ``fkl``, ``js``, ``chi2``, ``hellinger``,
  ``tv``, ``alpha``, ``kl_chi2``);
* :data:`AGGREGATIONS` (:func:`aggregate`): ``grpo``, ``bnpo``, ``dr_grpo``,
  ``seq_mean_token_sum``;
* :data:`ROLLOUT_CORRECTIONS` (:func:`correction_weights`): ``none``, ``tis``, ``mis``,
  ``icepop`` (sampler / trainer mismatch, :mod:`gbmpo.objectives.rollout_correction`);
* :data:`POTENTIALS` (:func:`get_potential`): separable potentials for full-vocabulary Bregman
  divergences (:func:`full_vocab_bregman`).

:func:`compute_policy_loss` combines a surrogate, regularizer terms (:class:`LossTerm`) and an
aggregation;
:func:`full_vocab_divergence` evaluates any regularizer's exact full-vocabulary form by name.
"""

from gbmpo.objectives import f_divergences as _f_divergences  # noqa: F401 - registers them
from gbmpo.objectives.advantages import ADVANTAGE_SCALES, ADVANTAGES, group_advantages
from gbmpo.objectives.aggregate import AGGREGATIONS, aggregate
from gbmpo.objectives.estimators import full_vocab_divergence
from gbmpo.objectives.full_vocab import full_vocab_bregman, full_vocab_bregman_from_hidden
from gbmpo.objectives.loss import LossTerm, compiled_policy_loss, compute_policy_loss
from gbmpo.objectives.mirror import NeuralMirrorMap
from gbmpo.objectives.potentials import POTENTIALS, get_potential
from gbmpo.objectives.regularizers import REGULARIZERS, Regularizer, get_regularizer
from gbmpo.objectives.rollout_correction import ROLLOUT_CORRECTIONS, correction_weights
from gbmpo.objectives.surrogates import SURROGATES, Surrogate, atr_bounds, get_surrogate

__all__ = [
    "ADVANTAGES",
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "LossTerm",
    "POTENTIALS",
    "REGULARIZERS",
    "ROLLOUT_CORRECTIONS",
    "SURROGATES",
    "NeuralMirrorMap",
    "Regularizer",
    "Surrogate",
    "aggregate",
    "atr_bounds",
    "compiled_policy_loss",
    "compute_policy_loss",
    "correction_weights",
    "full_vocab_bregman",
    "full_vocab_bregman_from_hidden",
    "full_vocab_divergence",
    "get_potential",
    "get_regularizer",
    "get_surrogate",
    "group_advantages",
]
