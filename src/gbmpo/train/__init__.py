"""Training: the typed configuration, the RL trainer and its run directory."""

from gbmpo.train.batching import DataError, PromptSampler
from gbmpo.train.config import (
    ConfigError,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    dump_yaml,
    load_config,
    validate,
)
from gbmpo.train.dry_run import dry_run
from gbmpo.train.trainer import Trainer, train

__all__ = [
    "ConfigError",
    "DataError",
    "PromptSampler",
    "TrainConfig",
    "Trainer",
    "config_from_dict",
    "config_to_dict",
    "dry_run",
    "dump_yaml",
    "load_config",
    "train",
    "validate",
]
