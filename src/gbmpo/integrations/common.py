r"""What the TRL drop-in and the verl plugin share: host clip settings -> surrogate parameters,
host loss names <-> the objective spec, and the check of a host library's internals.

Both hosts spell the objective their own way (TRL: ``epsilon`` / ``epsilon_high`` / ``delta`` /
``loss_type`` / ``scale_rewards``; verl: ``clip_ratio_low`` / ``clip_ratio_high`` /
``clip_ratio_c`` / ``loss_agg_mode`` / ``adv_estimator``). The gbmpo objective spec
(:class:`gbmpo.objectives.spec.ObjectiveSpec`) is the one way to name an objective; the host
spellings are aliases mapped here, once:

* :func:`clip_params`: a host's ratio-clip settings -> the parameters of a gbmpo surrogate
  (which of ``eps_low``, ``eps_high``, the dual-clip constant and the ratio cap that surrogate
  takes, under its own parameter names);
* :data:`TRL_LOSS_TYPES` / :data:`VERL_LOSS_AGG_MODES`: aggregation names;
* :data:`TRL_SCALE_REWARDS` / :data:`VERL_ADV_ESTIMATORS`: advantage names.

:func:`check_signatures`, :func:`check_fields` and :func:`check_sources` are the one helper
both integrations use to fail loudly, naming the method, parameter, field or source text, when
a host library's internals that they hook have moved.

Imports neither TRL nor verl: the engines (``gbmpo train --engine trl|verl``) use it in the
main environment.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gbmpo.objectives.spec import ObjectiveSpec

__all__ = [
    "VERL_POLICY_LOSS_CONFIG",
    "hydra_value",
    "verl_objective_json",
    "verl_objective_overrides",
    "TRL_LOSS_TYPES",
    "TRL_SCALE_REWARDS",
    "VERL_ADV_ESTIMATORS",
    "VERL_LOSS_AGG_MODES",
    "VERL_SUM",
    "check_fields",
    "check_signatures",
    "check_sources",
    "clip_params",
]

# --------------------------------------------------------------------------------------------
# Host spellings of the objective
# --------------------------------------------------------------------------------------------

#: gbmpo aggregation -> TRL ``loss_type`` (``bnpo`` is TRL's local token mean; TRL's ``dapo``,
#: the global token mean, is also ``bnpo`` in gbmpo).
TRL_LOSS_TYPES: dict[str, str] = {
    "grpo": "grpo",
    "bnpo": "bnpo",
    "dr_grpo": "dr_grpo",
    "seq_mean_token_sum": "luspo",
}
#: gbmpo advantage -> TRL ``scale_rewards`` (TRL always subtracts the group mean).
TRL_SCALE_REWARDS: dict[str, str] = {
    "grpo": "group",
    "batch": "batch",
    "dr_grpo": "none",
    "rpg": "none",
}
#: gbmpo aggregation -> verl ``actor.loss_agg_mode`` (``dr_grpo`` is verl's
#: ``seq-mean-token-sum-norm`` with ``loss_scale_factor`` = the maximal completion length).
VERL_LOSS_AGG_MODES: dict[str, str] = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "seq_mean_token_sum": "seq-mean-token-sum",
}
#: gbmpo advantage -> verl ``(algorithm.adv_estimator, algorithm.norm_adv_by_std_in_grpo)``;
#: ``batch`` (group mean, batch std) has no verl counterpart.
VERL_ADV_ESTIMATORS: dict[str, tuple[str, bool]] = {
    "grpo": ("grpo", True),
    "dr_grpo": ("grpo", False),
    "rpg": ("grpo", False),
}

#: surrogate -> (its lower-eps, upper-eps, dual-clip and ratio-cap parameter names; None where
#: the surrogate has no such parameter). Plugin surrogates take none of the host's settings.
_CLIP_PARAM_NAMES: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "clip": ("eps_low", "eps_high", "dual_clip_c", "ratio_cap"),
    "gspo": ("eps_low", "eps_high", "dual_clip_c", "ratio_cap"),
    "atr": (None, None, "dual_clip_c", None),
    "divergence_clip": (None, None, "dual_clip_c", None),
    "rpg_clip": ("eps_low", "eps_high", "c", None),
    "rpg_reinforce": ("eps_low", "eps_high", "c", None),
}


def clip_params(
    surrogate: str,
    *,
    eps_low: float | None = None,
    eps_high: float | None = None,
    dual_clip_c: float | None = None,
    ratio_cap: float | None = None,
) -> dict[str, Any]:
    r"""The parameters of gbmpo surrogate ``surrogate`` that a host's ratio-clip settings give.

    A host clips the ratio to :math:`[1-\varepsilon_{\text{low}}, 1+\varepsilon_{\text{high}}]`
    (TRL ``epsilon`` / ``epsilon_high``; verl ``clip_ratio_low`` / ``clip_ratio_high``), may
    apply the dual clip :math:`c` for negative advantages (verl ``clip_ratio_c``) and may cap
    the unclipped ratio at :math:`\rho_{\text{cap}}` (``ratio_cap``; TRL ``delta``). Each
    surrogate takes the settings it has a parameter for, under its own name (``rpg_*`` call the
    dual clip ``c``; ``atr`` and ``divergence_clip`` derive their bounds from their own radius
    and take only the dual clip); settings left at ``None`` are not passed (the surrogate's
    default applies). Unknown (plugin) surrogates get ``{}``.
    """
    names = _CLIP_PARAM_NAMES.get(surrogate)
    if names is None:
        return {}
    out: dict[str, Any] = {}
    for name, value in zip(names, (eps_low, eps_high, dual_clip_c, ratio_cap), strict=True):
        if name is not None and value is not None:
            out[name] = value
    return out


#: the verl policy-loss config class that carries gbmpo's hyperparameters
VERL_POLICY_LOSS_CONFIG = "gbmpo.integrations.verl.GBMPOPolicyLossConfig"


def hydra_value(v: Any) -> str:
    """A Python value as a Hydra command-line override value (strings quoted)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    text = str(v)
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def verl_rollout_correction_overrides(rc: Any) -> list[str]:
    """verl 0.9.1's ``algorithm.rollout_correction`` for ``objective.rollout_correction``: mode
    ``none`` -> ``rollout_is=null`` (verl's default, set explicitly); ``tis`` ->
    ``rollout_is=<level>`` with ``rollout_is_threshold=high`` (a cap: verl's TIS has no lower
    bound); ``mis`` / ``icepop`` -> ``rollout_is_threshold="<low>_<high>"`` (verl's masked IS,
    weights 0 outside the bounds); decoupled mode (weights from verl's recomputed old log-probs
    against vLLM's), no batch normalisation, no rejection sampling, the rollout's log-probs on.
    ``ValueError`` for what verl cannot express (the off-policy sequence mask, ``tis`` with a
    lower bound, ``mis`` without one)."""
    c = "algorithm.rollout_correction"
    if rc.off_policy_mask_threshold is not None:
        raise ValueError(
            "'objective.rollout_correction.off_policy_mask_threshold' is not supported by engine "
            "verl: verl 0.9.1 has no advantage-conditioned off-policy sequence mask"
        )
    if rc.mode == "none":
        return [f"{c}.rollout_is=null", f"{c}.rollout_rs=null"]
    if rc.mode == "tis" and rc.low is not None:
        raise ValueError("'objective.rollout_correction.low' with mode 'tis' is not supported by "
                         "engine verl: its truncated IS is a cap only (leave low null)")
    if rc.mode != "tis" and rc.low is None:
        raise ValueError(f"mode {rc.mode!r} without 'objective.rollout_correction.low' is not "
                         "supported by engine verl: its masked IS needs both bounds")
    threshold = hydra_value(float(rc.high) if rc.mode == "tis" else f"{rc.low!r}_{rc.high!r}")
    return [
        f"{c}.rollout_is={rc.level}",
        f"{c}.rollout_is_threshold={threshold}",
        f"{c}.rollout_is_batch_normalize=false",
        f"{c}.rollout_rs=null",
        f"{c}.bypass_mode=false",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
    ]


