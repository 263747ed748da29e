"""SIGTERM / SIGINT on ``--engine trl`` (:mod:`gbmpo.io.stop`).

While it trains, every process catches the signals and watches the run directory's stop file
(:meth:`gbmpo.lifecycle.RunLifecycle.catching`). At the end of each RL step the processes agree
(a maximum over them) whether any was asked to stop — by a signal of its own or by the stop file
the launching ``gbmpo train`` writes when it gets the signal (``accelerate launch`` starts the
workers in sessions of their own, so the terminal's Ctrl-C and a ``kill`` of ``gbmpo train``
reach only it). If so, TRL saves a checkpoint at that step (gbmpo completes it as any other) and
stops; the run's :class:`gbmpo.lifecycle.RunLifecycle` records the stop in ``status.json``
(``preempted`` / ``interrupted``, the step, the checkpoint; the main process writes it) and
:class:`gbmpo.io.RunStopped` is raised. A second signal stops at once: in one process where it
is, with several processes by a SIGKILL of the launcher (the workers die with it); the newest
complete checkpoint is kept.
"""

from __future__ import annotations

from typing import Any

from gbmpo.engines.trl.callbacks import all_reduce
from gbmpo.lifecycle import RunLifecycle

__all__ = ["StopCallback"]

_CODES = {"SIGTERM": 1.0, "SIGINT": 2.0}
_NAMES = {v: k for k, v in _CODES.items()}


class StopCallback:
    """The TRL callback that stops after the RL step during which a stop was asked for (every
    process at the same step) with a checkpoint of that step, and keeps ``status.json``'s step
    current (:class:`gbmpo.lifecycle.RunLifecycle`: the main process writes it)."""

    def __init__(self, life: RunLifecycle, k: int) -> None:
        self.life, self.k = life, k
        self.signame: str | None = None  # the agreed stop

    def as_trainer_callback(self) -> Any:
        # deferred: transformers is heavy; loaded only when TRL trains
        from transformers import TrainerCallback

        outer = self

        class Callback(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step % outer.k:
                    return
                stop = outer.life.stop
                asked = stop.poll() if stop is not None else None
                code = all_reduce(_CODES.get(asked, 0.0) if asked else 0.0, "max")
                if code:
                    outer.signame = _NAMES[code]
                    if stop is not None:
                        stop.immediate_second = True
                    control.should_save = True
                    control.should_training_stop = True
                else:
                    outer.life.running(state.global_step // outer.k)

        return Callback()
