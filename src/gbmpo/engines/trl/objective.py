r"""TRL's spelling of an objective -> gbmpo's objective spec (:func:`spec_from_trl_fields`,
:func:`loss_type_surrogate`) and the built objective (:func:`build_objective`), with the
mappings of TRL's ``loss_type`` (:data:`LOSS_TYPE_AGGREGATION`, :data:`LOSS_TYPE_SURROGATES`).
"""

from __future__ import annotations

from typing import Any

from gbmpo.engines.hosts import clip_params
from gbmpo.objectives.spec import BuiltObjective, ObjectiveSpec

__all__ = [
    "TRL_CORRECTION_DEFAULTS",
    "rollout_correction_args",
    "CLIP_MODES",
    "LOSS_TYPE_AGGREGATION",
    "LOSS_TYPE_SURROGATES",
    "REGULARIZER_ANCHORS",
    "build_objective",
    "loss_type_surrogate",
    "objective_spec",
    "check_reward_placement",
    "refuse_advantage_placement",
    "spec_from_trl_fields",
]

#: ``clip_mode`` values.
CLIP_MODES: tuple[str, ...] = ("ratio", "atr", "divergence", "rpg_dual")
#: ``regularizer_anchor`` values.
REGULARIZER_ANCHORS: tuple[str, ...] = ("ref", "old")

#: TRL ``loss_type`` -> gbmpo aggregation mode (:func:`gbmpo.objectives.aggregate`).
#: ``dapo``, ``cispo`` and ``vespo`` are ``bnpo`` over TRL's global token count (see
#: :func:`dapo_normalizer`); ``sapo`` is TRL's sequence mean of token means (``grpo``).
LOSS_TYPE_AGGREGATION: dict[str, str] = {
    "grpo": "grpo",
    "bnpo": "bnpo",
    "dr_grpo": "dr_grpo",
    "dapo": "bnpo",
    "luspo": "seq_mean_token_sum",
    "cispo": "bnpo",
    "sapo": "grpo",
    "vespo": "bnpo",
}
#: TRL loss types whose per-token loss is not TRL's clipped ratio: the gbmpo surrogate that is
#: the same quantity (:func:`loss_type_surrogate` maps TRL's parameters onto it).
LOSS_TYPE_SURROGATES: dict[str, str] = {"cispo": "cispo", "sapo": "sapo", "vespo": "vespo"}



def check_reward_placement(spec: ObjectiveSpec, args: Any) -> None:
    """``placement: reward`` on TRL: GBMPOTrainer subtracts the detached per-sequence penalty
    from the weighted sum of the reward functions before TRL's group advantages
    (:meth:`GBMPOTrainer._generate_and_score_completions`); TRL's other aggregation of several
    reward functions (``normalize_then_sum``, each function normalised before the sum) has no
    single reward to shape and is refused with it."""
    placed = [t.name for t in spec.terms if t.placement == "reward"]
    aggregation = getattr(args, "multi_objective_aggregation", "sum_then_normalize")
    if placed and aggregation != "sum_then_normalize":
        raise ValueError(
            f"GBMPOConfig: objective.regularizer.placement=reward ({', '.join(placed)}) shapes "
            "the summed reward before the advantages; multi_objective_aggregation="
            f"{aggregation!r} normalises each reward function before the sum. Use "
            "multi_objective_aggregation='sum_then_normalize' (TRL's default)"
        )


def refuse_advantage_placement(spec: ObjectiveSpec) -> None:
    """Refuse a regularizer term with ``placement: advantage``: TRL 1.16 computes one advantage
    per sequence inside ``GRPOTrainer._generate_and_score_completions``; the per-token future
    penalty after the normalisation is the own engine's."""
    placed = [t.name for t in spec.terms if t.placement == "advantage"]
    if placed:
        raise ValueError(
            f"GBMPOConfig: objective.regularizer.placement=advantage ({', '.join(placed)}) is "
            "not supported with TRL: GRPOTrainer computes one advantage per sequence in "
            "_generate_and_score_completions; use placement: loss, or the gbmpo engine"
        )