def verl_objective_overrides(spec: Any, *, max_response_length: int) -> list[str]:
    """The verl ``main_ppo`` overrides that select the objective ``spec`` (an
    :class:`~gbmpo.objectives.spec.ObjectiveSpec`, a dict or a YAML path) through the gbmpo verl
    plugin. The spec itself travels as JSON in ``policy_loss.gbmpo_objective``
    (:func:`verl_objective_json`), which the plugin builds once per process into the same
    :class:`~gbmpo.objectives.spec.BuiltObjective` the other engines use (its surrogate is the
    policy loss, its terms the KL loss: no parameter comes from verl's clip fields); the rest
    are verl's own switches: advantage -> ``algorithm.adv_estimator`` /
    ``norm_adv_by_std_in_grpo``; surrogate -> ``policy_loss.loss_mode=gbmpo_<name>``;
    regularizer -> the actor KL loss ``kl_loss_type=gbmpo_<name>`` with ``kl_loss_coef`` (the
    spec's ``anchor: old`` for the ``rpg_*`` regularizers only on verl), or with
    ``placement: reward`` verl's in-reward KL (``algorithm.use_kl_in_reward``, ``kl_penalty=
    gbmpo_<name>``, a fixed ``kl_ctrl`` with ``kl_coef``); aggregation -> ``loss_agg_mode``
    (``dr_grpo``: ``loss_scale_factor`` = ``max_response_length``); a list of regularizer terms
    -> one KL loss ``gbmpo_sum`` (:func:`_verl_sum_overrides`). ``ValueError`` names what verl
    cannot express."""
    o = ObjectiveSpec.load(spec)
    if o.advantage not in VERL_ADV_ESTIMATORS:
        raise ValueError(
            f"'objective.advantage'={o.advantage!r} has no verl counterpart; valid with engine "
            f"verl: {', '.join(VERL_ADV_ESTIMATORS)}"
        )
    estimator, norm_std = VERL_ADV_ESTIMATORS[o.advantage]
    a = "actor_rollout_ref.actor"
    out = [
        f"algorithm.adv_estimator={estimator}",
        f"algorithm.norm_adv_by_std_in_grpo={hydra_value(norm_std)}",
        f"{a}.policy_loss._target_={VERL_POLICY_LOSS_CONFIG}",
        f"{a}.policy_loss.loss_mode=gbmpo_{o.surrogate.name}",
        f"{a}.loss_agg_mode={VERL_LOSS_AGG_MODES[o.aggregation]}",
    ]
    if o.aggregation == "dr_grpo":
        out.append(f"{a}.loss_scale_factor={max_response_length}")
    out += verl_rollout_correction_overrides(o.rollout_correction)
    o.build()  # every name and parameter checked here, before verl starts
    if any(t.control is not None for t in o.terms) and (
        len(o.terms) > 1 or o.terms[0].placement != "reward"
    ):
        raise ValueError(
            "'objective.regularizer.control' is supported by engine verl for one term with "
            "placement: reward only (its driver moves the in-reward coefficient between steps); "
            "verl's KL loss coefficient lives in the actor workers, fixed for the run. Use "
            "placement: reward, or engine gbmpo or trl"
        )
    out.append(f"+{a}.policy_loss.gbmpo_objective={hydra_value(verl_objective_json(o))}")
    if len(o.terms) > 1:
        return out + _verl_sum_overrides(o.terms)
    reg = o.terms[0]
    if reg.estimator == "full":
        raise ValueError(
            "'objective.regularizer.estimator'='full' is not supported by engine verl: its KL "
            "loss and in-reward KL are computed from per-token log-probs (the reference worker "
            "returns log-probs, not logits); use estimator: sample, or engine gbmpo"
        )
    if reg.name == "none" or reg.coef == 0:
        out.append("algorithm.use_kl_in_reward=false")
        if o.monitor_regularizers:  # reg/<name> needs the reference's log-probs: verl computes
            # them for a KL loss, here one with coefficient 0 (it adds nothing to the loss)
            return out + [f"{a}.use_kl_loss=true", f"{a}.kl_loss_coef=0.0",
                          f"{a}.kl_loss_type=low_var_kl"]  # fmt: skip
        return out + [f"{a}.use_kl_loss=false"]
    if reg.placement == "advantage":
        raise ValueError(
            "'objective.regularizer.placement'='advantage' is not supported by engine verl: its "
            "driver computes the advantages and has no hook for a per-token penalty after the "
            "normalisation; use placement: reward or loss, or engine gbmpo"
        )
    if reg.placement == "reward":
        if reg.params:
            raise ValueError(
                f"'objective.regularizer.params'={reg.params!r} with placement reward: verl "
                "computes the in-reward KL in its driver, which receives no gbmpo_kl "
                "parameters; use a regularizer without parameters or placement: loss"
            )
        # verl's apply_kl_penalty: token_level_rewards = scores - kl_coef * D(old || ref), per
        # token; the outcome score sits at the last token, so the sequence sum is gbmpo's. A
        # controlled coefficient starts at kl_coef; the driver hooks (verl_driver) move it.
        return out + [
            f"{a}.use_kl_loss=false",
            "algorithm.use_kl_in_reward=true",
            f"algorithm.kl_penalty=gbmpo_{reg.name}",
            "algorithm.kl_ctrl.type=fixed",
            f"algorithm.kl_ctrl.kl_coef={reg.coef!r}",
        ]
    if reg.anchor == "old" and not reg.name.startswith("rpg_"):
        raise ValueError(
            f"'objective.regularizer.anchor'=old with {reg.name!r}: verl's KL loss is "
            "anchored at the reference model; the rollout policy as anchor is offered "
            "there for the rpg_* regularizers only"
        )
    out.append("algorithm.use_kl_in_reward=false")
    out += [f"{a}.use_kl_loss=true", f"{a}.kl_loss_coef={reg.coef!r}",
            f"{a}.kl_loss_type=gbmpo_{reg.name}"]  # fmt: skip
    return out


