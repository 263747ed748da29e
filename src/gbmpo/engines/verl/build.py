"""The gbmpo objects of verl's actor config (:mod:`gbmpo.engines.verl.plugin`'s building half):
a surrogate per ``loss_mode``, the objective of ``policy_loss.gbmpo_objective`` built once per
process, the regularizer of a ``gbmpo_*`` KL loss type with its ``gbmpo_kl`` parameters, and the
sum of several terms (:class:`SumPenalty`). Imported in verl's environment only (through the
plugin and the driver hooks)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf  # ships with verl
from torch import Tensor

from gbmpo.engines.hosts import clip_params
from gbmpo.engines.verl.objective import VERL_SUM
from gbmpo.objectives.regularizers import REGULARIZERS, Regularizer, get_regularizer
from gbmpo.objectives.spec import BuiltObjective, BuiltTerm, ObjectiveSpec
from gbmpo.objectives.surrogates import SURROGATES, Surrogate, get_surrogate

__all__ = ["PREFIX", "SumPenalty", "build_objective", "build_regularizer", "build_sum",
           "build_surrogate", "configure_kl", "current_objective", "kl_loss_types",
           "policy_loss_names", "surrogate_params"]

_log = logging.getLogger(__name__)

#: Prefix of gbmpo's names in verl (``loss_mode=gbmpo_atr``, ``kl_loss_type=gbmpo_prob_l2``).
PREFIX = "gbmpo_"


def policy_loss_names() -> list[str]:
    """The verl ``loss_mode`` names the plugin registers: ``gbmpo_`` + each surrogate name."""
    return [PREFIX + n for n in SURROGATES.names()]


def kl_loss_types() -> list[str]:
    """The ``kl_loss_type`` names the hook serves: ``gbmpo_`` + each regularizer name (plugin
    regularizers of the ``gbmpo.regularizers`` entry-point group included), and ``gbmpo_sum``
    (:class:`SumPenalty`)."""
    return [PREFIX + n for n in REGULARIZERS.names()] + [PREFIX + VERL_SUM]



# --------------------------------------------------------------------------------------------
# Parameters: verl's actor config -> gbmpo objects
# --------------------------------------------------------------------------------------------


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg.key`` for a verl config dataclass, a DictConfig or a dict."""
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _plain(d: Any) -> dict[str, Any]:
    """A DictConfig / Mapping / None as a plain dict (OmegaConf containers resolved)."""
    if d is None:
        return {}
    if isinstance(d, DictConfig):
        return dict(OmegaConf.to_container(d, resolve=True))  # type: ignore[arg-type]
    if not isinstance(d, Mapping):
        raise TypeError(f"expected a mapping of parameters, got {type(d).__name__}: {d!r}")
    return dict(d)


def surrogate_params(name: str, config: Any) -> dict[str, Any]:
    """Parameters of the gbmpo surrogate ``name`` from verl's actor ``config``.

    Defaults from verl's fields (as its built-in losses read them): ``eps_low`` =
    ``clip_ratio_low`` (else ``clip_ratio``), ``eps_high`` = ``clip_ratio_high`` (else
    ``clip_ratio``), the dual-clip constant = ``clip_ratio_c`` (verl's vanilla loss always applies
    it), each taken where the surrogate has a parameter for it (:func:`clip_params`; ``gspo``: no
    dual clip, as verl's). Then every entry of ``policy_loss.gbmpo_surrogate`` overrides (``null``
    turns an optional one off, e.g. ``dual_clip_c: null``)."""
    clip = _get(config, "clip_ratio", 0.2)
    low = _get(config, "clip_ratio_low")
    high = _get(config, "clip_ratio_high")
    low = clip if low is None else low
    high = clip if high is None else high
    c = _get(config, "clip_ratio_c", 3.0)
    dual = None if name == "gspo" else c  # verl's gspo loss applies no dual clip
    params = clip_params(name, eps_low=low, eps_high=high, dual_clip_c=dual)
    params.update(_plain(_get(_get(config, "policy_loss"), "gbmpo_surrogate")))
    return params


def _strip(name: str, what: str) -> str:
    if not isinstance(name, str) or not name.startswith(PREFIX):
        raise ValueError(f"{what} {name!r} is not a gbmpo name (expected {PREFIX}<name>)")
    return name[len(PREFIX) :]


def _known_surrogate(loss_mode: str) -> str:
    """The surrogate name of ``gbmpo_NAME``; ValueError listing the valid loss modes if unknown."""
    name = _strip(loss_mode, "loss_mode")
    if name not in SURROGATES:
        raise ValueError(
            f"policy_loss.loss_mode={loss_mode!r} is not a gbmpo policy loss; valid gbmpo names: "
            f"{', '.join(policy_loss_names())}"
        )
    return name


def _key(name: str, params: Mapping[str, Any]) -> tuple[str, str]:
    return name, repr(sorted(params.items()))