def objective_spec(args: Any) -> ObjectiveSpec:
    """The gbmpo objective spec that ``args`` (a ``GBMPOConfig``) names: its ``objective`` if
    given, else the one its alias fields spell (:func:`spec_from_trl_fields`)."""
    if args.objective is not None:
        return ObjectiveSpec.load(args.objective)
    return spec_from_trl_fields(args)


def loss_type_surrogate(args: Any) -> tuple[str, dict[str, Any]]:
    r"""TRL's non-clip ``loss_type`` -> the gbmpo surrogate that is the same per-token loss and
    its parameters (TRL 1.16 ``GRPOTrainer._compute_loss``):

    * ``cispo``: :math:`-\mathrm{SG}(\min(w, \varepsilon_{\max}))A\log\pi_\theta` with
      :math:`\varepsilon_{\max}` = ``epsilon_high`` (else ``epsilon``) ->
      ``cispo(eps_low=1, eps_high=epsilon_high - 1)`` (weights in
      :math:`[0, \varepsilon_{\max}]`);
    * ``sapo``: :math:`-\frac{4}{\tau}\sigma(\tau(w-1))A` -> ``sapo(tau_pos, tau_neg)`` from
      ``sapo_temperature_pos`` / ``_neg``;
    * ``vespo``: :math:`-\mathrm{SG}(\phi(W))A\log\pi_\theta` -> ``vespo(k_pos, lambda_pos,
      k_neg, lambda_neg)`` from ``vespo_*``.
    """
    name = LOSS_TYPE_SURROGATES[args.loss_type]
    if name == "cispo":
        cap = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        return name, {"eps_low": 1.0, "eps_high": float(cap) - 1.0}
    if name == "sapo":
        return name, {"tau_pos": float(args.sapo_temperature_pos),
                      "tau_neg": float(args.sapo_temperature_neg)}  # fmt: skip
    return name, {
        "k_pos": float(args.vespo_k_pos),
        "lambda_pos": float(args.vespo_lambda_pos),
        "k_neg": float(args.vespo_k_neg),
        "lambda_neg": float(args.vespo_lambda_neg),
    }


def spec_from_trl_fields(args: Any) -> ObjectiveSpec:
    """TRL's spelling of an objective -> the gbmpo objective spec (the alias mapping). Surrogate:
    ``clip_mode="ratio"`` -> ``clip`` (``gspo`` for sequence-level importance sampling) with
    ``eps_low=epsilon``, ``eps_high=epsilon_high or epsilon``, ``delta``, ``dual_clip_c``; ``atr``
    -> ``atr(delta=atr_delta, dual_clip_c)``; ``divergence`` -> ``divergence_clip(measure=
    clip_measure, delta_low=clip_delta, delta_high=clip_delta_high or clip_delta, dual_clip_c,
    mirror=clip_mirror_path)``; ``rpg_dual`` -> ``rpg_clip(variant=rpg_variant, beta=rpg_beta,
    eps_low, eps_high, c=dual_clip_c or 3)`` (through :func:`gbmpo.engines.hosts.clip_params`);
    ``loss_type`` cispo / sapo / vespo -> :func:`loss_type_surrogate`. Regularizer:
    ``regularizer`` with ``regularizer_coef`` (else ``beta``), ``regularizer_anchor``,
    ``regularizer_clamp`` -> ``clamp``, ``mirror_path`` -> ``mirror``. Aggregation from
    ``loss_type`` (:data:`LOSS_TYPE_AGGREGATION`), advantage from ``scale_rewards`` (``group`` ->
    grpo, ``batch`` -> batch, ``none`` -> dr_grpo)."""
    eps_low = float(args.epsilon)
    eps_high = float(args.epsilon_high) if args.epsilon_high is not None else eps_low
    if args.loss_type in LOSS_TYPE_SURROGATES:
        name, params = loss_type_surrogate(args)
    elif args.clip_mode == "ratio":
        name = "gspo" if args.importance_sampling_level == "sequence" else "clip"
        params = clip_params(
            name, eps_low=eps_low, eps_high=eps_high, dual_clip_c=args.dual_clip_c,
            ratio_cap=args.delta,
        )  # fmt: skip
    elif args.clip_mode == "atr":
        name = "atr"
        params = {"delta": args.atr_delta, **clip_params(name, dual_clip_c=args.dual_clip_c)}
    elif args.clip_mode == "divergence":
        name = "divergence_clip"
        high = args.clip_delta_high if args.clip_delta_high is not None else args.clip_delta
        params = {
            "measure": args.clip_measure,
            "delta_low": args.clip_delta,
            "delta_high": high,
            **clip_params(name, dual_clip_c=args.dual_clip_c),
        }
        if args.clip_mirror_path is not None:
            params["mirror"] = args.clip_mirror_path
    else:
        name = "rpg_clip"
        c = 3.0 if args.dual_clip_c is None else args.dual_clip_c
        params = {
            "variant": args.rpg_variant,
            "beta": args.rpg_beta,
            **clip_params(name, eps_low=eps_low, eps_high=eps_high, dual_clip_c=c),
        }
    reg_params: dict[str, Any] = {}
    if args.regularizer_clamp is not None:
        reg_params["clamp"] = args.regularizer_clamp
    if args.regularizer == "neural_mirror":
        reg_params["mirror"] = args.mirror_path
    coef = args.regularizer_coef if args.regularizer_coef is not None else args.beta
    scale = {True: "group", False: "none"}.get(args.scale_rewards, args.scale_rewards)
    advantage = {"group": "grpo", "batch": "batch", "none": "dr_grpo"}.get(scale, "grpo")
    # through the objective section's own parser, so both spellings follow one rule for types
    # and signs (a numeric string "5e-2" is 0.05; a negative coefficient is refused)
    return ObjectiveSpec.from_dict(
        {
            "advantage": advantage,
            "surrogate": {"name": name, "params": params},
            "regularizer": {
                "name": args.regularizer,
                "coef": coef,
                "anchor": args.regularizer_anchor,
                "params": reg_params,
            },
            "aggregation": LOSS_TYPE_AGGREGATION.get(args.loss_type, "bnpo"),
            "monitor_regularizers": bool(args.monitor_regularizers),
        }
    )


