"""The ES outer loop: step, checkpoint, export, report; resumable after a kill.

:func:`run_es_loop` calls :func:`gbmpo.meta.es.es_step` until ``config.iterations`` iterations are
done, saving ``es_state.json`` (+ the parameter tensor file) after every iteration. With
``resume=True`` it reloads the saved state and continues the same trajectory: the perturbation
generator's state is part of the checkpoint, so K iterations in one go and K/2 + resume + K/2
give bit-identical parameters and history (up to the recorded wall times).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gbmpo.io import RunLock, atomic_path
from gbmpo.meta.backends import Backend
from gbmpo.meta.checkpoint import STATE_FILE, load_state, save_state
from gbmpo.meta.es import ESConfig, ESState, es_step, init_state

__all__ = [
    "MIRROR_FILE",
    "export_mirror_map",
    "format_iteration",
    "run_es_loop",
]

#: file name of the exported mirror map inside the ES output directory
MIRROR_FILE = "best_mirror.json"

FitnessFn = Callable[[np.ndarray], float]


def export_mirror_map(state: ESState, path: str | Path) -> Path:
    """Save the current ES parameters as a convex :class:`NeuralMirrorMap` (JSON, ``save``).

    The current theta is the last accepted point ("restart from best"); the file loads with
    ``NeuralMirrorMap.load`` and is what ``gbmpo train --regularizer neural_mirror`` takes.
    """
    # deferred: gbmpo.objectives imports torch; ES's workers import gbmpo.meta without it
    from gbmpo.objectives.mirror import NeuralMirrorMap

    # written aside and renamed: a kill never leaves a half-written map under the real name
    path = Path(path)
    with atomic_path(path) as tmp:
        NeuralMirrorMap.from_unconstrained(state.theta).save(tmp)
    return path


def _fmt(x: float | None) -> str:
    return "   n/a" if x is None else f"{x:.4f}"


def format_iteration(entry: dict[str, Any]) -> str:
    """One line per iteration: fitness mean/std/min/max, failures, decision, best so far."""
    return (
        f"iter {entry['iteration']:3d}  sigma {entry['sigma']:.3g}  "
        f"fitness mean {_fmt(entry['fitness_mean'])} std {_fmt(entry['fitness_std'])} "
        f"min {_fmt(entry['fitness_min'])} max {_fmt(entry['fitness_max'])}  "
        f"members {entry['n_members']} (elites {entry['n_elites']}, failed {entry['n_failed']})  "
        f"{entry['decision'].upper()}  best {_fmt(entry['best_fitness'])}  "
        f"[{entry['eval_seconds']:.1f}s]"
    )


def _check_resume_config(saved: dict[str, Any], config: ESConfig) -> None:
    """Everything but ``iterations`` must match the saved run (else it is another trajectory)."""
    ours = config.to_dict()
    diff = sorted(k for k in ours if k != "iterations" and saved.get(k) != ours[k])
    if diff:
        detail = ", ".join(f"{k}: saved {saved.get(k)!r} vs now {ours[k]!r}" for k in diff)
        raise ValueError(f"cannot resume: the ES config differs from the saved run ({detail})")


def run_es_loop(
    fitness: FitnessFn,
    backend: Backend,
    config: ESConfig,
    output_dir: str | Path,
    *,
    theta0: np.ndarray | None = None,
    resume: bool = False,
    metadata: dict[str, Any] | None = None,
    export: Callable[[ESState, Path], Any] | None = None,
    on_iteration: Callable[[ESState, dict[str, Any]], None] | None = None,
    stop_after: int | None = None,
) -> ESState:
    """Run (or resume) ES until ``config.iterations`` iterations are done; returns the state.

    ``fitness`` is evaluated on ``backend``; ``metadata`` is stored in ``es_state.json`` (under
    ``"run"``) together with the ES config; ``export(state, output_dir)`` runs after every
    checkpoint (e.g. :func:`export_mirror_map`); ``on_iteration(state, history_entry)`` after
    every iteration (printing). ``stop_after`` ends this call after that many iterations (the
    run stays resumable), which is how tests simulate a kill.
    """
    out = Path(output_dir)
    if resume and not (out / STATE_FILE).is_file():
        load_state(out)  # the "nothing to resume" error, before any directory is created
    with RunLock(out, "ES output"):  # one process per output directory
        return _run_es_loop(
            fitness, backend, config, out, theta0=theta0, resume=resume, metadata=metadata,
            export=export, on_iteration=on_iteration, stop_after=stop_after,
        )


def _run_es_loop(
    fitness: FitnessFn,
    backend: Backend,
    config: ESConfig,
    out: Path,
    *,
    theta0: np.ndarray | None,
    resume: bool,
    metadata: dict[str, Any] | None,
    export: Callable[[ESState, Path], Any] | None,
    on_iteration: Callable[[ESState, dict[str, Any]], None] | None,
    stop_after: int | None,
) -> ESState:
    if resume:
        state, doc = load_state(out)
        _check_resume_config(doc.get("es_config", {}), config)
        if export is not None:  # a kill may have come between the state and the export
            export(state, out)
    else:
        if theta0 is None:
            raise ValueError("theta0 is required to start a new ES run (or pass resume=True)")
        if (out / STATE_FILE).exists():
            raise FileExistsError(
                f"{out / STATE_FILE} exists: resume it (--resume) or choose another output dir"
            )
        state = init_state(theta0, config)
        save_state(state, out, es_config=config.to_dict(), run=metadata or {})
        if export is not None:
            export(state, out)
    done_here = 0
    while state.iteration < config.iterations:
        if stop_after is not None and done_here >= stop_after:
            break
        state = es_step(state, lambda thetas: backend.evaluate(fitness, thetas), config)
        done_here += 1
        save_state(state, out, es_config=config.to_dict(), run=metadata or {})
        if export is not None:
            export(state, out)
        if on_iteration is not None:
            on_iteration(state, state.history[-1])
    return state


def summary(state: ESState) -> dict[str, Any]:
    """Small dict for reports: iterations, accepted count, best fitness, failures."""
    return {
        "iterations": state.iteration,
        "accepted": sum(1 for h in state.history if h["accepted"]),
        "best_fitness": state.best_fitness if math.isfinite(state.best_fitness) else None,
        "failed_members": sum(h["n_failed"] for h in state.history),
    }
