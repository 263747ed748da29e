"""Run-directory input/output shared by training, ES and the experiment grid (see
:mod:`gbmpo.io.run_dir`)."""

from gbmpo.io.run_dir import (
    LOCK_FILE,
    CheckpointError,
    RunDirInUseError,
    RunLock,
    atomic_path,
    file_sha256,
    is_nonempty,
    newest_intact,
    root_cause,
    write_atomic,
    write_json_atomic,
)
from gbmpo.io.stop import EXIT_CODES, RunStopped, StopSignals, resume_command

__all__ = [
    "EXIT_CODES",
    "RunStopped",
    "StopSignals",
    "resume_command",
    "LOCK_FILE",
    "CheckpointError",
    "RunDirInUseError",
    "RunLock",
    "atomic_path",
    "file_sha256",
    "is_nonempty",
    "newest_intact",
    "root_cause",
    "write_atomic",
    "write_json_atomic",
]
