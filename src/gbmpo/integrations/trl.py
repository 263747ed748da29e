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

``beta`` and ``regularizer_coef``: gbmpo's coefficient replaces TRL's ``beta``. Leave
``regularizer_coef`` unset to take ``beta``'s value (so a TRL config with ``beta=0.04`` keeps its
k3 penalty), or set ``regularizer_coef`` and leave ``beta`` at 0 (or equal); two different
non-zero values raise. After validation ``beta`` is rewritten to the value TRL must see:
``regularizer_coef`` when the regularizer is anchored on the reference model (TRL loads that
model and computes its log-probs exactly when ``beta != 0``, whatever the regularizer), else 0.

Supported TRL: ``>=1.16,<1.17`` (the version whose internals this module hooks;
:func:`check_trl_internals` fails loudly, naming the method, if they move).

Why one module of ~970 lines: :class:`GBMPOConfig`'s fields (about a third of the file, the
documentation users read in the API reference), the objective built from them and
:class:`GBMPOTrainer`'s overrides of ``GRPOTrainer`` are one contract with one TRL version
(:data:`SUPPORTED_TRL`), checked together by :func:`check_trl_internals`; split over files, a TRL
upgrade would have to be reviewed across them.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "gbmpo.integrations.trl needs TRL: install the extra with pip install 'gbmpo[trl]' "
        f"(supported: trl{'>=1.16,<1.17'})"
    ) from _err

from gbmpo.integrations.common import (
    TRL_LOSS_TYPES,
    TRL_SCALE_REWARDS,
    check_fields,
    check_signatures,
    check_sources,
    clip_params,
)
from gbmpo.objectives.loss import LossTerm, compute_policy_loss
from gbmpo.objectives.regularizers import REGULARIZERS, Regularizer, kl_k3
from gbmpo.objectives.spec import ObjectiveSpec, RegularizerSpec, SurrogateSpec
from gbmpo.objectives.surrogates import SURROGATES, Surrogate
from gbmpo.objectives.tensors import masked_mean

__all__ = [
    "CLIP_MODES",
    "LOSS_TYPE_AGGREGATION",
    "REGULARIZER_ANCHORS",
    "SUPPORTED_TRL",
    "GBMPOConfig",
    "GBMPOTrainer",
    "TRLObjective",
    "TRLInternalsError",
    "build_objective",
    "objective_spec",
    "spec_from_trl_fields",
    "loss_type_surrogate",
    "trl_field_status",
    "TRL_FIELDS",
    "LOSS_TYPE_SURROGATES",
    "adaptive_entropy_coef",
    "check_trl_internals",
    "dapo_normalizer",
    "entropy_bonus",
    "window_means",
]

#: The TRL versions whose internals this module was written against and tested with.
SUPPORTED_TRL = ">=1.16,<1.17"
_SUPPORTED_MIN, _SUPPORTED_MAX = (1, 16), (1, 17)

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
#: Loss types whose TRL normaliser is the generation batch's token count (:func:`dapo_normalizer`).
_GLOBAL_TOKEN_LOSS_TYPES: tuple[str, ...] = ("dapo", "cispo", "vespo")

#: GBMPOConfig's alias fields (TRL's spelling of the objective) and their defaults; with
#: ``objective=`` they must keep these values.
_ALIAS_DEFAULTS: dict[str, Any] = {
    "regularizer": "kl_k3",
    "regularizer_coef": None,
    "regularizer_anchor": "ref",
    "regularizer_clamp": None,
    "mirror_path": None,
    "clip_mode": "ratio",
    "atr_delta": None,
    "dual_clip_c": None,
    "rpg_variant": "none",
    "rpg_beta": 0.0,
}

# Regularizers that take a ``clamp`` parameter.
_CLAMPABLE = ("kl_k3", "kl_k3_is", "rpg_fkl", "rpg_rkl", "rpg_ufkl", "rpg_urkl")

# Multimodal keys that TRL's _compute_loss forwards from ``inputs`` to the log-prob helper.
_FORWARD_KEYS: tuple[str, ...] = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def _trl_version() -> tuple[int, int]:
    parts = str(trl.__version__).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):  # pragma: no cover - malformed version string
        return (0, 0)


if not (_SUPPORTED_MIN <= _trl_version() < _SUPPORTED_MAX):
    warnings.warn(
        f"gbmpo.integrations.trl was written for trl{SUPPORTED_TRL}, found trl {trl.__version__}; "
        "GBMPOTrainer checks the TRL internals it hooks and raises TRLInternalsError if they moved",
        stacklevel=2,
    )


def _quiet_host_warnings() -> None:
    """TRL 1.16 toggles gradient checkpointing around generation through transformers' old
    method names (``is_gradient_checkpointing``, ``gradient_checkpointing_disable`` /
    ``_enable``), which transformers 5 deprecates with a FutureWarning at every toggle's first
    call; they say nothing about the run. One filter for exactly those messages (GBMPOConfig
    itself spells the setting ``activation_checkpointing``)."""
    warnings.filterwarnings(
        "ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated", category=FutureWarning
    )


# --------------------------------------------------------------------------------------------
# Hook checks
# --------------------------------------------------------------------------------------------


class TRLInternalsError(RuntimeError):
    """TRL's internals that GBMPOTrainer hooks have moved (a TRL version outside
    :data:`SUPPORTED_TRL`); the message names the method or attribute."""


#: method -> parameter names it must accept (a subset check: new parameters are fine).
_HOOKED_METHODS: dict[str, tuple[str, ...]] = {
    "compute_loss": ("model", "inputs", "return_outputs", "num_items_in_batch"),
    "_compute_loss": ("model", "inputs"),
    "_get_per_token_logps_and_entropies": (
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
        *_FORWARD_KEYS,
    ),
    "get_high_entropy_mask": ("entropies", "mask", "threshold"),
    "get_off_policy_mask": (
        "advantages",
        "per_token_logps",
        "sampling_per_token_logps",
        "mask",
        "off_policy_threshold",
    ),
    "_generate_and_score_completions": ("inputs",),
    "get_gamma_weights": (
        "advantages",
        "log_ratio_per_token",
        "mask",
        "importance_sampling_ratio",
        "k_pos",
        "lambda_pos",
        "k_neg",
        "lambda_neg",
    ),
}

#: GRPOConfig fields this module reads or rewrites.
_CONFIG_FIELDS: tuple[str, ...] = (
    "beta",
    "loss_type",
    "epsilon",
    "epsilon_high",
    "delta",
    "importance_sampling_level",
    "use_bias_correction_kl",
    "use_adaptive_entropy",
    "entropy_coef",
    "top_entropy_quantile",
    "off_policy_mask_threshold",
    "max_completion_length",
    "steps_per_generation",
    "use_liger_kernel",
    "sync_ref_model",
    "entropy_coef_min",
    "entropy_coef_max",
    "entropy_coef_delta",
    "entropy_target",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
)

#: GRPOTrainer instance attributes read by GBMPOTrainer._compute_loss (checked after __init__).
_TRAINER_ATTRIBUTES: tuple[str, ...] = (
    "beta",
    "ref_model",
    "loss_type",
    "max_completion_length",
    "importance_sampling_level",
    "top_entropy_quantile",
    "off_policy_mask_threshold",
    "use_vllm",
    "vllm_importance_sampling_correction",
    "aux_loss_enabled",
    "router_aux_loss_coef",
    "entropy_coef",
    "_entropy_bonus_enabled",
    "use_adaptive_entropy",
    "_last_world_entropy",
    "_metrics",
    "accelerator",
)

#: Source facts relied upon (checked with ``strict=True``): method -> strings its source has.
_SOURCE_FACTS: dict[str, tuple[str, ...]] = {
    # compute_loss routes to _compute_loss (older TRL routed use_liger_kernel elsewhere)
    "compute_loss": ("self._compute_loss(",),
    # the reference model is built only when beta != 0
    "__init__": ("self.beta = args.beta", "self.ref_model = None"),
    # the batch dict we read, and ref log-probs computed exactly when beta != 0
    "_generate_and_score_completions": (
        "self.beta != 0.0",
        '"prompt_ids"',
        '"prompt_mask"',
        '"completion_ids"',
        '"completion_mask"',
        '"advantages"',
        '"num_items_in_batch"',
        '"old_per_token_logps"',
        '"ref_per_token_logps"',
        '"importance_sampling_ratio"',
        '"sampling_per_token_logps"',
    ),
}


