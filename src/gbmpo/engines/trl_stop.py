"""SIGTERM / SIGINT on ``--engine trl`` (:mod:`gbmpo.io.stop`).

Every process installs :class:`gbmpo.io.StopSignals` on the run directory. At the end of each
RL step the processes agree (a maximum over them) whether any was asked to stop — by a signal
of its own or by the stop file the launching ``gbmpo train`` writes when it gets the signal
(``accelerate launch`` starts the workers in sessions of their own, so the terminal's Ctrl-C and
a ``kill`` of ``gbmpo train`` reach only it). If so, TRL saves a checkpoint at that step (gbmpo
completes it as any other) and stops; the main process writes ``status.json``
(``preempted`` / ``interrupted``, the step, the checkpoint) and :class:`gbmpo.io.RunStopped`
is raised. A second signal stops at once: in one process where it is, with several processes by
a SIGKILL of the launcher (the workers die with it); the newest complete checkpoint is kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gbmpo.engines.trl_callbacks import all_reduce
from gbmpo.engines.trl_checkpoints import latest_valid_checkpoint
from gbmpo.io import RunStopped, StopSignals, resume_command

__all__ = ["StopCallback", "mark_failed", "stopped_run", "write_running"]

_CODES = {"SIGTERM": 1.0, "SIGINT": 2.0}
_NAMES = {v: k for k, v in _CODES.items()}


def write_running(run_dir: Path, step: int, main: bool) -> None:
    """``status.json`` ``running`` at RL step ``step`` (main process)."""
    if main:
        from gbmpo.train.run import write_status

        write_status(run_dir, "running", step, engine="trl")


def mark_failed(run_dir: Path, err: BaseException) -> None:
    """``status.json`` ``failed`` (``interrupted`` for a Ctrl-C outside a step), with the error,
    when a run that said ``running`` ends on an exception (main process: the one that wrote
    ``running``). A stop on a signal has written its own status and is left as it is."""
    import contextlib
    import json

    from gbmpo.train.run import STATUS_FILE, write_status

    if isinstance(err, RunStopped):
        return
    path = Path(run_dir) / STATUS_FILE
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):  # not started (no status yet), or not this process's file
        return
    if not isinstance(status, dict) or status.get("status") != "running":
        return
    kind = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
    with contextlib.suppress(OSError):  # e.g. a full disk: the original error is reported
        write_status(run_dir, kind, int(status.get("step") or 0), engine="trl",
                     error=f"{type(err).__name__}: {err}")  # fmt: skip


class StopCallback:
    """The TRL callback that stops after the RL step during which a stop was asked for (every
    process at the same step) with a checkpoint of that step, and keeps ``status.json``'s step
    current."""

    def __init__(self, stop: StopSignals, k: int, run_dir: Path, main: bool) -> None:
        self.stop, self.k, self.run_dir, self.main = stop, k, run_dir, main
        self.signame: str | None = None  # the agreed stop

    def as_trainer_callback(self) -> Any:
        from transformers import TrainerCallback

        outer = self

        class Callback(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step % outer.k:
                    return
                asked = outer.stop.poll()
                code = all_reduce(_CODES.get(asked, 0.0) if asked else 0.0, "max")
                if code:
                    outer.signame = _NAMES[code]
                    outer.stop.immediate_second = True
                    control.should_save = True
                    control.should_training_stop = True
                else:
                    write_running(outer.run_dir, state.global_step // outer.k, outer.main)

        return Callback()


def stopped_run(err: RunStopped | None, signame: str | None, step: int, run_dir: Path,
                main: bool) -> RunStopped:  # fmt: skip
    """The :class:`RunStopped` of a run stopped after RL step ``step`` (``signame``) or at once
    (``err``), with the newest complete checkpoint; the main process writes status.json."""
    from gbmpo.train.run import write_status

    found = latest_valid_checkpoint(run_dir, log=lambda _: None)
    if err is not None:
        stopped = err.complete(step=step, checkpoint=found, run_dir=run_dir)
    else:
        assert signame is not None
        stopped = RunStopped(signame, step=step, checkpoint=found, run_dir=run_dir)
    if main:
        write_status(run_dir, stopped.state, step, engine="trl", signal=stopped.signame,
                     checkpoint=None if found is None else str(found),
                     resume=resume_command(run_dir),
                     **({"stopped": "at once"} if stopped.now else {}))  # fmt: skip
    return stopped
