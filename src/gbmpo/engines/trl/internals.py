"""The TRL version and the TRL internals that :class:`gbmpo.integrations.trl.GBMPOTrainer`
hooks: :data:`SUPPORTED_TRL`, the method signatures, config fields, trainer attributes and source
facts relied upon, and :func:`check_trl_internals`, which fails loudly naming the one that moved.
"""

from __future__ import annotations

import warnings

import trl
from trl import GRPOConfig, GRPOTrainer

from gbmpo.engines.hosts import check_fields, check_signatures, check_sources

__all__ = ["SUPPORTED_TRL", "TRLInternalsError", "check_trl_internals"]

#: The TRL versions whose internals this package was written against and tested with.
SUPPORTED_TRL = ">=1.16,<1.17"
_SUPPORTED_MIN, _SUPPORTED_MAX = (1, 16), (1, 17)

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
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
    "_prepare_inputs": ("generation_batch",),
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

#: GRPOConfig fields this package reads or rewrites.
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
    "cache_implementation",
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
    "_step",
    "_buffered_inputs",
    "num_iterations",
    "num_generations",
    "num_generations_eval",
    "reward_weights",
    "scale_rewards",
    "temperature",
)

#: Source facts relied upon (checked with ``strict=True``): method -> strings its source has.
_SOURCE_FACTS: dict[str, tuple[str, ...]] = {
    # compute_loss routes to _compute_loss (older TRL routed use_liger_kernel elsewhere)
    "compute_loss": ("self._compute_loss(",),
    # the reference model is built only when beta != 0
    # (and compile_generation clears the disable_compile of TRL's generation config)
    "__init__": ("self.beta = args.beta", "self.ref_model = None",
                 "self.generation_config = GenerationConfig(**generation_kwargs, "
                 "disable_compile=True)"),
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
        # placement reward: the rewards of every process, then the process's slice
        "self._calculate_rewards(",
        "advantages = advantages[process_slice]",
    ),
    # bnpo's optimizer-step tokens: the buffered micro-batches, one per micro-step
    "_prepare_inputs": ("self._buffered_inputs[self._step % self.args.steps_per_generation]",),
}


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
