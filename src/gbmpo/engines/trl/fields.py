"""Every ``GRPOConfig`` field's answer in :class:`gbmpo.integrations.trl.GBMPOTrainer`:
honoured, mapped onto the gbmpo objective that is the same quantity, or refused
(:data:`TRL_FIELDS`, :func:`trl_field_status`).
"""

from __future__ import annotations

from dataclasses import fields

import trl
from transformers import TrainingArguments

from gbmpo.engines.trl.internals import SUPPORTED_TRL

__all__ = ["FIELD_STATUSES", "TRL_FIELDS", "trl_field_status"]

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
                  "normalisers (bnpo: the optimizer step's tokens over every process, the own "
                  "engine's mini-batch token mean); cispo/sapo/vespo: gbmpo's surrogate of "
                  "that name plus TRL's "
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
    "use_bias_correction_kl": ("mapped", "True (TRL's default, and GBMPOConfig's): regularizer "
                               "kl_k3 becomes kl_k3_is (k3 times the token ratio, TRL's "
                               "corrected KL); other regularizers are used as named; refused "
                               "with an active kl_k3 and importance_sampling_level='sequence'; "
                               "with objective= it follows the spec (True for kl_k3_is)"),
    "top_entropy_quantile": ("honoured", "TRL's high-entropy token mask multiplies the "
                             "surrogate and restricts the entropy bonus"),
    "off_policy_mask_threshold": ("honoured", "TRL's off-policy sequence mask multiplies the "
                                  "surrogate; with objective= it is set from "
                                  "objective.rollout_correction"),
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
                                            "only, as TRL; with objective= set from "
                                            "objective.rollout_correction (off by default); "
                                            "refused with loss_type='vespo' "
                                            "(TRL folds it into VESPO's sequence weight, which "
                                            "gbmpo's vespo surrogate does not take)"),
    "scale_rewards": ("honoured", "TRL's advantage normalisation (the objective spec's "
                      "advantage: group -> grpo, batch -> batch, none -> dr_grpo)"),
    "sync_ref_model": ("honoured", "TRL's reference sync; refused when no reference model "
                       "is used (the regularizer is not anchored on it)"),
    "ref_model_mixup_alpha": ("honoured", "TRL's reference sync"),
    "ref_model_sync_steps": ("honoured", "TRL's reference sync"),
    "num_iterations": ("honoured", "TRL's updates per generation (old log-probs); the entropy "
                       "metric averages the first pass, as the own engine"),
    "multi_objective_aggregation": ("honoured", "TRL's sum of the reward functions; "
                                    "'normalize_then_sum' is refused with placement: reward "
                                    "(no one reward to subtract the penalty from)"),
    # --- generation, rewards, data, logging: TRL's code, not the loss --------------------
    **{name: ("honoured", _TRL) for name in (
        "model_init_kwargs", "trust_remote_code", "disable_dropout", "cast_lm_head_to_fp32",
        "num_generations", "num_generations_eval", "ds3_gather_for_generation",
        "shuffle_dataset", "pad_to_multiple_of", "generation_batch_size", "temperature",
        "top_p", "top_k", "min_p", "generation_kwargs", "chat_template_kwargs",
        "repetition_penalty", "cache_implementation", "reward_weights",
        "mask_truncated_completions",
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
    if name in {f.name for f in fields(TrainingArguments)}:
        return _TRAINING_ARGUMENT
    raise KeyError(
        f"GRPOConfig field {name!r} has no answer in GBMPOTrainer (TRL {trl.__version__}; "
        f"supported: trl{SUPPORTED_TRL})"
    )
