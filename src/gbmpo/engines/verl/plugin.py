r"""verl plugin: gbmpo's surrogates as verl policy losses, gbmpo's regularizers as verl's KL loss.

verl (``volcengine/verl``; PyPI ``verl>=0.9,<0.10``) computes the actor loss in
``verl.workers.utils.losses.ppo_loss`` as

.. math::
    \mathcal L = \mathrm{agg}(\ell^{\text{pg}}) - c_H\,\mathrm{agg}(H)
    + \beta\,\mathrm{agg}\big(\mathrm{kl\_penalty}(\log\pi_\theta, \log\pi_{\text{ref}})\big)

with the policy loss picked by name from ``core_algos.POLICY_LOSS_REGISTRY``
(``actor_rollout_ref.actor.policy_loss.loss_mode``), the KL estimator by
``actor_rollout_ref.actor.kl_loss_type`` (a fixed switch in ``core_algos.kl_penalty_forward``),
:math:`\beta` = ``kl_loss_coef`` and ``agg`` = ``core_algos.agg_loss`` with ``loss_agg_mode``.
Since ``agg`` is linear this is gbmpo's :math:`\mathrm{agg}(\omega\,\ell^{\text{surr}} + \beta D)`
(:func:`gbmpo.objectives.compute_policy_loss`). Importing this module

* registers every gbmpo surrogate ``NAME`` (``clip``, ``gspo``, ``atr``, ``divergence_clip``,
  ``rpg_clip``, ``rpg_reinforce`` and any plugin surrogate) as the verl policy loss
  ``gbmpo_NAME``, aggregated by verl's own ``agg_loss`` (so every ``loss_agg_mode``,
  data-parallel scaling and
  ``rollout_is_weights`` behave exactly as in verl's built-in losses);
* wraps ``core_algos.kl_penalty_forward`` (:func:`install_kl_hook`) so that any
  ``kl_loss_type`` starting with ``gbmpo_`` (``gbmpo_prob_l2``, ``gbmpo_neural_mirror``,
  ``gbmpo_kl_k3_is``, ``gbmpo_rpg_ufkl``, ...) is computed by the gbmpo regularizer of that name;
  every other name goes to verl's original function unchanged (``low_var_kl``, ``k3+``, ...).

Loading. The package declares the entry point ``gbmpo = "gbmpo.integrations.verl"`` in verl's
``verl.plugins`` group, which ``import verl`` loads in every process (driver and Ray workers);
verl swallows a plugin's import error at debug level, so this module also logs it as an error.
``VERL_USE_EXTERNAL_MODULES=gbmpo.integrations.verl`` (verl's own switch, errors propagate) and
the ``_target_`` override below (Hydra imports the module to build the config) load it too.

Configuration (Hydra overrides of ``python -m verl.trainer.main_ppo``)::

    actor_rollout_ref.actor.policy_loss._target_=gbmpo.integrations.verl.GBMPOPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=gbmpo_atr
    +actor_rollout_ref.actor.policy_loss.gbmpo_surrogate.delta=0.02
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=gbmpo_neural_mirror
    +actor_rollout_ref.actor.policy_loss.gbmpo_kl.mirror=/abs/path/mirror.json

verl's ``PolicyLossConfig`` is a dataclass that rejects unknown keys, so the extra
hyperparameters live in :class:`GBMPOPolicyLossConfig` (a subclass with the two dicts
``gbmpo_surrogate`` and ``gbmpo_kl``), selected with the ``_target_`` override. Surrogate
parameters default to verl's own fields (:func:`surrogate_params`: ``clip_ratio_low`` /
``clip_ratio_high`` -> ``eps_low`` / ``eps_high``, ``clip_ratio_c`` -> the dual clip, so
``gbmpo_clip`` is verl's ``vanilla``); ``gbmpo_surrogate`` entries override them.
``gbmpo_kl`` holds the regularizer's parameters (``mirror`` path, ``clamp``) and the objective's
``anchor`` (``ref``, the default, or ``old``: the regularizer compares with the rollout policy
instead of verl's reference, RPG's iterative reference); the config installs them process-wide
when it is built (verl's ``kl_penalty`` gets no config).

The objective spec. ``gbmpo train --engine verl`` and ``python -m gbmpo.integrations.verl
--objective FILE`` (:func:`objective_overrides`) pass the whole gbmpo objective spec instead, as
JSON in ``policy_loss.gbmpo_objective``: each process builds it once
(:func:`build_objective`, :meth:`gbmpo.objectives.spec.ObjectiveSpec.build`) into the
``BuiltObjective`` the own engine and TRL's ``GBMPOTrainer`` use, and consumes that object: its
surrogate is the ``gbmpo_<surrogate>`` policy loss, its terms serve ``kl_loss_type=gbmpo_<name>``
(the term of that name: its regularizer object and anchor; verl multiplies by ``kl_loss_coef``)
and ``gbmpo_sum`` (:class:`SumPenalty`: every loss term with its coefficient and anchor).
``gbmpo_surrogate`` / ``gbmpo_kl`` are then refused beside it (the spec holds every parameter).

The rollout log-probs (for ``kl_k3_is``, and as the anchor with ``anchor: old``) come from the
gbmpo policy loss of the same micro-batch (verl calls the policy loss, then ``kl_penalty`` with
the same ``log_prob`` tensor), so they need a ``gbmpo_*`` ``loss_mode`` (``kl_k3_is`` otherwise
falls back to its on-policy form and warns once; ``anchor: old`` raises).

Supported verl: :data:`SUPPORTED_VERL`; :func:`check_verl_internals` fails loudly, naming the
function, if what this module hooks moves: the signatures at import (VerlInternalsError), the
source facts at the first use of a gbmpo name (logged error and warning). The version and the
hooked internals are listed in :mod:`gbmpo.engines.verl.internals`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

try:  # the optional extra: without it, an ImportError naming the extra
    import verl
    from verl.trainer.ppo import core_algos
    from verl.workers.config import PolicyLossConfig
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "gbmpo.integrations.verl needs verl: install the extra with pip install 'gbmpo[verl]' "
        "(supported: verl>=0.9,<0.10; it needs transformers<5.11, so use its own environment, "
        "e.g. bash scripts/install_verl_env.sh)"
    ) from _err

from gbmpo.engines.verl.build import (
    _KL_ANCHOR,
    _OBJECTIVE,
    PREFIX,
    SumPenalty,
    _get,
    _known_surrogate,
    _objective_of,
    _objective_term,
    _split_anchor,
    build_objective,
    build_regularizer,
    build_sum,
    build_surrogate,
    configure_kl,
    current_objective,
    kl_loss_types,
    policy_loss_names,
    surrogate_params,
)
from gbmpo.engines.verl.internals import (
    _SUPPORTED_MAX,
    _SUPPORTED_MIN,
    SUPPORTED_VERL,
    VerlInternalsError,
    _verl_version,
    check_verl_internals,
)
from gbmpo.engines.verl.objective import VERL_SUM, verl_objective_overrides
from gbmpo.objectives.spec import BuiltObjective
from gbmpo.objectives.surrogates import Surrogate
from gbmpo.objectives.tensors import masked_mean

__all__ = [
    "PREFIX",
    "SUPPORTED_VERL",
    "GBMPOPolicyLossConfig",
    "VerlInternalsError",
    "SumPenalty",
    "build_objective",
    "build_regularizer",
    "build_sum",
    "build_surrogate",
    "check_verl_internals",
    "current_objective",
    "describe",
    "configure_kl",
    "gbmpo_kl_penalty",
    "install_kl_hook",
    "kl_loss_types",
    "main",
    "objective_overrides",
    "policy_loss_names",
    "register_policy_losses",
    "surrogate_params",
]

_log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Hand-over of the rollout log-probs from the policy loss to the KL loss of one micro-batch
# --------------------------------------------------------------------------------------------


class _OldLogProbSlot:
    """The ``old_log_prob`` of the last gbmpo policy-loss call, keyed by its ``log_prob`` tensor
    (held weakly), taken once by :func:`gbmpo_kl_penalty` when called on that same tensor."""

    def __init__(self) -> None:
        self._ref: weakref.ref[Tensor] | None = None
        self._old: Tensor | None = None

    def put(self, log_prob: Tensor, old_log_prob: Tensor) -> None:
        self._ref = weakref.ref(log_prob)
        self._old = old_log_prob.detach()

    def take(self, log_prob: Tensor) -> Tensor | None:
        ref, old = self._ref, self._old
        if ref is None or ref() is not log_prob:
            return None
        self._ref = self._old = None
        return old


_OLD = _OldLogProbSlot()
_warned_on_policy = False

#: ``GBMPO_VERL_DUMP_DIR``: a directory where each gbmpo policy-loss and KL call of this process
#: saves its input tensors (``<kind>_<pid>_<n>.pt``), so that a test can recompute the loss with
#: the own engine's functions on exactly the tensors verl trained on; unset: nothing is saved
DUMP_ENV = "GBMPO_VERL_DUMP_DIR"
_dumped: dict[str, int] = {}


def _dump(kind: str, **tensors: Any) -> None:
    where = os.environ.get(DUMP_ENV)
    if not where:
        return
    n = _dumped[kind] = _dumped.get(kind, 0) + 1
    path = os.path.join(where, f"{kind}_{os.getpid()}_{n:04d}.pt")
    os.makedirs(where, exist_ok=True)
    torch.save({k: v.detach().cpu() if isinstance(v, Tensor) else v
                for k, v in tensors.items()}, path)  # fmt: skip
_sources_checked = False


def _check_sources_once() -> None:
    """On the first use of a gbmpo name in a process: the strict (source-text) internals check,
    as a warning naming the function (a text check can raise a false alarm, so it does not stop
    a run; the signature check at import does)."""
    global _sources_checked
    if _sources_checked:
        return
    _sources_checked = True
    try:
        check_verl_internals(strict=True)
    except VerlInternalsError as e:
        _log.error("gbmpo verl plugin: %s", e)
        warnings.warn(str(e), stacklevel=3)


# --------------------------------------------------------------------------------------------
# The policy losses
# --------------------------------------------------------------------------------------------


def _select(loss_mode: str, config: Any) -> tuple[Surrogate, BuiltObjective | None]:
    """The surrogate of ``loss_mode`` under verl's actor ``config`` and the built objective it
    comes from: with ``policy_loss.gbmpo_objective`` that objective's surrogate (the spec holds
    every parameter; ``ValueError`` when ``loss_mode`` names another surrogate), else
    :func:`build_surrogate` (verl's clip fields and ``gbmpo_surrogate``) and None."""
    objective = _objective_of(_get(config, "policy_loss"))
    if objective is None:
        return build_surrogate(loss_mode, config), None
    expected = PREFIX + objective.spec.surrogate.name
    if loss_mode != expected:
        raise ValueError(
            f"policy_loss.loss_mode={loss_mode!r} but policy_loss.gbmpo_objective's surrogate "
            f"is {objective.spec.surrogate.name!r}: set loss_mode={expected}"
        )
    return objective.surrogate, objective


def _make_policy_loss(loss_mode: str) -> Callable[..., tuple[Tensor, dict[str, Any]]]:
    def policy_loss(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        if config is None:
            raise ValueError(f"verl policy loss {loss_mode!r} needs the actor config")
        _check_sources_once()
        surrogate, objective = _select(loss_mode, config)
        configure_kl(_get(_get(config, "policy_loss"), "gbmpo_kl"), objective)
        _OLD.put(log_prob, old_log_prob)
        per_token, diag = surrogate(
            logp=log_prob, old_logp=old_log_prob, advantages=advantages, mask=response_mask
        )
        mask = response_mask.to(torch.bool)
        if rollout_is_weights is not None:
            w = rollout_is_weights.to(per_token.dtype)
            per_token = per_token * torch.where(mask, w, torch.zeros_like(w))
        gbi = dict(_get(config, "global_batch_info") or {})
        loss = core_algos.agg_loss(
            loss_mat=per_token, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **gbi
        )
        _dump("policy_loss", old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
              response_mask=response_mask, loss=loss, loss_agg_mode=loss_agg_mode,
              global_batch_info=gbi)  # fmt: skip
        metrics: dict[str, Any] = {
            # verl's names and meanings: share of tokens where the clip removes the gradient,
            # mean of log(pi_old / pi_theta), share where the dual clip binds
            "actor/pg_clipfrac": float(diag["clip_frac_low"] + diag["clip_frac_high"]),
            "actor/ppo_kl": float(masked_mean(old_log_prob - log_prob, mask)),
            "actor/pg_clipfrac_lower": float(diag["clip_frac_dual"]),
        }
        for k, v in diag.items():
            metrics[f"actor/gbmpo/{k}"] = float(v)
        return loss, metrics

    policy_loss.__name__ = f"compute_policy_loss_{loss_mode}"
    policy_loss.__qualname__ = policy_loss.__name__
    policy_loss.__doc__ = (
        f"verl policy loss {loss_mode!r}: per-token loss of gbmpo's surrogate "
        f"{loss_mode[len(PREFIX) :]!r} (the built objective's, from "
        "policy_loss.gbmpo_objective; else parameters from verl's actor config, "
        "see gbmpo.integrations.verl.surrogate_params), times rollout_is_weights if given, "
        "aggregated by verl's agg_loss(loss_agg_mode, **config.global_batch_info)."
    )
    return policy_loss


def register_policy_losses() -> list[str]:
    """Register every gbmpo surrogate with verl's ``register_policy_loss`` (idempotent)."""
    names = policy_loss_names()
    for loss_mode in names:
        core_algos.register_policy_loss(loss_mode)(_make_policy_loss(loss_mode))
    return names


# --------------------------------------------------------------------------------------------
# The KL hook
# --------------------------------------------------------------------------------------------


def gbmpo_kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """Per-token values of the gbmpo regularizer named by ``kl_penalty`` (``gbmpo_NAME``),
    :math:`D(\\log\\pi_\\theta, \\log\\pi_{\\text{anchor}})` of
    :mod:`gbmpo.objectives.regularizers`: with an objective installed by :func:`configure_kl`
    (``policy_loss.gbmpo_objective``) its term of that name (the built regularizer object and
    its anchor) or, for ``gbmpo_sum``, the sum of its loss terms (:class:`SumPenalty`); else
    the regularizer with the ``gbmpo_kl`` parameters and anchor (``anchor: old``: the rollout
    log-probs instead of ``ref_logprob``). The rollout log-probs come from the gbmpo policy loss
    called on the same ``logprob`` tensor (module doc). float32 (float64 stays float64)."""
    global _warned_on_policy
    _check_sources_once()
    if kl_penalty == PREFIX + VERL_SUM:
        penalty = build_sum()
        old = _OLD.take(logprob)
        if old is None and penalty.needs_old:
            raise ValueError(
                f"kl_loss_type={kl_penalty} with a term anchored at 'old' needs the rollout "
                "log-probs, which only a gbmpo policy loss hands over"
            )
        values = penalty(logp=logprob, ref_logp=ref_logprob, old_logp=old)
        _dump("kl", log_prob=logprob, ref_log_prob=ref_logprob, values=values)
        return values
    objective = _OBJECTIVE[0]
    if objective is not None:
        term = _objective_term(objective, kl_penalty)
        reg, anchor = term.regularizer, term.anchor
    else:
        reg, anchor = build_regularizer(kl_penalty), _KL_ANCHOR[0]
    old = _OLD.take(logprob)
    if old is None and anchor == "old":
        raise ValueError(
            f"kl_loss_type={kl_penalty} with anchor 'old' needs the rollout log-probs, "
            "which only a gbmpo policy loss hands over: set "
            "actor_rollout_ref.actor.policy_loss.loss_mode to one of "
            f"{', '.join(policy_loss_names())}"
        )
    if old is None and getattr(reg, "name", None) == "kl_k3_is" and not _warned_on_policy:
        _warned_on_policy = True
        warnings.warn(
            f"kl_loss_type={kl_penalty} without a gbmpo policy loss: no rollout log-probs, so the "
            "on-policy form w = exp(logp - SG(logp)) is used",
            stacklevel=2,
        )
    ref = old if anchor == "old" else ref_logprob
    values = reg(logp=logprob, old_logp=old, anchor_logp=ref)
    _dump("kl", log_prob=logprob, ref_log_prob=ref_logprob, values=values)
    return values


def install_kl_hook(algos: Any = core_algos) -> None:
    """Wrap ``algos.kl_penalty_forward`` so that names starting with :data:`PREFIX` dispatch to
    :func:`gbmpo_kl_penalty` and all others to verl's original (idempotent). verl's
    ``kl_penalty`` (used for the actor's KL loss and the in-reward KL) looks the function up in
    ``core_algos`` at call time, so a ``+`` suffix keeps verl's straight-through k2 gradient."""
    current = algos.kl_penalty_forward
    if getattr(current, "_gbmpo_hook", False):
        return
    original = current

    def kl_penalty_forward(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
        if isinstance(kl_penalty, str) and kl_penalty.startswith(PREFIX):
            return gbmpo_kl_penalty(logprob, ref_logprob, kl_penalty)
        return original(logprob, ref_logprob, kl_penalty)

    kl_penalty_forward.__wrapped__ = original  # type: ignore[attr-defined]
    kl_penalty_forward._gbmpo_hook = True  # type: ignore[attr-defined]
    kl_penalty_forward.__doc__ = (
        f"gbmpo hook around verl's kl_penalty_forward: {PREFIX}NAME -> gbmpo regularizer NAME; "
        f"otherwise verl's original.\n\n{original.__doc__ or ''}"
    )
    algos.kl_penalty_forward = kl_penalty_forward


# --------------------------------------------------------------------------------------------
# The config class for the extra hyperparameters
# --------------------------------------------------------------------------------------------


@dataclass
class GBMPOPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus gbmpo's hyperparameters; select it with
    ``actor_rollout_ref.actor.policy_loss._target_=gbmpo.integrations.verl.GBMPOPolicyLossConfig``.

    Args:
        gbmpo_surrogate: surrogate parameters overriding those derived from verl's fields
            (:func:`surrogate_params`), e.g. ``{delta: 0.02}`` for ``gbmpo_atr``.
        gbmpo_kl: parameters of the ``gbmpo_*`` ``kl_loss_type``, e.g. ``{mirror: /path.json}``
            for ``gbmpo_neural_mirror``, ``{clamp: 10}``, and the objective's ``{anchor: old}``.
        gbmpo_objective: the whole objective spec as JSON (:func:`objective_overrides`), instead
            of the two above: built once per process (:func:`build_objective`), its surrogate is
            the policy loss and its terms the ``gbmpo_*`` KL loss.

    Built (by verl, in the driver and each worker) it checks a ``gbmpo_*`` ``loss_mode`` against
    the registered surrogates (or the objective's surrogate) and installs ``gbmpo_kl`` or the built
    objective (:func:`configure_kl`)."""

    gbmpo_surrogate: dict[str, Any] = field(default_factory=dict)
    gbmpo_kl: dict[str, Any] = field(default_factory=dict)
    gbmpo_objective: str = ""

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        objective = None
        if isinstance(self.loss_mode, str) and self.loss_mode.startswith(PREFIX):
            _known_surrogate(self.loss_mode)  # unknown name: lists the valid ones
            if self.gbmpo_objective:
                objective = _select(self.loss_mode, {"policy_loss": self})[1]
        elif self.gbmpo_objective:
            raise ValueError(
                f"policy_loss.gbmpo_objective with loss_mode={self.loss_mode!r}: the objective's "
                f"surrogate is a gbmpo policy loss, loss_mode={PREFIX}<surrogate>"
            )
        configure_kl(self.gbmpo_kl, objective)


def describe(config: Any) -> dict[str, Any]:
    """What an instantiated verl actor ``config`` selects from gbmpo, building (and so checking)
    each object: ``{"surrogate": Surrogate | None, "regularizer": Regularizer | SumPenalty |
    None, "anchor": "ref" | "old", "objective": BuiltObjective | None}`` (None where the config
    uses a verl built-in; the regularizer's anchor, for ``gbmpo_sum`` the terms' anchors joined
    by ``+``; the built objective of ``policy_loss.gbmpo_objective``), e.g. to check a composed
    config before a run (the dry-run test of examples/verl does)."""
    loss_mode = _get(_get(config, "policy_loss"), "loss_mode", "vanilla")
    kl_type = _get(config, "kl_loss_type", "")
    surr, objective = (_select(loss_mode, config) if str(loss_mode).startswith(PREFIX)
                       else (None, None))  # fmt: skip
    reg: Any = None
    kl_params = _get(_get(config, "policy_loss"), "gbmpo_kl")
    anchor = _split_anchor(kl_params)[1]
    if _get(config, "use_kl_loss", False) and str(kl_type).startswith(PREFIX):
        base = kl_type[:-1] if kl_type.endswith("+") else kl_type
        if base == PREFIX + VERL_SUM:
            reg = build_sum(objective)
            anchor = "+".join(t.anchor for t in reg.terms)
        elif objective is not None:
            term = _objective_term(objective, base)
            reg, anchor = term.regularizer, term.anchor
        else:
            reg = build_regularizer(base, kl_params)
    return {"surrogate": surr, "regularizer": reg, "anchor": anchor, "objective": objective}


# --------------------------------------------------------------------------------------------
# Import-time wiring
# --------------------------------------------------------------------------------------------


def _install() -> None:
    if not (_SUPPORTED_MIN <= _verl_version() < _SUPPORTED_MAX):
        warnings.warn(
            f"gbmpo.integrations.verl was written for verl{SUPPORTED_VERL}, found verl "
            f"{verl.__version__}; it checks the verl internals it hooks and raises "
            "VerlInternalsError if they moved",
            stacklevel=3,
        )
    try:
        check_verl_internals()
    except VerlInternalsError as e:
        # verl loads "verl.plugins" entry points swallowing errors at debug level: say it loudly
        _log.error("gbmpo verl plugin not loaded: %s", e)
        raise
    register_policy_losses()
    install_kl_hook()


_install()


def objective_overrides(spec: Any, *, max_response_length: int) -> list[str]:
    """The ``main_ppo`` overrides that select the gbmpo objective ``spec`` (an ``ObjectiveSpec``,
    the ``objective:`` dict or a YAML file): see
    :func:`gbmpo.engines.verl.objective.verl_objective_overrides`, the one mapping that
    ``gbmpo train --engine verl`` uses too."""
    return verl_objective_overrides(spec, max_response_length=max_response_length)


def main(argv: list[str] | None = None) -> int:
    """``python -m gbmpo.integrations.verl``: run the strict internals check against the installed
    verl and print the names this plugin serves (exit status 1 if verl's internals moved).
    ``--objective FILE [--max-response-length N]``: print the overrides selecting that objective
    spec instead, one per line (to paste after ``python -m verl.trainer.main_ppo``); a missing or
    bad objective file: one line on stderr, exit status 2."""
    ap = argparse.ArgumentParser(prog="python -m gbmpo.integrations.verl")
    ap.add_argument("--objective", help="gbmpo objective spec (YAML: the section or a config)")
    ap.add_argument("--max-response-length", type=int, default=1024)
    ns = ap.parse_args(argv)
    if ns.objective:
        try:
            lines = objective_overrides(ns.objective, max_response_length=ns.max_response_length)
        except (ValueError, OSError) as err:  # SpecError: a missing or bad file, an unknown name
            print(f"{ap.prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        return 0
    try:
        check_verl_internals(strict=True)
    except VerlInternalsError as e:
        print(f"verl {verl.__version__}: {e}")
        return 1
    print(f"verl {verl.__version__} (supported {SUPPORTED_VERL}): internals check passed")
    print("policy_loss.loss_mode:", ", ".join(policy_loss_names()))
    print("kl_loss_type:", ", ".join(kl_loss_types()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
