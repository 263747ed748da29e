r"""TRL drop-in: :class:`GBMPOConfig` and :class:`GBMPOTrainer`.

Subclasses of TRL's ``GRPOConfig`` / ``GRPOTrainer`` that keep everything TRL does (generation
with HF or vLLM, reward functions, group advantages, accelerate / DeepSpeed / FSDP, PEFT,
logging, checkpoints) and replace only the per-micro-batch loss with gbmpo's objective functions:

.. math::
    \mathcal L = \mathrm{agg}_{\texttt{loss\_type}}\big(\omega_{i,t}\,
    \ell^{\text{surr}}_{i,t} + \lambda\,D(\log\pi_\theta, \log\pi_{\text{anchor}})_{i,t}\big)
    \;-\; c_H\,\bar H \;+\; c_{\text{aux}}\,L_{\text{aux}}

with the surrogate :math:`\ell^{\text{surr}}` chosen by ``clip_mode`` (``ratio``: PPO/DAPO clip,
GSPO when ``importance_sampling_level="sequence"``; ``atr``: ATR-GRPO KL3 trust region;
``divergence``: ATR-GRPO's clip by any policy divergence, ``divergence_clip``; ``rpg_dual``:
RPG-style dual clip), :math:`D` by ``regularizer`` (any name of
:data:`gbmpo.objectives.regularizers.REGULARIZERS`), :math:`\lambda` = ``regularizer_coef``, the
anchor by ``regularizer_anchor`` (the frozen reference, or the rollout policy as in RPG),
:math:`\omega` TRL's token weights (off-policy mask, high-entropy mask, vLLM importance-sampling
ratio; they multiply the surrogate only, as in TRL) and the aggregation by TRL's ``loss_type``.
A term with ``estimator: full`` is the exact divergence over the vocabulary; a term with
``placement: reward`` leaves the loss and is subtracted from the rewards before the advantages.

``beta`` and ``regularizer_coef``: gbmpo's coefficient replaces TRL's ``beta``. Leave
``regularizer_coef`` unset to take ``beta``'s value (so a TRL config with ``beta=0.04`` keeps its
k3 penalty), or set ``regularizer_coef`` and leave ``beta`` at 0 (or equal); two different
non-zero values raise. After validation ``beta`` is rewritten to the value TRL must see:
``regularizer_coef`` when the regularizer is anchored on the reference model (TRL loads that
model and computes its log-probs exactly when ``beta != 0``, whatever the regularizer), else 0.

Supported TRL: ``>=1.16,<1.17`` (the version whose internals this package hooks;
:func:`check_trl_internals` fails loudly, naming the method, if they move).

The names above are this module's API (the public import path); the code is in the TRL engine's
package :mod:`gbmpo.engines.trl`, one module per concern:
:mod:`~gbmpo.engines.trl.config` (``GBMPOConfig``, its checks and the ``beta`` rule),
:mod:`~gbmpo.engines.trl.objective` (TRL's fields -> the objective spec and its
build), :mod:`~gbmpo.engines.trl.trainer` (``GBMPOTrainer``: the loss and the metrics),
:mod:`~gbmpo.engines.trl.formulas` (TRL's normalisers and entropy terms, reproduced),
:mod:`~gbmpo.engines.trl.full` (``estimator: full`` from the logits, the in-reward
penalty and the advantages of the shaped rewards),
:mod:`~gbmpo.engines.trl.fields` (every ``GRPOConfig`` field's answer) and
:mod:`~gbmpo.engines.trl.internals` (the TRL internals hooked and their check).
"""

from __future__ import annotations

try:
    import trl  # noqa: F401
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "gbmpo.integrations.trl needs TRL: install the extra with pip install 'gbmpo[trl]' "
        f"(supported: trl{'>=1.16,<1.17'})"
    ) from _err

from gbmpo.engines.trl.config import GBMPOConfig
from gbmpo.engines.trl.fields import FIELD_STATUSES, TRL_FIELDS, trl_field_status
from gbmpo.engines.trl.formulas import (
    adaptive_entropy_coef,
    dapo_normalizer,
    entropy_bonus,
    window_means,
)
from gbmpo.engines.trl.internals import SUPPORTED_TRL, TRLInternalsError, check_trl_internals
from gbmpo.engines.trl.objective import (
    CLIP_MODES,
    LOSS_TYPE_AGGREGATION,
    LOSS_TYPE_SURROGATES,
    REGULARIZER_ANCHORS,
    build_objective,
    loss_type_surrogate,
    objective_spec,
    spec_from_trl_fields,
)
from gbmpo.engines.trl.trainer import GBMPOTrainer

__all__ = [
    "CLIP_MODES",
    "LOSS_TYPE_AGGREGATION",
    "REGULARIZER_ANCHORS",
    "SUPPORTED_TRL",
    "GBMPOConfig",
    "GBMPOTrainer",
    "TRLInternalsError",
    "build_objective",
    "objective_spec",
    "spec_from_trl_fields",
    "loss_type_surrogate",
    "trl_field_status",
    "FIELD_STATUSES",
    "TRL_FIELDS",
    "LOSS_TYPE_SURROGATES",
    "adaptive_entropy_coef",
    "check_trl_internals",
    "dapo_normalizer",
    "entropy_bonus",
    "window_means",
]