# --------------------------------------------------------------------------------------------
# Every GRPOConfig field's answer in GBMPOTrainer
# --------------------------------------------------------------------------------------------

#: ``honoured``: TRL's code does it and GBMPOTrainer keeps TRL's meaning; ``mapped``: onto the
#: gbmpo objective that is the same quantity; ``refused``: GBMPOConfig raises, saying why.
FIELD_STATUSES: tuple[str, ...] = ("honoured", "mapped", "refused")

_TRL = "TRL's own code (generation, rewards, batching, logging); the loss does not read it"
_VLLM = "TRL's vLLM generation; the loss does not read it"

#: ``trl.GRPOConfig`` field -> (status, how GBMPOTrainer answers it). Fields of
#: ``transformers.TrainingArguments`` without an entry are HF Trainer's, untouched
#: (:func:`trl_field_status`). ``tests/integrations/test_trl_dropin.py`` checks that every field
#: of the installed ``GRPOConfig`` has an answer.
TRL_FIELDS: dict[str, tuple[str, str]] = {
    # --- the loss ------------------------------------------------------------------------
    "beta": ("mapped", "the regularizer's coefficient (regularizer_coef); the default "
             "regularizer kl_k3 is TRL's k3 KL to the reference model"),
    "loss_type": ("mapped", "grpo/bnpo/dr_grpo/dapo/luspo: the aggregation with TRL's "
                  "normalisers; cispo/sapo/vespo: gbmpo's surrogate of that name plus TRL's "
                  "aggregation (LOSS_TYPE_AGGREGATION, LOSS_TYPE_SURROGATES); with "
                  "clip_mode != 'ratio' only the clip loss types (the surrogate is clip_mode's)"),
    "epsilon": ("mapped", "eps_low of the clip / gspo / rpg_clip surrogate"),
    "epsilon_high": ("mapped", "eps_high of the clip surrogate (default epsilon); with "
                     "loss_type='cispo' the weight cap, cispo(eps_low=1, eps_high=epsilon_high-1); "
                     "a cap below 1 is refused (every token's gradient would shrink; TRL's "
                     "recommended cap is 5)"),
    "delta": ("mapped", "ratio_cap of the clip / gspo surrogate; refused where TRL ignores it "
              "(cispo, sapo, vespo, clip_mode other than 'ratio')"),
    "importance_sampling_level": ("mapped", "'sequence' selects the gspo surrogate (GSPO); "
                                  "refused with cispo/sapo/vespo, with clip_mode other than "
                                  "'ratio' and with use_bias_correction_kl (TRL then weights the "
                                  "KL by the sequence ratio; kl_k3_is is token level)"),
    "sapo_temperature_pos": ("mapped", "tau_pos of the sapo surrogate"),
    "sapo_temperature_neg": ("mapped", "tau_neg of the sapo surrogate"),
    "vespo_k_pos": ("mapped", "k_pos of the vespo surrogate"),
    "vespo_lambda_pos": ("mapped", "lambda_pos of the vespo surrogate"),
    "vespo_k_neg": ("mapped", "k_neg of the vespo surrogate"),
    "vespo_lambda_neg": ("mapped", "lambda_neg of the vespo surrogate"),
    "use_bias_correction_kl": ("mapped", "True: regularizer kl_k3 becomes kl_k3_is (k3 times "
                               "the token ratio, TRL's corrected KL); refused with another "
                               "regularizer or objective=. Default False here (TRL: True)"),
    "top_entropy_quantile": ("honoured", "TRL's high-entropy token mask multiplies the "
                             "surrogate and restricts the entropy bonus"),
    "off_policy_mask_threshold": ("honoured", "TRL's off-policy sequence mask multiplies the "
                                  "surrogate"),
    "entropy_coef": ("honoured", "TRL's entropy bonus, -entropy_coef * mean token entropy"),
    "use_adaptive_entropy": ("honoured", "TRL's adaptive entropy coefficient "
                             "(adaptive_entropy_coef), state kept in checkpoints as TRL does"),
    "entropy_coef_min": ("honoured", "lower bound of the adaptive entropy coefficient"),
    "entropy_coef_max": ("honoured", "upper bound of the adaptive entropy coefficient"),
    "entropy_coef_delta": ("honoured", "step of the adaptive entropy coefficient"),
    "entropy_target": ("honoured", "entropy target of the adaptive entropy coefficient"),
    "router_aux_loss_coef": ("honoured", "MoE router auxiliary loss added as TRL does"),
    "max_completion_length": ("honoured", "generation length; dr_grpo's normaliser"),
    "steps_per_generation": ("honoured", "TRL's batching; dapo/cispo/vespo normaliser"),
    "vllm_importance_sampling_correction": ("honoured", "the ratio multiplies the surrogate "
                                            "only, as TRL; refused with loss_type='vespo' "
                                            "(TRL folds it into VESPO's sequence weight, which "
                                            "gbmpo's vespo surrogate does not take)"),
    "scale_rewards": ("honoured", "TRL's advantage normalisation (the objective spec's "
                      "advantage: group -> grpo, batch -> batch, none -> dr_grpo)"),
    "sync_ref_model": ("honoured", "TRL's reference sync; refused when no reference model "
                       "is used (the regularizer is not anchored on it)"),
    "ref_model_mixup_alpha": ("honoured", "TRL's reference sync"),
    "ref_model_sync_steps": ("honoured", "TRL's reference sync"),
    "num_iterations": ("honoured", "TRL's updates per generation (old log-probs)"),
    # --- generation, rewards, data, logging: TRL's code, not the loss --------------------
    **{name: ("honoured", _TRL) for name in (
        "model_init_kwargs", "trust_remote_code", "disable_dropout", "cast_lm_head_to_fp32",
        "num_generations", "num_generations_eval", "ds3_gather_for_generation",
        "shuffle_dataset", "pad_to_multiple_of", "generation_batch_size", "temperature",
        "top_p", "top_k", "min_p", "generation_kwargs", "chat_template_kwargs",
        "repetition_penalty", "cache_implementation", "reward_weights",
        "multi_objective_aggregation", "mask_truncated_completions",
        "max_tool_calling_iterations", "log_completions", "log_multimodal",
        "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo",
        "use_transformers_continuous_batching", "transformers_continuous_batching_config",
        "use_transformers_paged", "remove_unused_columns", "learning_rate", "logging_steps",
        "bf16", "lr_scheduler_kwargs",
    )},
    **{name: ("honoured", _VLLM) for name in (
        "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode",
        "vllm_structured_outputs_regex", "vllm_server_base_url", "vllm_server_host",
        "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
        "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
        "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap",
    )},
    # --- TrainingArguments fields that TRL / GBMPOConfig treat specially ------------------
    "gradient_checkpointing": ("honoured", "HF Trainer's; GBMPOConfig passes it on as "
                               "transformers 5's activation_checkpointing"),
    "use_liger_kernel": ("honoured", "TRL applies Liger's layer kernels when the trainer is "
                         "built (deprecated there; needs liger-kernel installed); the loss stays "
                         "gbmpo's"),
    "liger_kernel_config": ("honoured", "TRL's Liger layer-kernel settings (TRL refuses "
                            "fused_linear_cross_entropy)"),
}  # fmt: skip

_TRAINING_ARGUMENT = ("honoured", "transformers.TrainingArguments field: HF Trainer's meaning, "
                      "untouched by GBMPOTrainer")  # fmt: skip


def trl_field_status(name: str) -> tuple[str, str]:
    """``(status, how)`` of ``GRPOConfig`` field ``name`` in GBMPOTrainer (:data:`TRL_FIELDS`;
    a ``transformers.TrainingArguments`` field without an entry is HF Trainer's, untouched).
    Raises ``KeyError`` for a field without an answer (a newer TRL's new field)."""
    if name in TRL_FIELDS:
        return TRL_FIELDS[name]
    from dataclasses import fields

    from transformers import TrainingArguments

    if name in {f.name for f in fields(TrainingArguments)}:
        return _TRAINING_ARGUMENT
    raise KeyError(
        f"GRPOConfig field {name!r} has no answer in GBMPOTrainer (TRL {trl.__version__}; "
        f"supported: trl{SUPPORTED_TRL})"
    )


