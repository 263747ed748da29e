"""The TRL engine's checkpoints: TRL's ``checkpoints/checkpoint-<optimizer step>/``, each
completed by gbmpo's :data:`STATE_FILE` (written last, atomically: the RL state TRL does not keep
and the size and sha256 of every file), found, verified and rotated here for
``gbmpo train --resume DIR`` (:func:`gbmpo.engines.trl.runner.resume`).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gbmpo.io import file_sha256, newest_intact, write_json_atomic

__all__ = ["STATE_FILE", "checkpoints", "complete_checkpoint", "latest_valid_checkpoint",
           "prepare_resume", "verify_checkpoint"]  # fmt: skip

#: gbmpo's file in each TRL checkpoint, written last (atomically) once TRL's files are complete:
#: what TRL does not keep (RL step and seconds, metrics.jsonl rows, evaluations, reward
#: failures, wall seconds) and the size and sha256 of every other file of the checkpoint
STATE_FILE = "gbmpo_state.json"
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(run_dir: str | Path, *, complete: bool = True) -> list[tuple[int, Path]]:
    """The run's TRL checkpoints as ``(optimizer step, path)``, oldest first: those gbmpo
    completed (with :data:`STATE_FILE`), or with ``complete=False`` every ``checkpoint-<N>``
    directory (a killed save leaves one without the file)."""
    root = Path(run_dir) / "checkpoints"
    out = []
    if root.is_dir():
        for child in root.iterdir():
            m = _CHECKPOINT_DIR.match(child.name)
            if m and child.is_dir() and (not complete or (child / STATE_FILE).is_file()):
                out.append((int(m.group(1)), child))
    return sorted(out)


def _files(directory: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``directory`` but :data:`STATE_FILE`, by relative
    path."""
    return {
        str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != STATE_FILE
    }


def verify_checkpoint(path: str | Path) -> str | None:
    """``None`` when the TRL checkpoint ``path`` is complete and its files match the sizes and
    sha256 in its :data:`STATE_FILE`, else what is wrong."""
    directory = Path(path)
    try:
        files = json.loads((directory / STATE_FILE).read_text())["files"]
    except FileNotFoundError:
        return f"{STATE_FILE} is missing (the save did not complete)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{STATE_FILE} is unreadable ({err})"
    for name, meta in files.items():
        file_path = directory / name
        if not file_path.is_file():
            return f"{name} is missing"
        if file_path.stat().st_size != meta["size"]:
            return f"{name} has {file_path.stat().st_size} bytes, {STATE_FILE} says {meta['size']}"
        if file_sha256(file_path) != meta["sha256"]:
            return f"{name} does not match its sha256 in {STATE_FILE}"
    return None


def latest_valid_checkpoint(run_dir: str | Path,
                            log: Callable[[str], None] | None = None) -> Path | None:  # fmt: skip
    """The newest intact TRL checkpoint of the run (``None`` when it completed none): damaged
    ones are skipped with a message to ``log`` (default stderr); ``CheckpointError`` names them
    when every completed checkpoint is damaged (starting over would silently redo the run)."""
    return newest_intact(checkpoints(run_dir), verify_checkpoint,
                         Path(run_dir) / "checkpoints", log)  # fmt: skip


def complete_checkpoint(path: Path, state: dict[str, Any], keep: int) -> None:
    """Write ``path``'s :data:`STATE_FILE` (last, atomically), then keep the newest ``keep``
    completed checkpoints: an older one goes only once a newer one is complete, its state file
    first (a kill while deleting leaves an incomplete checkpoint, never a complete-looking
    damaged one)."""
    write_json_atomic(path / STATE_FILE, {**state, "files": _files(path)})
    for _, old in checkpoints(path.parent.parent)[:-keep] if keep > 0 else []:
        (old / STATE_FILE).unlink(missing_ok=True)
        shutil.rmtree(old, ignore_errors=True)


def prepare_resume(run_dir: Path) -> Path | None:
    """The checkpoint a resume continues from (:func:`latest_valid_checkpoint`); the
    checkpoint directories past it (incomplete or damaged saves of the killed run) are removed,
    saying so, since TRL writes the steps after it again."""
    start = latest_valid_checkpoint(run_dir)
    step = int(_CHECKPOINT_DIR.match(start.name).group(1)) if start else -1  # type: ignore[union-attr]
    for n, path in checkpoints(run_dir, complete=False):
        if n > step:
            print(f"gbmpo: removing {path.name} (past the checkpoint the run continues from)",
                  file=sys.stderr, flush=True)  # fmt: skip
            shutil.rmtree(path, ignore_errors=True)
    return start