def verl_objective_json(spec: Any) -> str:
    """The objective ``spec`` (an :class:`~gbmpo.objectives.spec.ObjectiveSpec`, a dict or a
    YAML path) as the JSON text of ``policy_loss.gbmpo_objective``: :meth:`ObjectiveSpec.to_dict`
    with each ``mirror`` parameter as an absolute path (verl's workers run in other
    directories), keys sorted, no spaces. ``ValueError`` for a parameter JSON cannot hold."""
    d = ObjectiveSpec.load(spec).to_dict()
    reg = d["regularizer"]
    for t in reg if isinstance(reg, list) else [reg]:
        if t["params"].get("mirror") is not None:
            t["params"]["mirror"] = str(Path(t["params"]["mirror"]).expanduser().resolve())
    try:
        return json.dumps(d, sort_keys=True, separators=(",", ":"))  # one shell word
    except TypeError as err:
        raise ValueError(f"the objective spec cannot be passed to verl as JSON: {err}") from None


#: the verl KL loss type of a sum of regularizer terms (``kl_loss_type=gbmpo_sum``, the terms in
#: ``policy_loss.gbmpo_kl.terms``); not a regularizer name
VERL_SUM = "sum"


def _verl_sum_overrides(terms: list[Any]) -> list[str]:
    """A list of regularizer terms as one verl KL loss, ``gbmpo_sum`` with ``kl_loss_coef`` 1:
    per token :math:`\\sum_k \\lambda_k D_k(\\pi_\theta, \text{anchor}_k)`, the terms (with
    their coefficients, anchors and parameters) those of the objective in
    ``policy_loss.gbmpo_objective``. ``ValueError`` for what one term alone could not do on
    verl either (``estimator: full``, an ``old`` anchor on a regularizer other than ``rpg_*``)
    and for ``placement: reward`` (verl's in-reward KL is one built-in type without
    parameters)."""
    a = "actor_rollout_ref.actor"
    active = 0
    for t in terms:
        if t.estimator == "full":
            raise ValueError(
                f"'objective.regularizer' term {t.name!r}: estimator 'full' is not supported by "
                "engine verl (per-token log-probs only)"
            )
        if t.name == "none" or t.coef == 0:
            continue
        if t.placement == "reward":
            raise ValueError(
                f"'objective.regularizer' term {t.name!r}: placement reward in a list of terms is "
                "not supported by engine verl (its in-reward KL is one type without parameters)"
            )
        if t.anchor == "old" and not t.name.startswith("rpg_"):
            raise ValueError(
                f"'objective.regularizer.anchor'=old with {t.name!r}: verl's KL loss is anchored "
                "at the reference model; the rollout policy as anchor is offered there for the "
                "rpg_* regularizers only"
            )
        active += 1
    if not active:
        return [f"{a}.use_kl_loss=false", "algorithm.use_kl_in_reward=false"]
    return ["algorithm.use_kl_in_reward=false", f"{a}.use_kl_loss=true", f"{a}.kl_loss_coef=1.0",
            f"{a}.kl_loss_type=gbmpo_{VERL_SUM}"]  # fmt: skip


