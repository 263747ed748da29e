"""Training: the RL trainer (own engine) and its run directory; the configuration it reads is
:mod:`gbmpo.config` (re-exported here: ``load_config``, ``TrainConfig``, ...)."""

from gbmpo.config import (
    ConfigError,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    dump_yaml,
    load_config,
    validate,
)
from gbmpo.train.batching import DataError, PromptSampler
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
