"""Checkpoints and the run directory's small files.

A checkpoint ``<run>/checkpoints/step-<N>/`` holds everything needed to continue a run exactly:

* ``trainable.safetensors``: the trainable parameters by name (all weights for full
  fine-tuning, the adapter weights for LoRA);
* ``optimizer.pt``: the AdamW state (the learning rate is a function of the step and the RL
  seconds in ``state.json``, so there is no scheduler state);
* ``rng.pt``: torch, python ``random`` and numpy RNG states;
* ``state.json``: step, prompt-sampler position, RL seconds used, counters, eval history.

* ``manifest.json`` (written last): the size and sha256 of every other file.

Every file is written to a temporary directory that is renamed into place last, so a killed
process never leaves a checkpoint that looks complete. On resume the newest checkpoint whose
files match its manifest is used (:func:`latest_valid_checkpoint`): a damaged one (truncated,
edited, missing a file) is reported and skipped, and if no checkpoint is intact the resume stops
with an error naming them. JSON files (``status.json``, ``summary.json``) and ``config.yaml``
are written atomically (:func:`gbmpo.io.write_atomic`).

A run directory is owned by one process at a time (:class:`gbmpo.io.RunLock`, re-exported here
with :class:`~gbmpo.io.RunDirInUseError`, :class:`~gbmpo.io.CheckpointError` and the atomic
writers).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

# the run directory's plumbing lives in gbmpo.io; these names stay importable from here
from gbmpo.io import (
    LOCK_FILE,
    CheckpointError,
    RunDirInUseError,
    RunLock,
    file_sha256,
    newest_intact,
    root_cause,
    write_json_atomic,
)
from gbmpo.io import write_atomic as write_text_atomic

__all__ = [
    "CHECKPOINT_DIR",
    "LOCK_FILE",
    "MANIFEST_FILE",
    "CheckpointError",
    "RunDirInUseError",
    "RunLock",
    "capture_rng_state",
    "latest_checkpoint",
    "latest_valid_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
    "verify_checkpoint",
    "write_json_atomic",
    "write_text_atomic",
]

CHECKPOINT_DIR = "checkpoints"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_STEP_DIR = re.compile(r"^\.step-\d+\.")


def capture_rng_state() -> dict[str, Any]:
    """The global RNG states of torch, python ``random`` and numpy."""
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters by name (tied parameters appear once)."""
    return {
        name: p.detach().cpu().contiguous()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Checkpoints of a run as ``(step, path)``, oldest first (renamed into place, i.e.
    complete when written; :func:`verify_checkpoint` checks they are still intact)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    out = []
    if root.is_dir():
        for child in root.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and child.is_dir() and (child / "state.json").is_file():
                out.append((int(m.group(1)), child))
    return sorted(out)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None



def _write_manifest(directory: Path) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST_FILE
    }
    write_json_atomic(directory / MANIFEST_FILE, {"files": files})


def verify_checkpoint(path: str | Path) -> str | None:
    """``None`` if the checkpoint's files match its manifest (size and sha256), else what is
    wrong. Checkpoints written before manifests existed are accepted unverified."""
    directory = Path(path)
    manifest = directory / MANIFEST_FILE
    if not manifest.is_file():
        if all((directory / n).is_file()
               for n in ("trainable.safetensors", "optimizer.pt", "rng.pt")):
            return None  # an older checkpoint without a manifest
        return f"{MANIFEST_FILE} is missing"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST_FILE} is unreadable ({err})"
    for name, meta in files.items():
        file_path = directory / name
        if not file_path.is_file():
            return f"{name} is missing"
        size = file_path.stat().st_size
        if size != meta["size"]:
            return f"{name} has {size} bytes, the manifest says {meta['size']}"
        if file_sha256(file_path) != meta["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def latest_valid_checkpoint(
    run_dir: str | Path, log: Callable[[str], None] | None = None
) -> Path | None:
    """The newest intact checkpoint of a run (``None`` if it has none at all).

    Damaged checkpoints are skipped with a message to ``log`` (default: stderr); if every
    checkpoint is damaged, :class:`CheckpointError` names them (continuing from scratch would
    silently redo the run)."""
    return newest_intact(list_checkpoints(run_dir), verify_checkpoint,
                         Path(run_dir) / CHECKPOINT_DIR, log)  # fmt: skip


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int = 1,
) -> Path:
    """Write ``checkpoints/step-<step>`` atomically and keep only the newest ``keep``.

    The files and then their manifest go to a temporary directory that is renamed into place;
    an existing ``step-<step>`` is first renamed aside, so no moment shows a half-deleted
    checkpoint under a valid name. A failed write (e.g. the disk is full) raises
    :class:`CheckpointError` and leaves the older checkpoints untouched. Leftover temporary
    directories of killed writers are removed first (the caller owns the run directory).
    """
    root = Path(run_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.iterdir():
        if _TMP_STEP_DIR.match(stale.name) and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".step-{step}."))
    try:
        try:
            save_file(trainable_state(model), str(tmp / "trainable.safetensors"))
            # through Python file objects: a full disk then surfaces as OSError(ENOSPC) (torch's
            # own writer only reports "unexpected pos")
            with open(tmp / "optimizer.pt", "wb") as f:
                torch.save(optimizer.state_dict(), f)
            with open(tmp / "rng.pt", "wb") as f:
                torch.save(capture_rng_state(), f)
            write_json_atomic(tmp / "state.json", {"step": step, **state})
            _write_manifest(tmp)
        except Exception as err:  # OSError, torch's RuntimeError, SafetensorError (disk full...)
            kept = [p.name for _, p in list_checkpoints(run_dir)]
            raise CheckpointError(
                f"could not write checkpoint {final}: {root_cause(err)}; the previous "
                f"checkpoints are untouched ({', '.join(kept) or 'none yet'})"
            ) from err
        if final.exists():
            aside = Path(tempfile.mkdtemp(dir=root, prefix=f".step-{step}.old."))
            os.replace(final, aside / final.name)
            os.replace(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> dict[str, Any]:
    """Restore weights, optimizer and RNG states from ``path``; return state.json.

    A checkpoint whose files do not match its manifest raises :class:`CheckpointError`."""
    directory = Path(path)
    problem = verify_checkpoint(directory)
    if problem is not None:
        raise CheckpointError(f"checkpoint {str(directory)!r} is damaged: {problem}")
    weights = load_file(str(directory / "trainable.safetensors"))
    params = dict(model.named_parameters())
    expected = {n for n, t in params.items() if t.requires_grad}
    if set(weights) != expected:
        missing = sorted(expected - set(weights))[:5]
        extra = sorted(set(weights) - expected)[:5]
        raise ValueError(
            f"checkpoint {str(directory)!r} does not match the model's trainable parameters "
            f"(missing {missing}, unexpected {extra}); was it written with another model or "
            "LoRA setting?"
        )
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor.to(params[name].device))
    optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=False))
    restore_rng_state(torch.load(directory / "rng.pt", weights_only=False))
    return json.loads((directory / "state.json").read_text())