# --------------------------------------------------------------------------------------------
# The check of a host library's internals
# --------------------------------------------------------------------------------------------


def check_signatures(
    owner: Any,
    methods: Mapping[str, tuple[str, ...]],
    *,
    error: type[Exception],
    context: str,
    static: bool = False,
    owner_name: str | None = None,
) -> None:
    """Raise ``error`` naming the first function of ``methods`` missing from ``owner`` (a class
    or a module) or no longer accepting one of its listed parameters (a subset check: new
    parameters are fine). ``static``: look methods up with ``inspect.getattr_static`` (class
    attributes, unwrapping static/class methods); otherwise ``getattr`` and ``__wrapped__``.
    ``context`` ends each message (host version and what supports it)."""
    label = owner_name or getattr(owner, "__name__", type(owner).__name__)
    for name, params in methods.items():
        if static:
            fn = inspect.getattr_static(owner, name, None)
            if isinstance(fn, (staticmethod, classmethod)):
                fn = fn.__func__
        else:
            fn = getattr(owner, name, None)
        if fn is None or not callable(fn):
            raise error(f"{label}.{name} no longer exists ({context})")
        target = getattr(fn, "__wrapped__", fn)
        try:
            sig = inspect.signature(target)
        except (TypeError, ValueError) as e:  # pragma: no cover - builtins only
            raise error(f"cannot read the signature of {label}.{name}: {e}") from None
        missing = [p for p in params if p not in sig.parameters]
        if missing:
            raise error(
                f"{label}.{name} no longer takes {', '.join(missing)} (signature now {sig}; "
                f"{context})"
            )


