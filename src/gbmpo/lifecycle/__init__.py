"""The run's lifecycle, shared by every engine: the run directory, its lock, ``status.json``,
``summary.json``, SIGTERM / SIGINT (:class:`RunLifecycle`, :mod:`gbmpo.lifecycle.core`); the
metrics log (:mod:`gbmpo.lifecycle.logging`) and the console (:mod:`gbmpo.lifecycle.console`)."""

from gbmpo.lifecycle.core import (
    CONFIG_FILE,
    MODEL_DIR,
    RESUMABLE_OVERRIDES,
    STATUS_FILE,
    STATUS_KEYS,
    STATUSES,
    SUMMARY_FILE,
    RunLifecycle,
    check_not_in_use,
    default_run_dir,
    no_checkpoint_error,
    read_status,
    refuse_nonempty,
    resume_config,
    write_status,
)

__all__ = [
    "CONFIG_FILE",
    "MODEL_DIR",
    "RESUMABLE_OVERRIDES",
    "STATUSES",
    "STATUS_FILE",
    "STATUS_KEYS",
    "SUMMARY_FILE",
    "RunLifecycle",
    "check_not_in_use",
    "default_run_dir",
    "no_checkpoint_error",
    "read_status",
    "refuse_nonempty",
    "resume_config",
    "write_status",
]
