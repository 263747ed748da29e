"""Save and load the ES state: ``es_state.json`` plus one safetensors file of parameters.

Layout of an ES output directory::

    es_state.json               iteration, best_fitness, history, elites' fitness, rng state,
                                the ES config and whatever run metadata the caller adds
    theta/iter_0003.safetensors theta [d] and elite_deltas [m, d] (float64) after 3 iterations

    es_state.prev.json          the state before the last one (its tensor file is kept too)

The tensor file of each iteration is written first under a new name, then the current
``es_state.json`` is copied to ``es_state.prev.json`` and replaced atomically
(:func:`gbmpo.io.atomic_path`), so a kill at any moment leaves a consistent pair. A failed write
(a full disk) raises :class:`~gbmpo.io.CheckpointError` naming the cause and leaves the previous
state as it was; a damaged ``es_state.json`` (or its tensor file) is reported and the previous
state is resumed instead, with a warning.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from gbmpo.io import CheckpointError, atomic_path, root_cause
from gbmpo.meta.es import Elite, ESState

__all__ = ["PREV_STATE_FILE", "STATE_FILE", "STATE_FORMAT", "load_state", "save_state"]

STATE_FILE = "es_state.json"
PREV_STATE_FILE = "es_state.prev.json"
STATE_FORMAT = "gbmpo-es-state/1"


def save_state(state: ESState, output_dir: str | Path, **metadata: Any) -> Path:
    """Write ``state`` into ``output_dir`` (created if needed); ``metadata`` goes into the JSON.

    Returns the path of ``es_state.json``.
    """
    out = Path(output_dir)
    rel = Path("theta") / f"iter_{state.iteration:04d}.safetensors"
    try:  # every file goes through atomic_path, which removes its temporary file on failure
        return _write_state(state, out, rel, metadata)
    except Exception as err:  # OSError (ENOSPC...), SafetensorError
        previous = "no earlier state"
        if (out / STATE_FILE).is_file():
            previous = f"the previous {STATE_FILE} is untouched"
        raise CheckpointError(
            f"could not write the ES state of iteration {state.iteration} in {out}: "
            f"{root_cause(err)}; {previous}"
        ) from err


def _write_state(state: ESState, out: Path, rel: Path, metadata: dict[str, Any]) -> Path:
    (out / "theta").mkdir(parents=True, exist_ok=True)
    deltas = (
        np.stack([e.delta for e in state.elites])
        if state.elites
        else np.zeros((0, state.dim), dtype=np.float64)
    )
    with atomic_path(out / rel) as tmp:
        save_file(
            {
                "theta": np.ascontiguousarray(state.theta, dtype=np.float64),
                "elite_deltas": np.ascontiguousarray(deltas, dtype=np.float64),
            },
            str(tmp),
            metadata={"iteration": str(state.iteration)},
        )
    doc = {
        "format": STATE_FORMAT,
        "iteration": state.iteration,
        "best_fitness": state.best_fitness if math.isfinite(state.best_fitness) else None,
        "dim": state.dim,
        "theta_file": rel.as_posix(),
        "elites": [{"fitness": e.fitness} for e in state.elites],
        "rng_state": state.rng_state,
        "history": state.history,
        **metadata,
    }
    path = out / STATE_FILE
    text = json.dumps(doc, indent=1, allow_nan=False) + "\n"
    with atomic_path(path) as tmp_state:
        tmp_state.write_text(text, encoding="utf-8")  # the new state is complete before any rename
        if path.is_file():
            with atomic_path(out / PREV_STATE_FILE) as prev_tmp:
                shutil.copyfile(path, prev_tmp)
    return path


def load_state(output_dir: str | Path) -> tuple[ESState, dict[str, Any]]:
    """Read the state saved by :func:`save_state`; returns ``(state, the whole JSON document)``.

    If ``es_state.json`` or its tensor file is damaged, the previous state
    (``es_state.prev.json``) is loaded instead with a warning that names the damage. Without a
    previous state the damage is a ``ValueError``; if the previous state is damaged too, one
    ``ValueError`` names both.
    """
    out = Path(output_dir)
    path = out / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no ES state to resume: {path} does not exist")
    try:
        return _read_state(out, path)
    except ValueError as err:
        prev = out / PREV_STATE_FILE
        if not prev.is_file():
            raise
        try:
            state, doc = _read_state(out, prev)
        except ValueError as prev_err:
            raise ValueError(f"{err}; the previous state is damaged too: {prev_err}") from err
        warnings.warn(
            f"{err}; resuming from the previous state {prev} (iteration {state.iteration})",
            RuntimeWarning, stacklevel=2,
        )
        return state, doc


def _read_state(out: Path, path: Path) -> tuple[ESState, dict[str, Any]]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is damaged (not valid JSON: {err})") from err
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT:
        fmt = doc.get("format") if isinstance(doc, dict) else None
        raise ValueError(f"{path} is not an ES state file (format {fmt!r})")
    theta_path = out / doc["theta_file"]
    if not theta_path.is_file():
        raise ValueError(f"the ES state's parameter file {theta_path} is missing")
    try:
        tensors = load_file(str(theta_path))
    except Exception as err:  # SafetensorError: truncated or overwritten file
        raise ValueError(f"the ES state's parameter file {theta_path} is damaged: {err}") from err
    theta = tensors["theta"].astype(np.float64)
    deltas = tensors["elite_deltas"].astype(np.float64)
    if theta.shape != (doc["dim"],) or deltas.shape != (len(doc["elites"]), doc["dim"]):
        raise ValueError(f"{path}: tensor shapes do not match the JSON state")
    best = doc["best_fitness"]
    state = ESState(
        iteration=int(doc["iteration"]),
        theta=theta,
        best_fitness=-math.inf if best is None else float(best),
        elites=[
            Elite(deltas[i].copy(), float(e["fitness"])) for i, e in enumerate(doc["elites"])
        ],
        history=doc["history"],
        rng_state=doc["rng_state"],
    )
    return state, doc
