"""One run's lifecycle, the same on every engine (:class:`RunLifecycle`).

A run directory holds ``config.yaml``, ``status.json``, ``metrics.jsonl``, ``checkpoints/``, the
final ``model/`` and, written last, ``summary.json`` (only a finished run has it). Every engine's
runner (the own trainer's :meth:`gbmpo.train.Trainer.train`, :mod:`gbmpo.engines.trl.runner`,
:mod:`gbmpo.engines.verl.runner`) goes through :class:`RunLifecycle`, which owns:

* the lock: one process per run directory (:class:`gbmpo.io.RunLock`, taken before anything is
  written, removed when the run ends however it ends); a fresh run needs an empty directory
  (checked under the lock), a resumed one must not be finished;
* ``status.json`` (:func:`write_status`): every write has the keys :data:`STATUS_KEYS`, with
  ``None`` where a key does not apply, on every engine;
* the signals: SIGTERM / SIGINT are recorded (:class:`gbmpo.io.StopSignals`); the engine stops
  after its step with a checkpoint and calls :meth:`RunLifecycle.stopped`; a second signal
  stops at once and the lifecycle fills in the step and the newest checkpoint from its hooks;
  :class:`gbmpo.io.RunStopped` carries the one line and the exit code (143 / 130);
* a run that ends on an exception: ``failed`` (``interrupted`` for a Ctrl-C outside a step)
  with the error, when ``status.json`` said ``running``;
* the end: :meth:`RunLifecycle.finished` writes ``summary.json``, then ``finished``.

The engine supplies the hooks (:attr:`RunLifecycle.step`, :attr:`RunLifecycle.checkpoint`):
where it is and its newest complete checkpoint, read when a stop must be recorded.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from gbmpo.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    canonical_key,
    config_from_dict,
)
from gbmpo.io import (
    CheckpointError,
    RunLock,
    RunStopped,
    StopSignals,
    is_nonempty,
    resume_command,
    write_json_atomic,
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
    "default_run_dir",
    "no_checkpoint_error",
    "read_status",
    "refuse_nonempty",
    "resume_config",
    "write_status",
]

CONFIG_FILE = "config.yaml"

STATUS_FILE = "status.json"

SUMMARY_FILE = "summary.json"

MODEL_DIR = "model"

#: the config keys ``gbmpo train --resume DIR`` may change (the execution, not the experiment)
RESUMABLE_OVERRIDES = (
    "run.steps",
    "run.time_budget_seconds",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.report_to",
    "run.num_threads",
    "run.keep_freed_memory",
    "run.progress",
    "run.allow_unsandboxed_code",
)

#: ``status.json``'s ``status``: ``running``, ``finished``, ``failed`` (an exception),
#: ``interrupted`` (SIGINT, or a Ctrl-C outside a step), ``preempted`` (SIGTERM)
STATUSES = ("running", "finished", "failed", "interrupted", "preempted")

#: the keys of every ``status.json``, on every engine (``None`` where one does not apply):
#: ``status`` (:data:`STATUSES`), ``step`` (RL steps done), ``updated`` (local time, seconds),
#: ``engine`` (gbmpo / trl / verl), ``resumed_from`` (the checkpoint this part of the run
#: started from; ``None`` for a fresh run or a restart), ``error`` (``failed`` /
#: ``interrupted`` by an exception: ``"<type>: <message>"``), and for a stop on a signal
#: ``signal`` (SIGTERM / SIGINT), ``stopped`` (``"after step"``: the step under way finished
#: and was checkpointed, or ``"at once"``: a second signal), ``checkpoint`` (the newest complete
#: checkpoint, which a resume continues from; ``None``: none) and ``resume`` (the command)
STATUS_KEYS = ("status", "step", "updated", "engine", "resumed_from", "error", "signal",
               "stopped", "checkpoint", "resume")  # fmt: skip


def check_not_in_use(run_dir: str | Path) -> None:
    """Refuse (:class:`~gbmpo.io.RunDirInUseError`, as :class:`RunLifecycle` would) a run
    directory another process holds now, creating nothing: a probe for engines whose own checks
    come before the lifecycle and take seconds (TRL's import). The lifecycle's lock still
    decides."""
    RunLock(run_dir).check_free()


def default_run_dir(cfg: TrainConfig, root: str | Path = "runs") -> Path:
    """``runs/<YYYYmmdd-HHMMSS>-<regularizer>`` (suffixed if it already exists)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{stamp}-{cfg.objective.regularizer_label}"
    path, k = base, 1
    while path.exists():
        path, k = Path(f"{base}-{k}"), k + 1
    return path


def refuse_nonempty(path: Path) -> None:
    """:class:`ConfigError` when ``path`` holds anything (a new run needs an empty directory)."""
    if is_nonempty(path):
        raise ConfigError(
            f"output directory {str(path)!r} already exists and is not empty; "
            "resume it with `gbmpo train --resume DIR` or choose another --output-dir"
        )


def resume_config(
    run_dir: str | Path, overrides: list[tuple[str, Any]] | None = None
) -> tuple[TrainConfig, Path]:
    """The configuration of the unfinished run ``run_dir`` (its config.yaml; only the keys in
    :data:`RESUMABLE_OVERRIDES` may be overridden) and its path."""
    path = Path(run_dir)
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(f"cannot resume {str(run_dir)!r}: no {CONFIG_FILE} in it")
    if (path / SUMMARY_FILE).is_file():
        raise ConfigError(f"cannot resume {str(run_dir)!r}: the run already finished")
    data = yaml.safe_load((path / CONFIG_FILE).read_text())
    for key, _ in overrides or []:
        if canonical_key(key) not in RESUMABLE_OVERRIDES:
            raise ConfigError(
                f"cannot change {canonical_key(key)!r} when resuming; only "
                f"{', '.join(RESUMABLE_OVERRIDES)} may change"
            )
    apply_overrides(data, overrides or [])
    cfg = config_from_dict(data)
    cfg.run.output_dir = str(path)
    return cfg, path


def no_checkpoint_error(run_dir: str | Path) -> CheckpointError:
    """What ``gbmpo train --resume DIR`` says (exit 1, nothing changed) about a run that has no
    checkpoint to continue from."""
    return CheckpointError(
        f"cannot resume {str(run_dir)!r}: it has no checkpoint (it stopped before its first); "
        f"start it over in the same directory with `{resume_command(run_dir)} --restart`"
    )


def write_status(run_dir: str | Path, status: str, step: int, *, engine: str,
                 **extra: Any) -> dict[str, Any]:  # fmt: skip
    """Write ``status.json`` atomically: every key of :data:`STATUS_KEYS`, ``extra`` filling
    those after ``engine`` (the rest ``None``). Returns what was written. ``ValueError`` for a
    status not in :data:`STATUSES` or a key not in :data:`STATUS_KEYS`."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r} is not one of {', '.join(STATUSES)}")
    unknown = sorted(set(extra) - set(STATUS_KEYS[4:]))
    if unknown:
        raise ValueError(f"status.json has no key {unknown[0]!r}; its keys: {STATUS_KEYS}")
    record: dict[str, Any] = {
        "status": status,
        "step": int(step),
        "updated": _dt.datetime.now().isoformat(timespec="seconds"),
        "engine": engine,
        **{key: extra.get(key) for key in STATUS_KEYS[4:]},
    }
    write_json_atomic(Path(run_dir) / STATUS_FILE, record)
    return record


def read_status(run_dir: str | Path) -> dict[str, Any] | None:
    """``status.json`` of ``run_dir``, or ``None`` where there is none (or it is unreadable)."""
    try:
        status = json.loads((Path(run_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


def _no_checkpoint() -> Path | None:
    return None


class RunLifecycle:
    """``with RunLifecycle(run_dir, engine) as life:`` — one run (or one resumed part of it) on
    ``run_dir`` (see the module docstring).

    On entering: the lock (``lock``), then for a fresh run (not ``resuming``) the empty-directory
    check, for a resumed one the finished check; with ``signals`` SIGTERM / SIGINT are recorded
    (:attr:`stop`; ``stop_file``: the stop file a launching process writes counts too). Inside,
    the engine calls :meth:`running` once it trains (and after each step, to keep the step
    current), :meth:`stopped` when it stops after a step on a signal, :meth:`finished` at the
    end. On leaving: a second signal's :class:`RunStopped` is completed with the hooks and
    recorded; any other exception, while ``status.json`` says ``running`` (written by this part
    of the run), becomes ``failed`` / ``interrupted`` with the error; the signal handlers and
    the lock are released.

    ``main``: whether this process writes ``status.json`` (the main process of several).
    Hooks, read when a stop is recorded: :attr:`step` (RL steps done) and :attr:`checkpoint`
    (the newest complete checkpoint, ``None``: none).
    """

    def __init__(
        self,
        run_dir: str | Path,
        engine: str,
        *,
        resuming: bool = False,
        lock: bool = True,
        signals: bool = False,
        stop_file: bool = False,
        main: bool = True,
        step: Callable[[], int] | None = None,
        checkpoint: Callable[[], Path | None] = _no_checkpoint,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.engine = engine
        self.resuming = resuming
        self.main = main
        self.step: Callable[[], int] = step or self._status_step
        self.checkpoint: Callable[[], Path | None] = checkpoint
        self.resumed_from: str | None = None
        self.stop: StopSignals | None = None
        self._lock = RunLock(self.run_dir) if lock else None
        self._signals = signals
        self._stop_file = stop_file
        self._exit = contextlib.ExitStack()
        self._before: dict[str, Any] | None = None  # status.json as this part found it

    # -- hooks' defaults

    def _status_step(self) -> int:
        status = read_status(self.run_dir)
        return int((status or {}).get("step") or 0)

    # -- entering and leaving

    def __enter__(self) -> RunLifecycle:
        if self._lock is not None:
            self._lock.acquire()
        self._before = read_status(self.run_dir)
        try:
            if self._lock is not None and not self.resuming:
                refuse_nonempty(self.run_dir)  # checked again under the lock
            if self.resuming and (self.run_dir / SUMMARY_FILE).is_file():
                raise ConfigError(f"cannot resume {str(self.run_dir)!r}: the run already finished")
            if self._signals:
                self._exit.enter_context(self.catching())
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        try:
            if isinstance(err, RunStopped):
                self._record_stop(err)
            elif err is not None:
                self._record_error(err)
        finally:
            self._exit.close()
            if self._lock is not None:
                self._lock.release()

    @contextlib.contextmanager
    def catching(self) -> Iterator[StopSignals]:
        """SIGTERM / SIGINT recorded (:attr:`stop`) for the length of the block, for an engine
        that catches them only while it trains (``signals=True``: the whole run)."""
        with StopSignals(self.run_dir if self._stop_file else None) as stop:
            self.stop = stop
            try:
                yield stop
            finally:
                self.stop = None

    def _record_stop(self, err: RunStopped) -> None:
        if err.run_dir is not None:  # raised by the engine, which recorded it (or a worker did)
            status = read_status(self.run_dir) if self.main else None
            if status is not None and status.get("status") == "running":
                self._write_stop(err)
            return
        # a second signal, raised where the process was: the newest complete checkpoint is what
        # a resume continues from
        step = self.step()
        found = self.checkpoint()
        stopped = err.complete(step=step, checkpoint=found, run_dir=self.run_dir)
        with contextlib.suppress(OSError):
            self._write_stop(stopped)
        raise stopped from None

    def _record_error(self, err: BaseException) -> None:
        if not self.main:
            return
        status = read_status(self.run_dir)
        if status is None or status.get("status") != "running" or status == self._before:
            # not started (nothing to say; a "running" left by a killed part of the run
            # stays as it was), or already ended
            return
        kind = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        with contextlib.suppress(OSError):  # e.g. a full disk: the original error is reported
            self._write(kind, int(status.get("step") or 0), error=f"{type(err).__name__}: {err}")

    # -- the states

    def _write(self, status: str, step: int, **extra: Any) -> None:
        if self.main:
            write_status(self.run_dir, status, step, engine=self.engine,
                         resumed_from=self.resumed_from, **extra)  # fmt: skip

    def running(self, step: int, *, resumed_from: str | Path | None = None) -> None:
        """``running`` at ``step``; the first call names the checkpoint this part started from
        (kept in every later status)."""
        if resumed_from is not None:
            self.resumed_from = str(resumed_from)
        self._write("running", step)

    def stopped(self, signame: str, step: int, checkpoint: str | Path | None, *,
                now: bool = False, kind: type[RunStopped] = RunStopped) -> RunStopped:  # fmt: skip
        """The stop on ``signame`` after ``step`` (``now``: at once, the step under way not
        finished) with ``checkpoint``, the newest complete one, recorded; the engine raises it
        (``kind``: an engine's own message)."""
        stopped = kind(signame, now=now, step=step, checkpoint=checkpoint, run_dir=self.run_dir)
        self._write_stop(stopped)
        return stopped

    def _write_stop(self, err: RunStopped) -> None:
        self._write(err.state, int(err.step or 0), signal=err.signame,
                    stopped="at once" if err.now else "after step", checkpoint=err.checkpoint,
                    resume=resume_command(self.run_dir))  # fmt: skip

    def finished(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write ``summary.json`` (last of the run's files: the run is finished), then
        ``status.json`` ``finished`` at the summary's ``steps``. Returns ``summary``."""
        if self.main:
            write_json_atomic(self.run_dir / SUMMARY_FILE,
                              json.loads(json.dumps(summary, default=str)))  # fmt: skip
            self._write("finished", int(summary.get("steps") or 0))
        return summary