def build_objective(args: Any) -> BuiltObjective:
    """The built objective (:meth:`ObjectiveSpec.build`: surrogate, terms with their
    coefficients, aggregation, monitors) that ``args`` (a ``GBMPOConfig``) names
    (:func:`objective_spec`): ``args.objective`` if given, else the alias fields
    (:func:`spec_from_trl_fields`). The spec is built once, when ``args`` is checked; that build
    is returned as is unless a field changed since. GBMPOTrainer uses it as the own engine uses
    its own: the same object, no wrapper."""
    cached = getattr(args, "_built", None)
    if cached is not None and args.objective is not None and cached[0] == args.objective:
        return cached[1]  # the spec as checked (args.objective is its dict): no re-parse
    spec = objective_spec(args)
    return cached[1] if cached is not None and cached[0] == spec.to_dict() else spec.build()


#: TRL 1.16's defaults of the fields :func:`rollout_correction_args` sets
TRL_CORRECTION_DEFAULTS: dict[str, Any] = {
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_min": None,
    "vllm_importance_sampling_clip_max": 3.0,
    "off_policy_mask_threshold": None,
}


def rollout_correction_args(rc: Any) -> dict[str, Any]:
    """The ``GRPOConfig`` fields of ``objective.rollout_correction``: mode ``none`` switches
    TRL's vLLM importance sampling off; ``tis`` is ``<level>_truncate`` and ``mis`` /
    ``icepop`` ``<level>_mask``, with ``low`` / ``high`` as ``vllm_importance_sampling_clip_min``
    / ``_max``; ``off_policy_mask_threshold`` as is."""
    out: dict[str, Any] = {
        "vllm_importance_sampling_correction": rc.mode != "none",
        "off_policy_mask_threshold": rc.off_policy_mask_threshold,
    }
    if rc.mode != "none":
        kind = "truncate" if rc.mode == "tis" else "mask"
        out.update(vllm_importance_sampling_mode=f"{rc.level}_{kind}",
                   vllm_importance_sampling_clip_min=rc.low,
                   vllm_importance_sampling_clip_max=rc.high)  # fmt: skip
    return out
