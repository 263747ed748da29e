"""Training: the typed configuration, the RL trainer and its run directory."""

from gbmpo.train.config import (
    ConfigError,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    dump_yaml,
    load_config,
    validate,
)
from gbmpo.train.rewards import RewardError, score_completions
from gbmpo.train.trainer import DataError, PromptSampler, Trainer, dry_run, train

__all__ = [
    "ConfigError",
    "DataError",
    "PromptSampler",
    "RewardError",
    "TrainConfig",
    "Trainer",
    "config_from_dict",
    "config_to_dict",
    "dry_run",
    "dump_yaml",
    "load_config",
    "score_completions",
    "train",
    "validate",
]
