"""The training configuration: one typed dataclass tree <-> YAML <-> command-line overrides.

Resolution order: the dataclass defaults (the embedded default run: the tiny model on the
``arithmetic`` task with Dr. GRPO + ProbL2), then a YAML file (``--config FILE``), then
command-line overrides (``--optim.lr 1e-4`` or an alias such as ``--lr 1e-4``). Every step
checks keys and types and names the offending key by its dotted path::

    ConfigError: unknown key 'optim.learning_rate'; valid keys under 'optim': lr, warmup_steps, ...
    ConfigError: 'rollout.num_generations' must be int, got str 'eight'

:func:`validate` then checks values and names against the registries (advantages, surrogates,
regularizers, aggregations, tasks), building each objective once so that a wrong parameter is
reported before any run directory is created or any model is loaded.

The package's modules: :mod:`~gbmpo.config.schema` (the dataclass tree, its defaults and
aliases), :mod:`~gbmpo.config.convert` (dicts and YAML), :mod:`~gbmpo.config.overrides`
(command-line overrides, :func:`load_config`) and :mod:`~gbmpo.config.checks`
(:func:`validate`); the names below are its API.
"""

from __future__ import annotations

from gbmpo.config.checks import validate
from gbmpo.config.convert import (
    config_from_dict,
    config_to_dict,
    dump_yaml,
    rename_old_keys,
)
from gbmpo.config.overrides import (
    annotation_at,
    apply_overrides,
    canonical_key,
    leaf_keys,
    load_config,
)
from gbmpo.config.schema import (
    ALIASES,
    RENAMED_KEYS,
    REPORTERS,
    TRAIN_ENGINES,
    ConfigError,
    EvalConfig,
    LoraSettings,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
    TrainConfig,
)

__all__ = [
    "ALIASES",
    "ConfigError",
    "EvalConfig",
    "LoraSettings",
    "ModelConfig",
    "OptimConfig",
    "RENAMED_KEYS",
    "REPORTERS",
    "RolloutConfig",
    "RunConfig",
    "TRAIN_ENGINES",
    "TaskConfig",
    "TrainConfig",
    "annotation_at",
    "apply_overrides",
    "canonical_key",
    "config_from_dict",
    "config_to_dict",
    "leaf_keys",
    "dump_yaml",
    "load_config",
    "rename_old_keys",
    "validate",
]
