"""Stopping a run on a signal: SIGTERM (a cluster scheduler's notice before it preempts a job)
and SIGINT (Ctrl-C).

:class:`StopSignals` replaces the handlers of both for the length of a ``with`` block. The first
signal only records itself (:attr:`StopSignals.requested`): the training loop finishes the
optimizer step under way, writes a checkpoint and raises :class:`RunStopped`, whose message is
the one line the command line prints (the checkpoint and the resume command). A second signal
raises :class:`RunStopped` at once (``now=True``) wherever the process is; the last complete
checkpoint is kept. The exit codes are the shell's for a death by the signal: 143 (SIGTERM),
130 (SIGINT).

States written to ``status.json``: ``preempted`` (SIGTERM) and ``interrupted`` (SIGINT).
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = [
    "EXIT_CODES",
    "STATES",
    "STOP_FILE",
    "RunStopped",
    "StopSignals",
    "forwarding",
    "handling",
    "resume_command",
    "stop_file",
]

#: the signals a run stops on, and the process exit code for each (128 + signal number)
EXIT_CODES = {"SIGTERM": 143, "SIGINT": 130}

#: the ``status.json`` state for each
STATES = {"SIGTERM": "preempted", "SIGINT": "interrupted"}

#: a second signal sooner than this after the first is the same notice delivered twice (a
#: scheduler that signals every process of a job, a launcher that forwards it), not a second one
REPEAT_SECONDS = 1.0

#: the file a parent process writes into the run directory to ask its workers to stop
STOP_FILE = ".gbmpo.stop"


def stop_file(run_dir: str | Path) -> Path:
    """``<run_dir>/.gbmpo.stop``: holds the signal name a launching process received."""
    return Path(run_dir) / STOP_FILE


def resume_command(run_dir: str | Path) -> str:
    """The command that continues ``run_dir``."""
    return f"gbmpo train --resume {shlex.quote(str(run_dir))}"


class RunStopped(BaseException):  # noqa: N818 - like KeyboardInterrupt: not an error
    """A run stopped on a signal. ``str()`` is the one line to print; :attr:`exit_code` is 143
    (SIGTERM) or 130 (SIGINT).

    A ``BaseException`` (as ``KeyboardInterrupt``), so that ``except Exception`` in user code
    does not swallow it."""

    def __init__(
        self,
        signame: str,
        *,
        now: bool = False,
        step: int | None = None,
        checkpoint: str | Path | None = None,
        run_dir: str | Path | None = None,
    ) -> None:
        self.signame, self.now, self.step = signame, now, step
        self.checkpoint = None if checkpoint is None else str(checkpoint)
        self.run_dir = None if run_dir is None else str(run_dir)
        super().__init__(self.message())

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signame, 1)

    @property
    def state(self) -> str:
        return STATES.get(self.signame, "interrupted")

    def message(self) -> str:
        how = "at once on a second signal" if self.now else "after step"
        head = f"stopped ({self.state}, {self.signame}) {how}"
        if not self.now and self.step is not None:
            head += f" {self.step}"
        elif self.step is not None:
            head += f" during step {self.step + 1}"
        if self.run_dir is None:
            return head
        if self.checkpoint is None:
            return f"{head}; no checkpoint in {self.run_dir}: resuming is not possible"
        return f"{head}; checkpoint {self.checkpoint}; resume with: {resume_command(self.run_dir)}"

    def complete(self, *, step: int | None, checkpoint: str | Path | None,
                 run_dir: str | Path) -> RunStopped:  # fmt: skip
        """This stop with the run's step, checkpoint and directory filled in."""
        return RunStopped(self.signame, now=self.now, step=step, checkpoint=checkpoint,
                          run_dir=run_dir)  # fmt: skip


class StopSignals:
    """``with StopSignals() as stop:`` — SIGTERM and SIGINT recorded instead of ending the
    process (the handlers before are restored at the end). ``stop.requested`` is the first
    signal's name (``None`` until one came); a second one (at least :data:`REPEAT_SECONDS`
    later) raises :class:`RunStopped` ``(now=True)``. ``run_dir``: also counts as a request a
    :data:`STOP_FILE` there (written by the process that launched this one).

    Outside the main thread (where Python cannot install handlers) nothing is replaced and only
    the stop file is watched."""

    def __init__(self, run_dir: str | Path | None = None, *, immediate_second: bool = True) -> None:
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.requested: str | None = None
        self.immediate_second = immediate_second
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested, self._first_at = name, time.monotonic()
            return
        if self.immediate_second and time.monotonic() - self._first_at >= REPEAT_SECONDS:
            raise RunStopped(self.requested, now=True)

    def poll(self) -> str | None:
        """The requested stop: a signal received, or the stop file's signal."""
        if self.requested is None and self.run_dir is not None:
            path = stop_file(self.run_dir)
            with contextlib.suppress(OSError):
                name = path.read_text().strip()
                self.requested = name if name in EXIT_CODES else "SIGTERM"
                self._first_at = time.monotonic()
        return self.requested

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@contextlib.contextmanager
def forwarding(run_dir: Path, on_second: Any) -> Iterator[StopSignals]:
    """For a process that launched workers on ``run_dir``: the first signal writes
    :data:`STOP_FILE` (the workers stop after their step), a second calls ``on_second()``
    (e.g. kills them) and raises :class:`RunStopped` ``(now=True)``."""
    stop = StopSignals(immediate_second=False)

    def handle(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stop.requested is None:
            stop.requested, stop._first_at = name, time.monotonic()
            with contextlib.suppress(OSError):
                stop_file(run_dir).write_text(name + "\n")
            return
        if time.monotonic() - stop._first_at >= REPEAT_SECONDS:
            on_second()
            raise RunStopped(stop.requested, now=True)

    try:
        with handling(handle):
            yield stop
    finally:
        with contextlib.suppress(OSError):
            stop_file(run_dir).unlink()


@contextlib.contextmanager
def handling(handler: Callable[[int, FrameType | None], Any]) -> Iterator[None]:
    """``handler`` for SIGTERM and SIGINT for the length of the block, the handlers before
    restored after it; outside the main thread (where Python cannot install handlers) nothing
    changes."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
