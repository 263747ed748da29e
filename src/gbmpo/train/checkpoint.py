"""Checkpoints and the run directory's small files.

A checkpoint ``<run>/checkpoints/step-<N>/`` holds everything needed to continue a run exactly:

* ``trainable.safetensors``: the trainable parameters by name (all weights for full
  fine-tuning, the adapter weights for LoRA);
* ``optimizer.pt``: the AdamW state (the learning rate is a function of the step and the RL
  seconds in ``state.json``, so there is no scheduler state);
* ``rng.pt``: torch, python ``random`` and numpy RNG states;
* ``state.json``: step, prompt-sampler position, RL seconds used, counters, eval history.

Every file is written to a temporary directory that is renamed into place last, so a killed
process never leaves a checkpoint that looks complete. JSON files (``status.json``,
``summary.json``) are written atomically (temporary file + ``os.replace``).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CHECKPOINT_DIR",
    "capture_rng_state",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
    "write_json_atomic",
]

CHECKPOINT_DIR = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` so that readers see the old or the new file, never a
    partial one."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
    """Complete checkpoints of a run as ``(step, path)``, oldest first."""
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


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int = 1,
) -> Path:
    """Write ``checkpoints/step-<step>`` atomically and keep only the newest ``keep``."""
    from safetensors.torch import save_file

    root = Path(run_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".step-{step}."))
    try:
        save_file(trainable_state(model), str(tmp / "trainable.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(capture_rng_state(), tmp / "rng.pt")
        write_json_atomic(tmp / "state.json", {"step": step, **state})
        if final.exists():
            shutil.rmtree(final)
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
    """Restore weights, optimizer and RNG states from ``path``; return state.json."""
    from safetensors.torch import load_file

    p = Path(path)
    weights = load_file(str(p / "trainable.safetensors"))
    params = dict(model.named_parameters())
    expected = {n for n, t in params.items() if t.requires_grad}
    if set(weights) != expected:
        missing = sorted(expected - set(weights))[:5]
        extra = sorted(set(weights) - expected)[:5]
        raise ValueError(
            f"checkpoint {str(p)!r} does not match the model's trainable parameters "
            f"(missing {missing}, unexpected {extra}); was it written with another model or "
            "LoRA setting?"
        )
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor.to(params[name].device))
    optimizer.load_state_dict(torch.load(p / "optimizer.pt", weights_only=False))
    restore_rng_state(torch.load(p / "rng.pt", weights_only=False))
    return json.loads((p / "state.json").read_text())