def check_trl_internals(
    trainer_cls: type = GRPOTrainer, config_cls: type = GRPOConfig, *, strict: bool = False
) -> None:
    """Raise :class:`TRLInternalsError` naming the first TRL method, parameter or config field
    that GBMPOTrainer relies on and that is missing from ``trainer_cls`` / ``config_cls``.

    Always checked: the hooked methods exist and accept the parameters we pass; the config
    fields exist. With ``strict=True`` also the source facts of :data:`_SOURCE_FACTS` (that
    ``compute_loss`` routes to ``_compute_loss``, that ``beta != 0`` gates the reference model and
    its log-probs, and the keys of the batch dict); those are text checks, so the trainer runs
    them only in the test-suite, where a false alarm costs nothing.
    """
    context = f"TRL {trl.__version__}; GBMPOTrainer hooks it and supports trl{SUPPORTED_TRL}"
    check_signatures(
        trainer_cls, _HOOKED_METHODS, error=TRLInternalsError, context=context, static=True
    )
    check_fields(config_cls, _CONFIG_FIELDS, error=TRLInternalsError, context=context)
    if not strict:
        return
    facts = {
        f"{trainer_cls.__name__}.{name}": (getattr(trainer_cls, name), needles)
        for name, needles in _SOURCE_FACTS.items()
    }
    check_sources(facts, error=TRLInternalsError, context=context)


# --------------------------------------------------------------------------------------------
# Small pure helpers (TRL's normalisers and entropy bonus, reproduced)
# --------------------------------------------------------------------------------------------


def dapo_normalizer(
    num_items_in_batch: Tensor | float,
    *,
    num_processes: int,
    accumulation_steps: int,
    steps_per_generation: int,
    training: bool,
) -> Tensor:
    r"""TRL ``loss_type="dapo"`` denominator of one micro-batch's token-sum loss:

    .. math::
        Z = \frac{\max(1, N_{\text{tok}})}{P}\cdot\frac{G_{\text{acc}}}{S_{\text{gen}}}

    with :math:`N_{\text{tok}}` the valid tokens of the whole generation batch over all
    processes (``num_items_in_batch``), :math:`P` processes, :math:`G_{\text{acc}}` the current
    gradient-accumulation steps and :math:`S_{\text{gen}}` ``steps_per_generation`` (the last
    factor only in training; TRL 1.16 ``GRPOTrainer._compute_loss``). Summing
    :math:`\sum_{i,t} m\ell / Z` over the micro-batches of one optimizer step gives the global
    token mean (DAPO, arXiv 2503.14476), whatever the split across processes. GBMPOTrainer
    passes :math:`Z` to :func:`gbmpo.objectives.aggregate` as ``num_tokens``; it can be below the
    local micro-batch's token count (a process holding more than its share of the tokens).
    """
    n = torch.as_tensor(num_items_in_batch, dtype=torch.float32).clamp(min=1.0)
    z = n / num_processes
    if training:
        z = z * accumulation_steps / steps_per_generation
    return z


def entropy_bonus(entropies: Tensor, mask: Tensor, accumulation_steps: int) -> Tensor:
    r"""TRL's entropy term (the loss gets :math:`-c_H` times this): the mean per-token entropy
    over ``mask``, divided by the gradient-accumulation steps,

    .. math::
        \bar H = \frac{\sum_{i,t} m_{i,t} H_{i,t}}{\max(1, \sum_{i,t} m_{i,t})\,G_{\text{acc}}}

    (TRL ``entropy_coef``; independent of the loss type's normaliser).
    """
    m = mask.to(entropies.dtype)
    return (entropies * m).sum() / m.sum().clamp(min=1.0) / accumulation_steps


def adaptive_entropy_coef(
    coef: float,
    entropy: float,
    *,
    target: float,
    delta: float,
    coef_min: float,
    coef_max: float,
) -> float:
    r"""Adaptive entropy control (Skywork-OR1, arXiv 2505.22312, section 4; TRL
    ``use_adaptive_entropy``): after each optimizer step, with :math:`\bar H` the token-mean
    entropy of its accumulation window over all processes,

    .. math::
        c_H \leftarrow \begin{cases} \min(c_H + \delta, c_{\max}) & \bar H \le H^* \\
        \max(c_H - \delta, c_{\min}) & \bar H > H^* \end{cases}

    The next window's loss applies :math:`c_H` only while :math:`\bar H \le H^*`
    (``entropy_target``), else 0 (:meth:`GBMPOTrainer._entropy_term`)."""
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


