"""The verl version and the verl internals that the plugin :mod:`gbmpo.integrations.verl` hooks:
:data:`SUPPORTED_VERL`, the functions and their parameters, the config fields and the source
facts relied upon, and :func:`check_verl_internals`, which fails loudly naming the one that moved.
Imported by the plugin after its check that verl is installed.
"""

from __future__ import annotations

from typing import Any

import verl
import verl.workers.utils.losses as _verl_losses
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig, PolicyLossConfig

from gbmpo.engines.hosts import check_fields, check_signatures, check_sources

__all__ = ["SUPPORTED_VERL", "VerlInternalsError", "check_verl_internals"]

#: The verl versions whose internals this module was written against and tested with.
SUPPORTED_VERL = ">=0.9,<0.10"
_SUPPORTED_MIN, _SUPPORTED_MAX = (0, 9), (0, 10)


def _verl_version() -> tuple[int, int]:
    parts = str(getattr(verl, "__version__", "0.0")).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):  # pragma: no cover - malformed version string
        return (0, 0)



class VerlInternalsError(RuntimeError):
    """verl's internals that this plugin hooks have moved (a verl outside
    :data:`SUPPORTED_VERL`); the message names the function, field or source fact."""


#: ``module attribute -> parameter names it must accept`` (subset check: new ones are fine).
_HOOKED_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "register_policy_loss": ("name",),
    "get_policy_loss_fn": ("name",),
    "agg_loss": (
        "loss_mat",
        "loss_mask",
        "loss_agg_mode",
        "dp_size",
        "batch_num_tokens",
        "global_batch_size",
        "loss_scale_factor",
    ),
    "kl_penalty": ("logprob", "ref_logprob", "kl_penalty"),
    "kl_penalty_forward": ("logprob", "ref_logprob", "kl_penalty"),
    # the built-in loss our registered ones mirror (their call signature)
    "compute_policy_loss_vanilla": (
        "old_log_prob",
        "log_prob",
        "advantages",
        "response_mask",
        "loss_agg_mode",
        "config",
        "rollout_is_weights",
    ),
}

#: Config dataclass -> fields this module reads.
_CONFIG_FIELDS: dict[type, tuple[str, ...]] = {
    ActorConfig: (
        "clip_ratio",
        "clip_ratio_low",
        "clip_ratio_high",
        "clip_ratio_c",
        "policy_loss",
        "loss_agg_mode",
        "use_kl_loss",
        "kl_loss_type",
        "kl_loss_coef",
        "global_batch_info",
    ),
    PolicyLossConfig: ("loss_mode",),
}

#: Source facts (checked with ``strict=True``): ``(module, function) -> strings its source has``.
_SOURCE_FACTS: dict[tuple[str, str], tuple[str, ...]] = {
    # kl_penalty resolves kl_penalty_forward through core_algos' globals at call time, so
    # wrapping core_algos.kl_penalty_forward reaches every caller of kl_penalty
    ("core_algos", "kl_penalty"): ("kl_penalty_forward(logprob, ref_logprob",),
    # the actor loss: policy loss by name with these keywords, then kl_penalty on the *same*
    # log_prob tensor with the configured type (our old_log_prob hand-over relies on that)
    ("losses", "ppo_loss"): (
        'config.policy_loss.get("loss_mode", "vanilla")',
        "get_policy_loss_fn(loss_mode)",
        "old_log_prob=old_log_prob",
        "log_prob=log_prob",
        "loss_agg_mode=loss_agg_mode",
        "config=config",
        "rollout_is_weights=rollout_is_weights",
        "kl_penalty(logprob=log_prob, ref_logprob=ref_log_prob, kl_penalty=config.kl_loss_type)",
    ),
}


def check_verl_internals(
    algos: Any = core_algos, losses: Any = _verl_losses, *, strict: bool = False
) -> None:
    """Raise :class:`VerlInternalsError` naming the first verl function, parameter, config field
    or source fact this plugin relies on that is missing.

    Always checked: ``core_algos.POLICY_LOSS_REGISTRY`` is a dict; the functions of
    :data:`_HOOKED_FUNCTIONS` exist in ``algos`` (``verl.trainer.ppo.core_algos``) and accept
    those parameters; ``losses.ppo_loss`` exists; the config fields of :data:`_CONFIG_FIELDS`.
    With ``strict=True`` also the source facts of :data:`_SOURCE_FACTS` (``kl_penalty`` calls
    ``kl_penalty_forward`` through the module; ``ppo_loss`` calls the policy loss and then
    ``kl_penalty`` on the same ``log_prob`` with ``config.kl_loss_type``); text checks, run by the
    tests, by ``python -m gbmpo.integrations.verl`` and, as a warning, at the first use of a
    gbmpo name in a process.
    """
    name = getattr(algos, "__name__", "core_algos")
    registry = getattr(algos, "POLICY_LOSS_REGISTRY", None)
    if not isinstance(registry, dict):
        raise VerlInternalsError(
            f"{name}.POLICY_LOSS_REGISTRY is no longer a dict (verl {verl.__version__}); "
            f"gbmpo.integrations.verl registers its losses there (supports verl{SUPPORTED_VERL})"
        )
    context = (
        f"verl {verl.__version__}; gbmpo.integrations.verl hooks it and supports "
        f"verl{SUPPORTED_VERL}"
    )
    check_signatures(
        algos, _HOOKED_FUNCTIONS, error=VerlInternalsError, context=context, owner_name=name
    )
    check_signatures(
        losses,
        {"ppo_loss": ("config", "model_output", "data")},
        error=VerlInternalsError,
        context=context,
        owner_name=getattr(losses, "__name__", "losses"),
    )
    for cls, wanted in _CONFIG_FIELDS.items():
        check_fields(cls, wanted, error=VerlInternalsError, context=context)
    if not strict:
        return
    modules = {"core_algos": algos, "losses": losses}
    facts = {
        f"{getattr(modules[mod], '__name__', mod)}.{fn_name}": (
            getattr(modules[mod], fn_name),
            needles,
        )
        for (mod, fn_name), needles in _SOURCE_FACTS.items()
    }
    check_sources(facts, error=VerlInternalsError, context=context, flatten_whitespace=True)