_SURROGATE_CACHE: dict[tuple[str, str], Surrogate] = {}


def build_surrogate(loss_mode: str, config: Any) -> Surrogate:
    """The gbmpo surrogate that ``loss_mode`` (``gbmpo_NAME``) computes under verl's actor
    ``config`` (:func:`surrogate_params`); cached per parameters. Unknown names list the valid
    ones; invalid parameters raise naming the surrogate."""
    name = _known_surrogate(loss_mode)
    params = surrogate_params(name, config)
    key = _key(name, params)
    if key not in _SURROGATE_CACHE:
        _SURROGATE_CACHE[key] = get_surrogate(name, **params)
    return _SURROGATE_CACHE[key]


#: Regularizer parameters installed by :func:`configure_kl` (``policy_loss.gbmpo_kl``).
_KL_PARAMS: dict[str, Any] = {}
#: the objective's anchor installed by :func:`configure_kl` (``gbmpo_kl.anchor``: ref | old)
_KL_ANCHOR: list[str] = ["ref"]
#: the objective installed by :func:`configure_kl` (``policy_loss.gbmpo_objective``), or None
_OBJECTIVE: list[BuiltObjective | None] = [None]
_REGULARIZER_CACHE: dict[tuple[str, str], Regularizer] = {}
# regularizers whose default parameters would silently pick something arbitrary
_REQUIRED_KL_PARAMS: dict[str, str] = {"neural_mirror": "mirror"}
#: every objective built in this process, by its spec's JSON text
_OBJECTIVE_CACHE: dict[str, BuiltObjective] = {}


def build_objective(spec: str | Mapping[str, Any]) -> BuiltObjective:
    """The :class:`~gbmpo.objectives.spec.BuiltObjective` of ``policy_loss.gbmpo_objective``
    (the objective spec as JSON text, as :func:`objective_overrides` writes it, or a mapping):
    :meth:`ObjectiveSpec.build`, the one parse and build the own engine and ``GBMPOTrainer`` do,
    done once per process and spec (cached by the JSON text). Errors name the key
    (``objective.surrogate.params``, ...)."""
    if isinstance(spec, str):
        text = spec
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"policy_loss.gbmpo_objective is not the JSON of an objective spec: {err}"
            ) from None
    else:
        data = _plain(spec)
        text = json.dumps(data, sort_keys=True, default=str)
    if text not in _OBJECTIVE_CACHE:
        _OBJECTIVE_CACHE[text] = ObjectiveSpec.from_dict(data).build()
    return _OBJECTIVE_CACHE[text]


def _objective_of(policy_loss_cfg: Any) -> BuiltObjective | None:
    """The built objective that a ``policy_loss`` config names (``gbmpo_objective``), or None;
    ``ValueError`` when it also gives per-name parameters (``gbmpo_surrogate`` or
    ``gbmpo_kl``: the spec holds every parameter, so two sources could disagree)."""
    spec = _get(policy_loss_cfg, "gbmpo_objective")
    if not spec:
        return None
    for key in ("gbmpo_surrogate", "gbmpo_kl"):
        if _plain(_get(policy_loss_cfg, key)):
            raise ValueError(
                f"policy_loss.{key} beside policy_loss.gbmpo_objective: the objective spec holds "
                f"every parameter; give one of the two ({key} only for a hand-written "
                "loss_mode / kl_loss_type)"
            )
    return build_objective(spec)


def current_objective() -> BuiltObjective | None:
    """The objective installed in this process by :func:`configure_kl` (None: the per-name
    ``gbmpo_kl`` parameters apply)."""
    return _OBJECTIVE[0]


def configure_kl(params: Mapping[str, Any] | None,
                 objective: BuiltObjective | None = None) -> None:  # fmt: skip
    """Install the parameters of the ``gbmpo_*`` KL loss in this process (verl's ``kl_penalty``
    receives no config): the per-name ``gbmpo_kl`` ``params`` (``anchor`` is the objective's
    anchor, not a regularizer parameter) or the built ``objective`` of ``gbmpo_objective``, whose
    terms then serve the KL loss (None: none; ``configure_kl({})`` resets both).
    :class:`GBMPOPolicyLossConfig` calls it when verl builds the actor config (driver and each
    worker) and every gbmpo policy loss on each call."""
    new, _KL_ANCHOR[0] = _split_anchor(params)
    if new != _KL_PARAMS:
        _KL_PARAMS.clear()
        _KL_PARAMS.update(new)
    _OBJECTIVE[0] = objective


