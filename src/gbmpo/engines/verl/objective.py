r"""The verl overrides of a gbmpo objective: what ``gbmpo train --engine verl`` and
``python -m gbmpo.integrations.verl --objective FILE`` pass to ``verl.trainer.main_ppo`` to select
an objective spec through gbmpo's verl plugin (:func:`verl_objective_overrides`), the spec as
JSON (:func:`verl_objective_json`) and Hydra's value syntax (:func:`hydra_value`). The verl names
of the aggregation and the advantage are verl's table's (:mod:`gbmpo.config.hosts.verl`).

Imports no verl: the engine uses it in the main environment.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gbmpo.config.hosts.verl import VERL_ADV_ESTIMATORS, VERL_LOSS_AGG_MODES, hydra_value
from gbmpo.objectives.spec import ObjectiveSpec

__all__ = ["VERL_POLICY_LOSS_CONFIG", "VERL_SUM", "hydra_value", "verl_objective_json",
           "verl_objective_overrides", "verl_rollout_correction_overrides"]  # fmt: skip


#: the verl policy-loss config class that carries gbmpo's hyperparameters
VERL_POLICY_LOSS_CONFIG = "gbmpo.integrations.verl.GBMPOPolicyLossConfig"


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
    plugin. The spec travels as JSON in ``policy_loss.gbmpo_objective``
    (:func:`verl_objective_json`); the plugin builds it into the engines' one ``BuiltObjective``
    (no parameter comes from verl's clip fields). The rest are verl's switches: advantage ->
    ``algorithm.adv_estimator`` / ``norm_adv_by_std_in_grpo``; surrogate ->
    ``policy_loss.loss_mode=gbmpo_<name>``; regularizer -> ``kl_loss_type=gbmpo_<name>`` with
    ``kl_loss_coef`` (``anchor: old`` for ``rpg_*`` only), or with ``placement: reward``
    ``use_kl_in_reward``, ``kl_penalty=gbmpo_<name>``, a fixed ``kl_ctrl`` with ``kl_coef``;
    aggregation -> ``loss_agg_mode`` (``dr_grpo``: ``loss_scale_factor`` = ``max_response_length``);
    several terms -> one KL loss ``gbmpo_sum`` (:func:`_verl_sum_overrides`). ``ValueError`` names
    what verl cannot express."""
    objective = ObjectiveSpec.load(spec)
    if objective.advantage not in VERL_ADV_ESTIMATORS:
        raise ValueError(
            f"'objective.advantage'={objective.advantage!r} has no verl counterpart; valid with "
            f"engine verl: {', '.join(VERL_ADV_ESTIMATORS)}"
        )
    estimator, norm_std = VERL_ADV_ESTIMATORS[objective.advantage]
    a = "actor_rollout_ref.actor"
    out = [
        f"algorithm.adv_estimator={estimator}",
        f"algorithm.norm_adv_by_std_in_grpo={hydra_value(norm_std)}",
        f"{a}.policy_loss._target_={VERL_POLICY_LOSS_CONFIG}",
        f"{a}.policy_loss.loss_mode=gbmpo_{objective.surrogate.name}",
        f"{a}.loss_agg_mode={VERL_LOSS_AGG_MODES[objective.aggregation]}",
    ]
    if objective.aggregation == "dr_grpo":
        out.append(f"{a}.loss_scale_factor={max_response_length}")
    out += verl_rollout_correction_overrides(objective.rollout_correction)
    objective.build()  # every name and parameter checked here, before verl starts
    if any(t.control is not None for t in objective.terms) and (
        len(objective.terms) > 1 or objective.terms[0].placement != "reward"
    ):
        raise ValueError(
            "'objective.regularizer.control' is supported by engine verl for one term with "
            "placement: reward only (its driver moves the in-reward coefficient between steps); "
            "verl's KL loss coefficient lives in the actor workers, fixed for the run. Use "
            "placement: reward, or engine gbmpo or trl"
        )
    out.append(f"+{a}.policy_loss.gbmpo_objective={hydra_value(verl_objective_json(objective))}")
    if len(objective.terms) > 1:
        return out + _verl_sum_overrides(objective.terms)
    reg = objective.terms[0]
    if reg.estimator == "full":
        raise ValueError(
            "'objective.regularizer.estimator'='full' is not supported by engine verl: its KL "
            "loss and in-reward KL are computed from per-token log-probs (the reference worker "
            "returns log-probs, not logits); use estimator: sample, or engine gbmpo"
        )
    if reg.name == "none" or reg.coef == 0:
        out.append("algorithm.use_kl_in_reward=false")
        if objective.monitor_regularizers:
            # reg/<name> needs the reference's log-probs: verl computes them for a KL loss,
            # here one with coefficient 0 (it adds nothing to the loss)
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
