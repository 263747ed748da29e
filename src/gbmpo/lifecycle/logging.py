"""Metrics output: ``metrics.jsonl`` (one JSON object per step), optional trackers, progress.

Timing fields (wall-clock dependent) all start with ``time/`` or are listed in
:data:`TIMING_KEYS`; :func:`without_timing` drops them, e.g. to compare two runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gbmpo.io import write_atomic

__all__ = [
    "METRICS_FILE",
    "TIMING_KEYS",
    "MetricsWriter",
    "Reporters",
    "read_metrics",
    "without_timing",
]

METRICS_FILE = "metrics.jsonl"
#: wall-clock dependent metric names (besides every key starting with ``time/``)
TIMING_KEYS = frozenset({"step_seconds", "tokens_per_second"})


def without_timing(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` without its wall-clock dependent fields."""
    return {k: v for k, v in record.items() if k not in TIMING_KEYS and not k.startswith("time/")}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def read_metrics(path: str | Path, *, partial_last: bool = False) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` file (a run directory or the file itself).

    ``partial_last`` skips a last line that is not complete JSON (a write cut short by a kill or
    a full disk; the trainer drops it on resume); any other bad line raises ``ValueError``."""
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    if not p.is_file():
        return []
    text = p.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as err:
            if partial_last and i == len(lines) - 1 and not text.endswith("\n"):
                break
            raise ValueError(f"{p} line {i + 1} is not valid JSON: {err}") from err
    return out


class MetricsWriter:
    """Appends one JSON line per record to ``<run_dir>/metrics.jsonl`` (flushed every line)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        keep_up_to_step: int | None = None,
        keep_rows: int | None = None,
    ) -> None:
        """``keep_rows`` (the first N rows) or ``keep_up_to_step`` (rows with a step <= it)
        truncate an existing file on resume; neither: a new run (the file is appended to)."""
        self.path = Path(run_dir) / METRICS_FILE
        self.rows = 0  #: rows in the file (kept + written)
        if (keep_up_to_step is not None or keep_rows is not None) and self.path.exists():
            # resume: drop what a killed run logged after its last checkpoint (atomically: a
            # kill during the rewrite must not lose the rows before it)
            kept = read_metrics(self.path, partial_last=True)
            if keep_rows is not None:
                kept = kept[:keep_rows]
            else:
                kept = [r for r in kept if r.get("step", 0) <= keep_up_to_step]  # type: ignore[operator]
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
            self.rows = len(kept)
        self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        self.rows += 1

    def close(self) -> None:
        self._file.close()


class Reporters:
    """Optional experiment trackers (imported lazily): tensorboard, trackio, wandb."""

    def __init__(
        self, names: Iterable[str], run_dir: str | Path, config: dict[str, Any], run_name: str
    ) -> None:
        self._backends: list[tuple[str, Any]] = []
        for name in names:
            if name == "tensorboard":
                try:
                    # deferred: tensorboard is an optional tracker
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError as err:
                    raise RuntimeError(
                        "report_to 'tensorboard' needs the tensorboard package "
                        "(pip install tensorboard)"
                    ) from err
                self._backends.append((name, SummaryWriter(log_dir=str(Path(run_dir) / "tb"))))
            elif name == "trackio":
                try:
                    # deferred: trackio is an optional tracker
                    import trackio
                except ImportError as err:
                    raise RuntimeError(
                        "report_to 'trackio' needs the trackio package (pip install trackio)"
                    ) from err
                trackio.init(project="gbmpo", name=run_name, config=config)
                self._backends.append((name, trackio))
            elif name == "wandb":
                try:
                    # deferred: wandb is an optional tracker
                    import wandb
                except ImportError as err:
                    raise RuntimeError(
                        "report_to 'wandb' needs the wandb package (pip install wandb)"
                    ) from err
                run = wandb.init(project="gbmpo", name=run_name, config=config, dir=str(run_dir))
                self._backends.append((name, run))
            else:
                raise ValueError(f"unknown report_to {name!r}; valid: tensorboard, trackio, wandb")

    def log(self, record: dict[str, Any], step: int) -> None:
        scalars = {
            k: float(v)
            for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
        }
        for name, backend in self._backends:
            if name == "tensorboard":
                for k, v in scalars.items():
                    backend.add_scalar(k, v, step)
            else:
                backend.log(scalars, step=step)

    def close(self) -> None:
        for name, backend in self._backends:
            if name == "tensorboard":
                backend.close()
            else:
                backend.finish()