def window_means(metrics: dict[str, list[float]], token_weights: dict[str, list[float]]) -> None:
    r"""Reduce a logging window's per-micro-batch values in place (then emptied:
    ``token_weights``): a key with weights becomes its token-weighted mean
    :math:`\sum_j n_j v_j / \sum_j n_j` (:math:`n_j` valid tokens of micro-batch :math:`j`, so a
    fraction of tokens stays one over the whole window); ``ratio/min`` / ``ratio/max`` become
    the window's extremes."""
    for key, w in token_weights.items():
        values = metrics.get(key)
        if values and len(values) == len(w) and sum(w) > 0:
            metrics[key] = [sum(v * x for v, x in zip(values, w, strict=True)) / sum(w)]
    token_weights.clear()
    for key, pick in (("ratio/min", min), ("ratio/max", max)):
        if metrics.get(key):
            metrics[key] = [pick(metrics[key])]


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass
class GBMPOConfig(GRPOConfig):
    r"""``GRPOConfig`` plus gbmpo's objective knobs (every TRL field keeps its meaning).

    Parameters (in addition to :class:`trl.GRPOConfig`):
        regularizer: per-token regularizer name from
            :data:`gbmpo.objectives.regularizers.REGULARIZERS` (``kl_k3`` = TRL's KL;
            ``prob_l2``, ``neural_mirror``, ``kl_k1``, ``kl_k2``, ``kl_k3_is``, ``log_l2``,
            ``rpg_fkl``, ``rpg_rkl``, ``rpg_ufkl``, ``rpg_urkl``, ``none``).
        regularizer_coef: its coefficient :math:`\lambda`; ``None`` takes ``beta``. It replaces
            ``beta`` (see the module docstring for the exact rule).
        regularizer_anchor: ``"ref"`` (frozen reference model; with PEFT the adapter-disabled
            base, TRL's mechanism) or ``"old"`` (the rollout policy's log-probs, RPG's iterative
            reference; no reference model is loaded).
        regularizer_clamp: clip the regularizer value to ``[-c, c]`` (``kl_k3``, ``kl_k3_is``,
            ``rpg_*`` only; the RPG code uses 10). ``None``: no clip, as TRL.
        mirror_path: neural mirror map file (``NeuralMirrorMap.save`` / an ES result) for
            ``regularizer="neural_mirror"``; ``None`` draws the NM-GRPO random init
            (``NeuralMirrorMap.random(0.01, seed=42)``).
        clip_mode: ``"ratio"`` (TRL's clip with ``epsilon`` / ``epsilon_high`` / ``delta``;
            GSPO's sequence ratio when ``importance_sampling_level="sequence"``), ``"atr"``
            (ATR-GRPO, bounds from ``atr_delta``; ``epsilon`` is ignored) or ``"rpg_dual"``
            (RPG-style clip: ``epsilon`` / ``epsilon_high`` plus a dual clip ``dual_clip_c``,
            default 3).
        atr_delta: KL3 radius :math:`\delta` of ``clip_mode="atr"`` (required there).
        clip_measure, clip_delta, clip_delta_high, clip_mirror_path: ``clip_mode="divergence"``
            (the ``divergence_clip`` surrogate): the measure (``ratio``, ``k1``, ``k2``, ``k3``,
            ``prob_l2``, ``neural_mirror``), its radius :math:`\delta` (required; the lower
            side's when ``clip_delta_high`` is set), the upper side's radius, and the mirror
            map file of ``neural_mirror``.
        dual_clip_c: dual-clip constant ``c > 1`` for negative advantages; optional with
            ``ratio`` / ``atr`` / ``divergence``, default 3.0 with ``rpg_dual``.
        rpg_variant: with ``rpg_dual``, RPG's regularized advantage: ``none`` (plain A),
            ``urkl`` (:math:`A - \beta_{\text{rpg}}\log w`) or ``rkl``.
        rpg_beta: :math:`\beta_{\text{rpg}}` of ``rpg_variant`` (``urkl`` / ``rkl`` only).
        log_all_regularizers: also log the value of every parameter-free registered
            regularizer against the same anchor (``regularizer/<name>``), when the anchor's
            log-probs exist; the active regularizer is always logged.
        monitor_reference: compute the reference model's log-probs even when the loss does not
            need them (``beta`` is then TRL's switch for the reference only: 1 when the
            coefficient is 0 or the anchor is ``old``; the loss uses ``regularizer_coef``), so
            that ``reference/<name>`` is logged for the active regularizer and, with
            ``log_all_regularizers``, every registered one.

    Changed default: ``use_bias_correction_kl`` is False here (TRL 1.16: True, which multiplies
    k3 by the token importance ratio), so the regularizer is exactly the one named; True maps
    ``regularizer="kl_k3"`` onto ``kl_k3_is``, TRL's corrected KL (identical at token level).

    Every ``GRPOConfig`` field is honoured, mapped onto the gbmpo objective that is the same
    quantity, or refused with the reason (:data:`TRL_FIELDS`). Refused (``ValueError``):
    settings a loss type does not use (``delta`` / ``importance_sampling_level="sequence"`` with
    cispo / sapo / vespo), a cispo cap below 1, vespo with vLLM importance-sampling correction,
    and inconsistent combinations (listed in the errors).
    """

    # TRL 1.16 defaults this to True (k3 times the importance ratio). Here the regularizer is
    # exactly the named one, so the default is False; TRL's corrected KL is "kl_k3_is".
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={
            "help": "TRL's importance-weighted k3: True turns regularizer='kl_k3' into 'kl_k3_is' "
            "(default False here, True in TRL)."
        },
    )
    regularizer: str = field(
        default="kl_k3",
        metadata={"help": "Per-token regularizer (gbmpo REGULARIZERS name); kl_k3 = TRL's KL."},
    )
    regularizer_coef: float | None = field(
        default=None,
        metadata={"help": "Regularizer coefficient; replaces `beta` (unset: take `beta`)."},
    )
    regularizer_anchor: str = field(
        default="ref",
        metadata={"help": "Anchor of the regularizer: 'ref' (reference model) or 'old' (rollout)."},
    )
    regularizer_clamp: float | None = field(
        default=None,
        metadata={"help": "Clip the regularizer value to [-c, c] (kl_k3, kl_k3_is, rpg_*)."},
    )
    mirror_path: str | None = field(
        default=None,
        metadata={"help": "Neural mirror map file for regularizer='neural_mirror'."},
    )
    clip_mode: str = field(
        default="ratio",
        metadata={"help": "Surrogate clip: 'ratio', 'atr' (ATR-GRPO), 'divergence' (clip by "
                  "clip_measure) or 'rpg_dual'."},
    )
    atr_delta: float | None = field(
        default=None,
        metadata={"help": "KL3 radius delta of clip_mode='atr'."},
    )
    clip_measure: str | None = field(
        default=None,
        metadata={"help": "Divergence of clip_mode='divergence': ratio, k1, k2, k3, prob_l2, "
                  "neural_mirror."},
    )
    clip_delta: float | None = field(
        default=None,
        metadata={"help": "Radius delta of clip_mode='divergence' (lower side if "
                  "clip_delta_high is set)."},
    )
    clip_delta_high: float | None = field(
        default=None,
        metadata={"help": "Upper-side radius of clip_mode='divergence' (default clip_delta)."},
    )
    clip_mirror_path: str | None = field(
        default=None,
        metadata={"help": "Neural mirror map file for clip_measure='neural_mirror'."},
    )
    dual_clip_c: float | None = field(
        default=None,
        metadata={"help": "Dual-clip constant c > 1 (default 3 with clip_mode='rpg_dual')."},
    )
    rpg_variant: str = field(
        default="none",
        metadata={"help": "RPG regularized advantage with rpg_dual: 'none', 'urkl' or 'rkl'."},
    )
    rpg_beta: float = field(
        default=0.0,
        metadata={"help": "Coefficient of rpg_variant's regularized advantage."},
    )
    log_all_regularizers: bool = field(
        default=True,
        metadata={"help": "Log every parameter-free regularizer's value against the anchor."},
    )
    monitor_reference: bool = field(
        default=False,
        metadata={
            "help": "Load the reference model even when the loss does not use it, to log "
            "reference/<name> = D(pi_old || pi_ref) for every monitored regularizer."
        },
    )
    objective: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "gbmpo objective spec (the `objective:` section of a gbmpo config, as a dict "
            "or a YAML file path); replaces the alias fields above, loss_type and scale_rewards."
        },
    )

    def __post_init__(self) -> None:
        self._validate_gbmpo()
        # TRL 1.16 sets gradient_checkpointing (True by default), which transformers 5 reads as
        # a deprecated alias of activation_checkpointing and warns about; the same value under
        # the new name (when that is unset) keeps the setting and drops the warning.
        if getattr(self, "activation_checkpointing", False) is None:
            self.activation_checkpointing = self.gradient_checkpointing
        super().__post_init__()

    def _validate_gbmpo(self) -> None:
        if self.objective is not None:
            self._apply_objective_spec()
        if self.regularizer not in REGULARIZERS:
            REGULARIZERS.get(self.regularizer)  # raises UnknownNameError listing valid names
        if self.regularizer_anchor not in REGULARIZER_ANCHORS:
            raise ValueError(
                f"GBMPOConfig: unknown regularizer_anchor {self.regularizer_anchor!r}; valid: "
                f"{', '.join(REGULARIZER_ANCHORS)}"
            )
        if self.clip_mode not in CLIP_MODES:
            raise ValueError(
                f"GBMPOConfig: unknown clip_mode {self.clip_mode!r}; valid: {', '.join(CLIP_MODES)}"
            )
        if self.loss_type not in LOSS_TYPE_AGGREGATION:
            raise ValueError(
                f"GBMPOConfig: unknown loss_type {self.loss_type!r}; supported: "
                f"{', '.join(LOSS_TYPE_AGGREGATION)}"
            )
        if self.use_bias_correction_kl:
            self._map_bias_correction_kl()
        if self.loss_type in LOSS_TYPE_SURROGATES and self.objective is None:
            self._check_loss_type_surrogate()
        self._resolve_coefficient()
        if self.objective is not None:  # built once by _apply_objective_spec
            return
        if self.mirror_path is not None and self.regularizer != "neural_mirror":
            raise ValueError(
                f"GBMPOConfig: mirror_path is set but regularizer={self.regularizer!r}; "
                "mirror_path is used only by regularizer='neural_mirror'"
            )
        if self.regularizer_clamp is not None and self.regularizer not in _CLAMPABLE:
            raise ValueError(
                f"GBMPOConfig: regularizer_clamp is set but regularizer {self.regularizer!r} takes "
                f"no clamp (only {', '.join(_CLAMPABLE)})"
            )
        if self.clip_mode == "atr":
            if self.atr_delta is None:
                raise ValueError("GBMPOConfig: clip_mode='atr' needs atr_delta (KL3 radius > 0)")
        elif self.atr_delta is not None:
            raise ValueError(
                f"GBMPOConfig: atr_delta is set but clip_mode={self.clip_mode!r}; "
                "set clip_mode='atr' to use it"
            )
        divergence_fields = {
            "clip_measure": self.clip_measure,
            "clip_delta": self.clip_delta,
            "clip_delta_high": self.clip_delta_high,
            "clip_mirror_path": self.clip_mirror_path,
        }
        if self.clip_mode == "divergence":
            if self.clip_measure is None or self.clip_delta is None:
                raise ValueError(
                    "GBMPOConfig: clip_mode='divergence' needs clip_measure and clip_delta"
                )
        elif any(v is not None for v in divergence_fields.values()):
            given = ", ".join(k for k, v in divergence_fields.items() if v is not None)
            raise ValueError(
                f"GBMPOConfig: {given} set but clip_mode={self.clip_mode!r}; set "
                "clip_mode='divergence' to use them"
            )
        if self.clip_mode != "ratio":
            if self.importance_sampling_level != "token":
                raise ValueError(
                    f"GBMPOConfig: clip_mode={self.clip_mode!r} clips token ratios; "
                    "importance_sampling_level='sequence' (GSPO) works only with clip_mode='ratio'"
                )
            if self.delta is not None:
                raise ValueError(
                    f"GBMPOConfig: TRL's delta (cap on the unclipped ratio) works only with "
                    f"clip_mode='ratio', not {self.clip_mode!r}"
                )
        if self.clip_mode != "rpg_dual" and (self.rpg_variant != "none" or self.rpg_beta != 0):
            raise ValueError(
                "GBMPOConfig: rpg_variant / rpg_beta are used only with clip_mode='rpg_dual'"
            )
        # Build the objective once: surrogate / regularizer parameter errors surface here; the
        # trainer uses this build unless a field changed since (build_objective compares specs).
        spec = spec_from_trl_fields(self)
        self._built = (spec.to_dict(), spec.build())

    def _map_bias_correction_kl(self) -> None:
        r"""TRL's ``use_bias_correction_kl=True`` (k3 times the token importance ratio
        :math:`\pi_\theta/\pi_{old}`) is gbmpo's ``kl_k3_is``: the default ``kl_k3`` becomes
        ``kl_k3_is``; any other regularizer is refused (TRL corrects only its k3)."""
        if self.objective is not None:
            raise ValueError(
                "GBMPOConfig: use_bias_correction_kl=True with objective=: the spec names the "
                "regularizer; write regularizer: {name: kl_k3_is} there (TRL's corrected KL)"
            )
        if self.regularizer not in ("kl_k3", "kl_k3_is"):
            raise ValueError(
                "GBMPOConfig: use_bias_correction_kl=True corrects TRL's k3 KL (it becomes "
                f"regularizer='kl_k3_is'); regularizer={self.regularizer!r} is not k3: set "
                "use_bias_correction_kl=False"
            )
        if self.importance_sampling_level != "token":
            raise ValueError(
                "GBMPOConfig: use_bias_correction_kl=True with importance_sampling_level="
                f"{self.importance_sampling_level!r}: TRL then weights the KL by the sequence "
                "ratio; gbmpo's kl_k3_is weights it by the token ratio. Set "
                "use_bias_correction_kl=False or importance_sampling_level='token'"
            )
        self.regularizer = "kl_k3_is"

    def _check_loss_type_surrogate(self) -> None:
        """``loss_type`` in cispo / sapo / vespo selects the gbmpo surrogate of that name; the
        TRL settings it does not use are refused rather than ignored."""
        name = self.loss_type
        if name not in SURROGATES:
            raise ValueError(
                f"GBMPOConfig: loss_type={name!r} needs gbmpo's {name!r} surrogate, which this "
                f"gbmpo does not register (surrogates: {', '.join(SURROGATES.names())})"
            )
        if self.clip_mode != "ratio":
            raise ValueError(
                f"GBMPOConfig: loss_type={name!r} selects the {name} surrogate; clip_mode="
                f"{self.clip_mode!r} selects another. Use one: loss_type in grpo, bnpo, dr_grpo, "
                "dapo, luspo with clip_mode, or clip_mode='ratio'"
            )
        if self.importance_sampling_level != "token":
            raise ValueError(
                f"GBMPOConfig: loss_type={name!r} with importance_sampling_level="
                f"{self.importance_sampling_level!r}: gbmpo's {name} surrogate is token level"
                + (" (VESPO already weights by the sequence ratio)" if name == "vespo" else "")
                + "; set importance_sampling_level='token'"
            )
        if self.delta is not None:
            raise ValueError(
                f"GBMPOConfig: delta={self.delta:g} caps the clipped ratio of the clip loss types; "
                f"TRL's {name} does not use it. Unset delta"
            )
        if self.dual_clip_c is not None:
            raise ValueError(f"GBMPOConfig: dual_clip_c is not used by loss_type={name!r}")
        if name == "cispo":
            cap = self.epsilon_high if self.epsilon_high is not None else self.epsilon
            if cap < 1.0:
                raise ValueError(
                    f"GBMPOConfig: loss_type='cispo' caps the importance weight at epsilon_high "
                    f"(here {cap:g}{', from epsilon' if self.epsilon_high is None else ''}); a "
                    "cap below 1 would scale down the gradient of every on-policy token. Set "
                    "epsilon_high to the cap, e.g. 5.0 (ScaleRL, TRL's recommendation)"
                )
        if name == "vespo" and self.use_vllm and self.vllm_importance_sampling_correction:
            raise ValueError(
                "GBMPOConfig: loss_type='vespo' with vLLM importance-sampling correction: TRL "
                "folds the sampler ratio into VESPO's sequence weight, which gbmpo's vespo "
                "surrogate does not take. Set vllm_importance_sampling_correction=False"
            )

    def _apply_objective_spec(self) -> None:
        """``objective=`` given: parse the spec and build it once (kept for the trainer), refuse
        alias fields set beside it, and set the two TRL fields it determines (``loss_type``,
        ``scale_rewards``); ``beta`` follows in :meth:`_resolve_coefficient`. The spec is
        stored back as a dict (``GRPOConfig`` fields stay plain data)."""
        spec = ObjectiveSpec.load(self.objective)
        built = spec.build()
        changed = [
            name
            for name, default in _ALIAS_DEFAULTS.items()
            if getattr(self, name) != default
        ]
        if changed:
            raise ValueError(
                f"GBMPOConfig: objective= is given, so the alias fields must keep their defaults; "
                f"got {', '.join(changed)} (put them into the objective spec instead)"
            )
        coefs = spec.coef_label
        if self.beta not in (0.0, *(coefs if isinstance(coefs, list) else [coefs])):
            raise ValueError(
                f"GBMPOConfig: beta={self.beta:g} disagrees with the objective's "
                f"regularizer.coef={coefs}; leave beta at 0"
            )
        refuse_reward_placement(spec)
        if spec.aggregation not in TRL_LOSS_TYPES or spec.advantage not in TRL_SCALE_REWARDS:
            raise ValueError(
                f"GBMPOConfig: the objective's aggregation {spec.aggregation!r} / advantage "
                f"{spec.advantage!r} has no TRL counterpart; supported aggregations: "
                f"{', '.join(TRL_LOSS_TYPES)}; advantages: {', '.join(TRL_SCALE_REWARDS)}"
            )
        self.objective = spec.to_dict()
        self._built = (spec.to_dict(), built)
        self.loss_type = TRL_LOSS_TYPES[spec.aggregation]
        self.scale_rewards = TRL_SCALE_REWARDS[spec.advantage]

    def _resolve_coefficient(self) -> None:
        if self.objective is not None:  # the spec's coefficient (checked by its build)
            built = self._built[1]
            # beta: the first term's coefficient, or (a sum of terms) any nonzero value that
            # switches TRL's reference forward on; GBMPOTrainer's loss replaces TRL's use of it
            ref_coefs = [t.coef for t in built.terms if t.active and t.needs_ref]
            beta = built.coef if built.single_loss_term or not ref_coefs else ref_coefs[0]
            self._set_beta(beta, built.anchored_on_ref)
            self._check_sync_ref_model(built.spec.regularizer_label, built.anchor, built.coef)
            return
        beta = float(self.beta)
        coef = beta if self.regularizer_coef is None else float(self.regularizer_coef)
        if self.regularizer_coef is not None and beta != 0.0 and beta != coef:
            raise ValueError(
                f"GBMPOConfig: beta={beta:g} and regularizer_coef={coef:g} disagree. "
                "regularizer_coef replaces TRL's beta: set only regularizer_coef (or set both to "
                "the same value)"
            )
        if not math.isfinite(coef) or coef < 0:
            raise ValueError(f"GBMPOConfig: regularizer_coef must be finite and >= 0, got {coef}")
        if self.regularizer == "none" and coef != 0:
            raise ValueError(
                f"GBMPOConfig: regularizer='none' but the coefficient is {coef:g} (from "
                f"{'beta' if self.regularizer_coef is None else 'regularizer_coef'}); set it to 0 "
                "or choose a regularizer"
            )
        self.regularizer_coef = coef
        self._set_beta(coef, self.needs_reference_model)
        self._check_sync_ref_model(self.regularizer, self.regularizer_anchor, coef)

    def _set_beta(self, coef: float, needs_reference: bool) -> None:
        # TRL loads the reference model and computes its log-probs exactly when beta != 0; TRL's
        # own use of beta (its KL term) is replaced by GBMPOTrainer's loss, so with
        # monitor_reference beta = 1 only switches the reference on.
        if needs_reference:
            self.beta = coef
        else:
            self.beta = 1.0 if self.monitor_reference else 0.0

    def _check_sync_ref_model(self, regularizer: str, anchor: str, coef: float) -> None:
        if self.sync_ref_model and not (self.needs_reference_model or self.monitor_reference):
            raise ValueError(
                "GBMPOConfig: sync_ref_model=True but no reference model is used "
                f"(regularizer={regularizer!r}, anchor={anchor!r}, coefficient={coef:g})"
            )

    def __getstate__(self) -> dict[str, Any]:
        # the built objective holds functions and is rebuilt from the fields where needed
        # (HF's Trainer pickles its arguments into every checkpoint)
        state = dict(self.__dict__)
        state.pop("_built", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def needs_reference_model(self) -> bool:
        """True when the loss needs the reference model's log-probs (TRL's ``beta != 0``)."""
        if self.objective is not None:
            if getattr(self, "_built", None) is None:  # e.g. unpickled from a checkpoint
                spec = ObjectiveSpec.load(self.objective)
                self._built = (spec.to_dict(), spec.build())
            return bool(self._built[1].anchored_on_ref)
        coef = self.regularizer_coef if self.regularizer_coef is not None else self.beta
        return self.regularizer != "none" and self.regularizer_anchor == "ref" and coef != 0


# --------------------------------------------------------------------------------------------
# Objective
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TRLObjective:
    """gbmpo's loss pieces resolved from a :class:`GBMPOConfig`."""

    surrogate: Surrogate
    surrogate_name: str
    regularizer: Regularizer
    coef: float
    anchor: str
    loss_type: str
    aggregation: str
    max_len: int
    diagnostics: dict[str, Regularizer]
    #: the objective spec these pieces were built from
    spec: ObjectiveSpec | None = None
    #: regularizers logged as ``reference/<name>`` = D(pi_old || pi_ref): the active one and,
    #: with ``log_all_regularizers``, every registered one (as the own trainer's ``reg/<name>``)
    reference_monitors: dict[str, Regularizer] = field(default_factory=dict)
    #: a sum of regularizers (``objective.regularizer`` a list): every term, each with its own
    #: coefficient and anchor; empty for one regularizer (``regularizer``, ``coef``, ``anchor``)
    terms: tuple[Any, ...] = ()


def refuse_reward_placement(spec: ObjectiveSpec) -> None:
    """Refuse a regularizer term with ``placement: reward``: TRL 1.16 computes the rewards and
    the advantages inside ``GRPOTrainer._generate_and_score_completions``, and its reward hook
    (``_calculate_rewards``) sees neither the rollout nor the reference log-probs."""
    placed = [t.name for t in spec.terms if t.placement == "reward"]
    if placed:
        raise ValueError(
            f"GBMPOConfig: objective.regularizer.placement=reward ({', '.join(placed)}) is not "
            "supported with TRL: GRPOTrainer computes rewards and advantages in "
            "_generate_and_score_completions, whose reward hook sees no log-probs; use "
            "placement: loss, or the gbmpo or verl engine for an in-reward divergence"
        )


def objective_spec(args: GBMPOConfig) -> ObjectiveSpec:
    """The gbmpo objective spec that ``args`` names: its ``objective`` if given, else the one
    its alias fields spell (:func:`spec_from_trl_fields`)."""
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
    """TRL's spelling of an objective -> the gbmpo objective spec (the alias mapping).

    Surrogate: ``clip_mode="ratio"`` -> ``clip`` (``gspo`` for sequence-level importance
    sampling) with ``eps_low=epsilon``, ``eps_high=epsilon_high or epsilon``, ``delta`` and
    ``dual_clip_c``; ``atr`` -> ``atr(delta=atr_delta, dual_clip_c)``; ``divergence`` ->
    ``divergence_clip(measure=clip_measure, delta_low=clip_delta, delta_high=clip_delta_high or
    clip_delta, dual_clip_c, mirror=clip_mirror_path)``; ``rpg_dual`` ->
    ``rpg_clip(variant=rpg_variant, beta=rpg_beta, eps_low, eps_high, c=dual_clip_c or 3)``
    (host clip settings through :func:`gbmpo.integrations.common.clip_params`); ``loss_type``
    cispo / sapo / vespo -> :func:`loss_type_surrogate`. Regularizer:
    ``regularizer`` with ``regularizer_coef`` (else ``beta``), ``regularizer_anchor``,
    ``regularizer_clamp`` -> ``clamp``, ``mirror_path`` -> ``mirror``. Aggregation from
    ``loss_type`` (:data:`LOSS_TYPE_AGGREGATION`), advantage from ``scale_rewards``
    (``group`` -> grpo, ``batch`` -> batch, ``none`` -> dr_grpo).
    """
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
    coef = float(args.regularizer_coef if args.regularizer_coef is not None else args.beta)
    scale = {True: "group", False: "none"}.get(args.scale_rewards, args.scale_rewards)
    advantage = {"group": "grpo", "batch": "batch", "none": "dr_grpo"}.get(scale, "grpo")
    return ObjectiveSpec(
        advantage=advantage,
        surrogate=SurrogateSpec(name, params),
        regularizer=RegularizerSpec(args.regularizer, coef, args.regularizer_anchor, reg_params),
        aggregation=LOSS_TYPE_AGGREGATION.get(args.loss_type, "bnpo"),
        monitor_regularizers=bool(args.log_all_regularizers),
    )


def build_objective(args: GBMPOConfig) -> TRLObjective:
    """Resolve ``args`` to a surrogate, a regularizer and an aggregation mode, through the
    objective spec (:func:`objective_spec`): ``args.objective`` if given, else the alias
    fields (:func:`spec_from_trl_fields`). The spec is built once, when ``args`` is checked;
    that build is used as is unless a field changed since."""
    spec = objective_spec(args)
    cached = getattr(args, "_built", None)
    built = cached[1] if cached is not None and cached[0] == spec.to_dict() else spec.build()
    return TRLObjective(
        surrogate=built.surrogate,
        surrogate_name=spec.surrogate.name,
        regularizer=built.regularizer,
        coef=built.coef,
        anchor=built.anchor,
        loss_type=args.loss_type,
        aggregation=LOSS_TYPE_AGGREGATION[args.loss_type],
        max_len=int(args.max_completion_length),
        # the monitored set is the own engine's (every registered regularizer but "none")
        diagnostics={n: r for n, r in built.monitors.items()
                     if n not in {t.name for t in built.terms}},  # fmt: skip
        spec=spec,
        reference_monitors=dict(built.monitors),
        terms=() if built.single_loss_term else built.terms,
    )


# --------------------------------------------------------------------------------------------
# Trainer
# --------------------------------------------------------------------------------------------


class GBMPOTrainer(GRPOTrainer):
    r"""``GRPOTrainer`` whose loss is gbmpo's (see the module docstring); same constructor.

    ``args`` must be a :class:`GBMPOConfig` (``None`` builds a default one, like TRL). Only
    ``_compute_loss`` is overridden: generation, rewards, advantages, reference log-probs
    (computed by TRL whenever the regularizer is anchored on the reference model), old
    log-probs, vLLM importance ratios and everything else stay TRL's.

    Logged metrics (``self._metrics``, averaged over processes by token count): ``entropy``,
    ``kl`` (k3 against the reference, when its log-probs exist; TRL's key),
    ``regularizer/<name>`` (the active regularizer and, with ``log_all_regularizers``, every
    parameter-free one, against the anchor), ``loss/surrogate`` and ``loss/regularizer`` (the
    two parts of the loss, per optimizer step), ``clip_ratio/low_mean``,
    ``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``clip_ratio/dual_mean``,
    ``ratio/mean``, ``ratio/min``, ``ratio/max`` (the logging window's extremes),
    ``reference/<name>`` (:math:`D(\pi_{old}\,\|\,\pi_{ref})`, the masked token mean over the
    window, for the active regularizer and, with ``log_all_regularizers``, every registered
    one; when the reference log-probs exist, see ``monitor_reference``); plus TRL's own names
    with TRL's definitions: ``clip_ratio/low_min`` / ``clip_ratio/high_max`` (TRL's clip),
    ``cispo_clip_ratio``, ``vespo/phi_seq_mean``, and with an entropy bonus ``policy_loss`` and
    ``entropy_coef``; ``aux_loss`` as TRL. ``kl`` is multiplied by the token ratio with
    ``use_bias_correction_kl``, as TRL's.

    ``use_adaptive_entropy``: TRL's controller (:func:`adaptive_entropy_coef`) on TRL's state
    attributes (``entropy_coef``, ``_last_world_entropy``), which TRL's checkpoint code saves.
    """

    _tag_names = ["trl", "grpo", "gbmpo"]

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GBMPOConfig | None = None,
        *trl_args: Any,
        **trl_kwargs: Any,
    ) -> None:
        check_trl_internals()
        _quiet_host_warnings()
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GBMPOConfig(f"{os.path.basename(str(name).rstrip('/'))}-GBMPO")
        if not isinstance(args, GBMPOConfig):
            raise TypeError(
                f"GBMPOTrainer needs a GBMPOConfig, got {type(args).__name__}; build one with "
                "the same fields plus gbmpo's (regularizer, regularizer_coef, clip_mode, ...)"
            )
        self._gbmpo = build_objective(args)
        super().__init__(model, reward_funcs, args, *trl_args, **trl_kwargs)
        for attr in _TRAINER_ATTRIBUTES:
            if not hasattr(self, attr):
                raise TRLInternalsError(
                    f"GRPOTrainer.__init__ no longer sets self.{attr} (TRL {trl.__version__}); "
                    f"GBMPOTrainer reads it and supports trl{SUPPORTED_TRL}"
                )
        if self.beta != args.beta:  # pragma: no cover - guarded by check_trl_internals
            raise TRLInternalsError("GRPOTrainer.__init__ no longer copies args.beta to self.beta")

    @property
    def objective(self) -> TRLObjective:
        """The resolved gbmpo objective (surrogate, regularizer, coefficient, aggregation)."""
        return self._gbmpo

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        obj = self._gbmpo
        mode = "train" if self.model.training else "eval"
        accum = self.current_gradient_accumulation_steps if mode == "train" else 1

        # Policy log-probs and entropies: TRL's own helper (fused LM head, multimodal inputs).
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask
        if "tool_mask" in inputs:
            mask = completion_mask * inputs["tool_mask"]
        logp, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{k: inputs.get(k) for k in _FORWARD_KEYS},
        )
        advantages = inputs["advantages"]
        old_in = inputs.get("old_per_token_logps")
        old_logp = logp.detach() if old_in is None else old_in
        ref_logp = inputs.get("ref_per_token_logps")

        # TRL's token weights ([B, T] or [B, 1]): they multiply the surrogate only, before the
        # regularizer is added (compute_policy_loss's token_weights).
        weights: Tensor | None = None
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:
            threshold = 1 - self.top_entropy_quantile
            entropy_mask = self.get_high_entropy_mask(entropies, mask, threshold)
            weights = entropy_mask.to(logp.dtype)
        if self.off_policy_mask_threshold is not None:
            adv2 = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            keep = self.get_off_policy_mask(
                advantages=adv2,
                per_token_logps=logp,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old_logp),
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
            weights = keep if weights is None else weights * keep
        if self.use_vllm and self.vllm_importance_sampling_correction:
            ratio = inputs["importance_sampling_ratio"]
            weights = ratio if weights is None else weights * ratio

        # Regularizer anchor.
        anchor = ref_logp if obj.anchor == "ref" else old_logp
        if anchor is None and obj.coef != 0:
            raise RuntimeError(
                f"regularizer {obj.regularizer.name!r} is anchored on the reference model but the "
                "batch has no 'ref_per_token_logps'; TRL computes them when beta != 0 "
                f"(beta={self.beta})"
            )
        regularizer = obj.regularizer if anchor is not None else None
        coef = obj.coef if regularizer is not None else 0.0
        terms = None
        if obj.terms:  # a sum of regularizers: each term with its own anchor
            anchors = {"ref": ref_logp, "old": old_logp}
            missing = [t.name for t in obj.terms if t.active and t.needs_ref and ref_logp is None]
            if missing:
                raise RuntimeError(
                    f"regularizers {missing} are anchored on the reference model but the batch "
                    f"has no 'ref_per_token_logps'; TRL computes them when beta != 0 "
                    f"(beta={self.beta})"
                )
            terms = [
                LossTerm(t.name, t.regularizer, t.coef, anchors[t.anchor])
                for t in obj.terms
                if t.placement == "loss"
            ]
            regularizer, coef = None, 0.0

        # Aggregation with TRL's normalisers (full accumulation window -> no further division).
        agg_kw: dict[str, Any] = {}
        if obj.loss_type == "bnpo":
            # TRL: local token mean / G_acc
            agg_kw["num_tokens"] = max(float(mask.sum()), 1.0) * accum
        elif obj.loss_type in _GLOBAL_TOKEN_LOSS_TYPES:
            # TRL: token sum / Z with Z = global tokens / processes (scaled to the window); Z may
            # be below this process's token count, which aggregate accepts.
            agg_kw["num_tokens"] = float(
                dapo_normalizer(
                    inputs["num_items_in_batch"],
                    num_processes=self.accelerator.num_processes,
                    accumulation_steps=accum,
                    steps_per_generation=self.args.steps_per_generation,
                    training=mode == "train",
                )
            )
        else:
            agg_kw["num_sequences"] = int(logp.size(0)) * accum
        loss, m = compute_policy_loss(
            logp=logp,
            old_logp=old_logp,
            ref_logp=anchor,
            advantages=advantages,
            mask=mask,
            surrogate=obj.surrogate,
            regularizer=regularizer,
            coef=coef,
            aggregation=obj.aggregation,
            max_len=obj.max_len if obj.aggregation == "dr_grpo" else None,
            token_weights=weights,
            terms=terms,
            **agg_kw,
        )
        pg_part = m["pg_loss"]

        if self._entropy_bonus_enabled:
            # TRL's policy_loss: the loss before the entropy term, per micro-batch (not divided by
            # the accumulation steps, except for the global-token loss types, as TRL)
            policy = loss.detach() * (1 if obj.loss_type in _GLOBAL_TOKEN_LOSS_TYPES else accum)
            self._metrics[mode]["policy_loss"].append(self._mean_over_processes(float(policy)))
            eff_mask = mask if entropy_mask is None else mask * entropy_mask
            loss = loss - self._entropy_term(entropies, eff_mask, accum, mode)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accum
            self._metrics[mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(aux_loss).mean().item()
            )

        self._log_gbmpo_metrics(mode, logp, entropies, mask, anchor, ref_logp, old_logp, m)
        self._log_trl_metrics(mode, logp.detach(), old_logp, advantages, mask)
        if mode == "train" and ref_logp is not None:
            self._add_reference_divergences(old_logp, ref_logp, mask)
        self._metrics[mode]["loss/surrogate"].append(self._mean_over_processes(pg_part * accum))
        self._metrics[mode]["loss/regularizer"].append(
            self._mean_over_processes(m["reg_loss"] * accum)
        )
        for t in obj.terms:  # a sum of regularizers: each term's part of the loss
            self._metrics[mode][f"loss/regularizer/{t.name}"].append(
                self._mean_over_processes(m[f"reg_loss/{t.name}"] * accum)
            )
        return loss

    def _entropy_term(self, entropies: Tensor, mask: Tensor, accum: int, mode: str) -> Tensor:
        """TRL's entropy bonus times its coefficient (subtracted from the loss). With
        ``use_adaptive_entropy`` the coefficient applies only while the previous window's entropy
        is at most ``entropy_target``, and is updated at each optimizer step from this window's
        token-mean entropy over all processes (:func:`adaptive_entropy_coef`); the state lives in
        TRL's attributes, which TRL saves with checkpoints."""
        args = self.args
        bonus = entropy_bonus(entropies, mask, accum)
        coef = self.entropy_coef
        if self.use_adaptive_entropy and self._last_world_entropy > args.entropy_target:
            coef = 0.0
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropies * mask).sum(), mask.sum()]).detach().float()
            window = getattr(self, "_entropy_window_stats", None)
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:
                totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world = float(totals[0] / totals[1].clamp(min=1.0))
                self.entropy_coef = adaptive_entropy_coef(
                    self.entropy_coef, world, target=args.entropy_target,
                    delta=args.entropy_coef_delta, coef_min=args.entropy_coef_min,
                    coef_max=args.entropy_coef_max,
                )  # fmt: skip
                self._last_world_entropy = world
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return coef * bonus

    # ---- logging ------------------------------------------------------------------------------

    @torch.no_grad()
    def _add_reference_divergences(self, old_logp: Tensor, ref_logp: Tensor, mask: Tensor) -> None:
        r"""Add this micro-batch's token sums of :math:`D(\pi_{old}\,\|\,\pi_{ref})` for every
        regularizer of ``objective.reference_monitors`` (the mean over the logging window's
        tokens is logged as ``reference/<name>``; every pass over a batch adds the same values,
        so ``num_iterations`` > 1 leaves the mean unchanged)."""
        mf = mask.to(torch.float32)
        sums = getattr(self, "_reference_sums", None)
        if sums is None:
            sums = self._reference_sums = {}
            self._reference_tokens = 0.0
        old, ref = old_logp.detach().float(), ref_logp.detach().float()
        for name, reg in self._gbmpo.reference_monitors.items():
            value = (reg(logp=old, old_logp=old, ref_logp=ref, mask=mask) * mf).sum()
            sums[name] = sums.get(name, 0.0) + float(value)
        self._reference_tokens += float(mf.sum())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, with ``reference/<name>`` (token means over every process since the last
        log), GBMPOTrainer's per-micro-batch means weighted by their valid tokens and
        ``ratio/min`` / ``ratio/max`` as the window's extremes (TRL would average the
        micro-batches' values plainly)."""
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        # token-weighted means over the window's micro-batches (TRL averages them plainly), so
        # that e.g. the clip fraction is the fraction of the window's valid tokens
        window_means(metrics, getattr(self, "_token_weights", {}).get(mode, {}))
        sums = getattr(self, "_reference_sums", None)
        if mode == "train" and sums:
            names = sorted(sums)
            local = torch.tensor([sums[n] for n in names] + [self._reference_tokens],
                                 dtype=torch.float64, device=self.accelerator.device)  # fmt: skip
            totals = self.accelerator.reduce(local, reduction="sum")
            tokens = float(totals[-1].clamp(min=1.0))
            for i, name in enumerate(names):
                metrics[f"reference/{name}"] = [float(totals[i]) / tokens]
            self._reference_sums = None
        super().log(logs, start_time)

    @torch.no_grad()
    def _log_trl_metrics(
        self, mode: str, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
    ) -> None:
        """The loss-type metrics TRL logs under its own names, with TRL's definitions:
        ``clip_ratio/low_min`` / ``clip_ratio/high_max`` (per-sequence clip fractions, min / max
        over the batch) for the clip loss types with TRL's clip (``clip_mode="ratio"``),
        ``cispo_clip_ratio`` (tokens whose weight the cap binds, with :math:`A > 0`) and
        ``vespo/phi_seq_mean`` (the mean VESPO sequence weight)."""
        obj = self._gbmpo
        adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        mf = mask.to(torch.float32)
        log_ratio = (logp - old_logp).float()
        name = obj.surrogate_name
        if name in ("clip", "gspo") and obj.loss_type not in LOSS_TYPE_SURROGATES:
            if name == "gspo":
                seq = (log_ratio * mf).sum(-1) / mf.sum(-1).clamp(min=1.0)
                ratio = torch.exp(seq).unsqueeze(-1).expand_as(log_ratio)
            else:
                ratio = torch.exp(log_ratio)
            # the surrogate's own interval (= TRL's 1 - epsilon, 1 + epsilon_high when mapped)
            sur: Any = obj.surrogate
            lo, hi = 1.0 - float(sur.eps_low), 1.0 + float(sur.eps_high)
            low = ((ratio < lo) & (adv < 0)).float()
            high = ((ratio > hi) & (adv > 0)).float()
            per_seq = torch.stack([(x * mf).sum(-1) / mf.sum(-1) for x in (low, high)], dim=-1)
            gathered = self.accelerator.gather(per_seq)
            low_seq, high_seq = gathered[:, 0], gathered[:, 1]
            low_seq, high_seq = low_seq[~low_seq.isnan()], high_seq[~high_seq.isnan()]
            nan = float("nan")
            self._metrics[mode]["clip_ratio/low_min"].append(
                float(low_seq.min()) if low_seq.numel() else nan
            )
            self._metrics[mode]["clip_ratio/high_max"].append(
                float(high_seq.max()) if high_seq.numel() else nan
            )
        elif obj.loss_type == "cispo":
            cap = 1.0 + float(obj.surrogate.eps_high)  # TRL's epsilon_high (loss_type_surrogate)
            hit = ((torch.exp(log_ratio) > cap) & (adv > 0)).float()
            totals = self.accelerator.reduce(torch.stack([(hit * mf).sum(), mf.sum()]), "sum")
            self._metrics[mode]["cispo_clip_ratio"].append(float(totals[0] / totals[1].clamp(1.0)))
        elif obj.loss_type == "vespo":
            a = self.args
            phi = self.get_gamma_weights(
                advantages=adv, log_ratio_per_token=log_ratio, mask=mf,
                importance_sampling_ratio=None, k_pos=a.vespo_k_pos, lambda_pos=a.vespo_lambda_pos,
                k_neg=a.vespo_k_neg, lambda_neg=a.vespo_lambda_neg,
            )  # fmt: skip
            count = torch.tensor(float(phi.shape[0]), device=phi.device)
            totals = self.accelerator.reduce(torch.stack([phi.sum().float(), count]), "sum")
            self._metrics[mode]["vespo/phi_seq_mean"].append(
                float(totals[0] / totals[1].clamp(1.0))
            )

    def _mean_over_processes(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float32, device=self.accelerator.device)
        return float(self.accelerator.gather(t).mean())

    def _log_gbmpo_metrics(
        self,
        mode: str,
        logp: Tensor,
        entropies: Tensor,
        mask: Tensor,
        anchor: Tensor | None,
        ref_logp: Tensor | None,
        old_logp: Tensor,
        m: dict[str, float],
    ) -> None:
        """Token-weighted means over all processes (one reduce), min / max over processes."""
        obj = self._gbmpo
        mf = mask.to(torch.float32)
        n_local = mf.sum()
        values: dict[str, Tensor] = {}

        def token_mean(x: Tensor) -> Tensor:
            return masked_mean(x, mf)

        values["entropy"] = token_mean(entropies)
        with torch.no_grad():
            lp = logp.detach()
            if ref_logp is not None:
                # TRL's kl: k3, times the token ratio with use_bias_correction_kl (kl_k3_is)
                kl = kl_k3(lp.float(), ref_logp.float())
                if self.args.use_bias_correction_kl:
                    kl = kl * torch.exp(lp.float() - old_logp.float())
                values["kl"] = token_mean(kl)
            if obj.terms:  # a sum: the summed value under its label, then each term's
                label = obj.spec.regularizer_label if obj.spec is not None else "sum"
                values[f"regularizer/{label}"] = torch.tensor(m["reg_value"], device=mf.device)
                for t in obj.terms:
                    values[f"regularizer/{t.name}"] = torch.tensor(
                        m[f"reg_value/{t.name}"], device=mf.device
                    )
            if anchor is not None and not obj.terms:
                values[f"regularizer/{obj.regularizer.name}"] = torch.tensor(
                    m["reg_value"], device=mf.device
                )
                for name, reg in obj.diagnostics.items():
                    values[f"regularizer/{name}"] = token_mean(
                        reg(logp=lp, old_logp=old_logp, ref_logp=anchor, mask=mask)
                    )
        values["clip_ratio/low_mean"] = torch.tensor(m["clip_frac_low"], device=mf.device)
        values["clip_ratio/high_mean"] = torch.tensor(m["clip_frac_high"], device=mf.device)
        values["clip_ratio/region_mean"] = torch.tensor(
            m["clip_frac_low"] + m["clip_frac_high"], device=mf.device
        )
        values["clip_ratio/dual_mean"] = torch.tensor(m["clip_frac_dual"], device=mf.device)
        values["ratio/mean"] = torch.tensor(m["ratio_mean"], device=mf.device)

        keys = list(values)
        stacked = torch.stack([values[k].float() * n_local for k in keys] + [n_local])
        totals = self.accelerator.reduce(stacked, reduction="sum")
        denom = totals[-1].clamp(min=1.0)
        for i, k in enumerate(keys):
            self._metrics[mode][k].append(float(totals[i] / denom))
        # the micro-batch's valid tokens (all processes): log() weights these means by them
        weights = getattr(self, "_token_weights", None)
        if weights is None:
            weights = self._token_weights = {"train": {}, "eval": {}}
        for k in keys:
            weights[mode].setdefault(k, []).append(float(totals[-1]))
        extremes = torch.tensor([m["ratio_min"], -m["ratio_max"]], device=mf.device)
        if n_local == 0:  # no valid token here: do not let the 0 placeholders win
            extremes = torch.full_like(extremes, math.inf)
        gathered = self.accelerator.gather(extremes.unsqueeze(0)).view(-1, 2).min(dim=0).values
        self._metrics[mode]["ratio/min"].append(float(gathered[0]))
        self._metrics[mode]["ratio/max"].append(float(-gathered[1]))