def _split_anchor(params: Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    """``gbmpo_kl`` as (the regularizer's parameters, the objective's anchor)."""
    p = _plain(params)
    anchor = p.pop("anchor", "ref")
    if anchor not in ("ref", "old"):
        raise ValueError(
            f"policy_loss.gbmpo_kl.anchor must be 'ref' or 'old', got {anchor!r}"
        )
    return p, str(anchor)


def build_regularizer(kl_loss_type: str, params: Mapping[str, Any] | None = None) -> Regularizer:
    """The gbmpo regularizer that ``kl_loss_type`` (``gbmpo_NAME``) computes, with ``params``
    (default: those of :func:`configure_kl`); cached per parameters. ``neural_mirror`` requires
    ``mirror`` (a path to a saved :class:`~gbmpo.objectives.NeuralMirrorMap`) rather than falling
    back to a random map."""
    name = _strip(kl_loss_type, "kl_loss_type")
    if name not in REGULARIZERS:
        raise ValueError(
            f"actor.kl_loss_type={kl_loss_type!r} is not a gbmpo regularizer; valid gbmpo "
            f"names: {', '.join(kl_loss_types())} (or one of verl's: kl, abs, mse, low_var_kl, "
            "k1, k2, k3, optionally with a '+' suffix)"
        )
    p = dict(_KL_PARAMS) if params is None else _split_anchor(params)[0]
    required = _REQUIRED_KL_PARAMS.get(name)
    if required is not None and p.get(required) is None:
        raise ValueError(
            f"kl_loss_type={kl_loss_type} needs {required!r}: set "
            f"+actor_rollout_ref.actor.policy_loss.gbmpo_kl.{required}=... with "
            "actor_rollout_ref.actor.policy_loss._target_="
            "gbmpo.integrations.verl.GBMPOPolicyLossConfig"
        )
    key = _key(name, p)
    if key not in _REGULARIZER_CACHE:
        _REGULARIZER_CACHE[key] = get_regularizer(name, **p)
    return _REGULARIZER_CACHE[key]


def _objective_term(objective: BuiltObjective, kl_loss_type: str) -> BuiltTerm:
    """The term of ``objective`` that ``kl_loss_type`` (``gbmpo_NAME``) names; ``ValueError``
    listing the objective's terms when it has none of that name."""
    name = _strip(kl_loss_type, "kl_loss_type")
    for t in objective.terms:
        if t.name == name:
            return t
    raise ValueError(
        f"kl_loss_type={kl_loss_type} is not a term of the objective in "
        f"policy_loss.gbmpo_objective (its terms: {', '.join(t.name for t in objective.terms)}; "
        f"a list of terms is kl_loss_type={PREFIX}{VERL_SUM})"
    )


class SumPenalty:
    r"""The terms of a built objective placed in the loss as one verl KL loss
    (``kl_loss_type=gbmpo_sum``, ``kl_loss_coef=1``): per token

    .. math:: \sum_k \lambda_k\, D_k(\log\pi_\theta, \log\pi_{\text{anchor}_k})

    with each :class:`~gbmpo.objectives.spec.BuiltTerm`'s coefficient :math:`\lambda_k`,
    anchor (``ref``: verl's reference log-probs; ``old``: the rollout log-probs handed over by
    the gbmpo policy loss) and regularizer object: the per-token part of the own engine's
    :func:`gbmpo.objectives.compute_policy_loss` with ``terms`` (the aggregation is linear, so
    verl's ``agg(sum)`` is the own ``sum`` of the aggregated terms). Inactive terms (``none``,
    coefficient 0) add nothing and are left out."""

    def __init__(self, terms: tuple[BuiltTerm, ...] | list[BuiltTerm]) -> None:
        self.terms = [t for t in terms if t.active]
        if not self.terms:
            raise ValueError(f"kl_loss_type={PREFIX}{VERL_SUM}: the objective has no active "
                             "term placed in the loss")  # fmt: skip
        self.name = "+".join(t.name for t in self.terms)
        self.needs_old = any(t.anchor == "old" for t in self.terms)

    def __call__(self, *, logp: Tensor, ref_logp: Tensor, old_logp: Tensor | None) -> Tensor:
        out = torch.zeros_like(logp)
        for t in self.terms:
            anchor = old_logp if t.anchor == "old" else ref_logp
            values = t.regularizer(logp=logp, old_logp=old_logp, anchor_logp=anchor)
            out = out + t.coef * values.to(out.dtype)
        return out


def build_sum(objective: BuiltObjective | None = None) -> SumPenalty:
    """The :class:`SumPenalty` of the loss terms of ``objective`` (default: the one installed
    by :func:`configure_kl`). ``ValueError`` without an objective: the
    terms of ``gbmpo_sum`` come from ``policy_loss.gbmpo_objective`` only."""
    obj = _OBJECTIVE[0] if objective is None else objective
    if obj is None:
        raise ValueError(
            f"kl_loss_type={PREFIX}{VERL_SUM} needs the objective spec in "
            "actor_rollout_ref.actor.policy_loss.gbmpo_objective (`python -m "
            "gbmpo.integrations.verl --objective FILE` prints the overrides)"
        )
    return SumPenalty(obj.loss_terms)  # the built objects themselves: nothing to cache