def check_fields(
    cls: type, wanted: tuple[str, ...], *, error: type[Exception], context: str
) -> None:
    """Raise ``error`` naming the first of ``wanted`` that is not a field of dataclass ``cls``."""
    names = {f.name for f in dataclasses.fields(cls)}
    for f in wanted:
        if f not in names:
            raise error(f"{cls.__name__} has no field {f!r} any more ({context})")


def check_sources(
    facts: Mapping[str, tuple[Callable[..., Any], tuple[str, ...]]],
    *,
    error: type[Exception],
    context: str,
    flatten_whitespace: bool = False,
) -> None:
    """Raise ``error`` naming the first function (``label -> (function, needles)``) whose source
    lacks one of its needles (text checks: what a hook relies on that a signature cannot
    show). ``flatten_whitespace`` compares with runs of whitespace collapsed."""
    for label, (fn, needles) in facts.items():
        target = getattr(fn, "__wrapped__", fn)
        try:
            src = inspect.getsource(target)
        except (OSError, TypeError) as e:
            raise error(f"cannot read the source of {label}: {e}") from None
        if flatten_whitespace:
            src = " ".join(src.split())
        for needle in needles:
            probe = " ".join(needle.split()) if flatten_whitespace else needle
            if probe not in src:
                raise error(f"{label} no longer contains {needle!r} ({context})")
