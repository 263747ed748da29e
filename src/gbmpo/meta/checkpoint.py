"""Save and load the ES state: ``es_state.json`` plus one safetensors file of parameters.

Layout of an ES output directory::

    es_state.json               iteration, best_fitness, history, elites' fitness, rng state,
                                the ES config and whatever run metadata the caller adds
    theta/iter_0003.safetensors theta [d] and elite_deltas [m, d] (float64) after 3 iterations

The tensor file of each iteration is written first under a new name, then ``es_state.json`` is
replaced atomically (``os.replace``), so a kill at any moment leaves a consistent pair.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from gbmpo.meta.es import Elite, ESState

__all__ = ["STATE_FILE", "STATE_FORMAT", "load_state", "save_state"]

STATE_FILE = "es_state.json"
STATE_FORMAT = "gbmpo-es-state/1"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def save_state(state: ESState, output_dir: str | Path, **metadata: Any) -> Path:
    """Write ``state`` into ``output_dir`` (created if needed); ``metadata`` goes into the JSON.

    Returns the path of ``es_state.json``.
    """
    out = Path(output_dir)
    (out / "theta").mkdir(parents=True, exist_ok=True)
    rel = Path("theta") / f"iter_{state.iteration:04d}.safetensors"
    deltas = (
        np.stack([e.delta for e in state.elites])
        if state.elites
        else np.zeros((0, state.dim), dtype=np.float64)
    )
    tmp = out / (str(rel) + ".tmp")
    save_file(
        {
            "theta": np.ascontiguousarray(state.theta, dtype=np.float64),
            "elite_deltas": np.ascontiguousarray(deltas, dtype=np.float64),
        },
        str(tmp),
        metadata={"iteration": str(state.iteration)},
    )
    os.replace(tmp, out / rel)
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
    _atomic_write_text(path, json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return path


def load_state(output_dir: str | Path) -> tuple[ESState, dict[str, Any]]:
    """Read the state saved by :func:`save_state`; returns ``(state, the whole JSON document)``."""
    out = Path(output_dir)
    path = out / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no ES state to resume: {path} does not exist")
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
