"""The console of a run: prints and a rich progress bar, quiet when ``run.progress`` is off."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from rich.console import Console as RichConsole
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["Console", "fmt_eval", "main_metric"]


def main_metric(metrics: dict[str, Any]) -> str | None:
    """The headline metric of an evaluation: ``accuracy`` (math) or ``pass@1`` (code)."""
    for key in ("accuracy", "pass@1"):
        if key in metrics:
            return key
    return None


def fmt_eval(metrics: dict[str, Any] | None) -> str:
    """An evaluation in a few words: its headline metric in percent and ``n``."""
    if not metrics:
        return "(no evaluation)"
    key = main_metric(metrics)
    if key is None:
        return str(metrics)
    n = metrics.get("n")
    return f"{key} {100 * metrics[key]:.1f}%" + (f" (n={n})" if n is not None else "")


class Console:
    """Prints and a rich progress bar (quiet when ``enabled`` is False)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._console: Any = None
        if enabled:
            self._console = RichConsole(stderr=True)

    def print(self, text: str) -> None:
        if self._console is not None:
            self._console.print(text)

    @contextlib.contextmanager
    def progress(
        self, steps: int, budget: float | None, step: int, seconds: float
    ) -> Iterator[_Bar]:
        if self._console is None:
            yield _Bar(None, None, steps, budget)
            return
        prog = Progress(
            TextColumn("[bold]RL"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self._console,
        )
        total = budget if budget is not None else steps
        task_id = prog.add_task("rl", total=total, completed=0, info="")
        bar = _Bar(prog, task_id, steps, budget)
        bar.update(step, seconds, {}, None)
        with prog:
            yield bar


class _Bar:
    def __init__(self, prog: Any, task_id: Any, steps: int, budget: float | None) -> None:
        self.prog, self.task_id, self.steps, self.budget = prog, task_id, steps, budget

    def update(
        self,
        step: int,
        seconds: float,
        record: dict[str, Any],
        last_eval: tuple[int, dict[str, Any]] | None,
    ) -> None:
        if self.prog is None:
            return
        info = f"step {step}/{self.steps}"
        if self.budget is not None:
            info += f"  {seconds:.0f}/{self.budget:.0f}s"
        if "reward_mean" in record:
            info += f"  reward {record['reward_mean']:.3f}"
        if last_eval is not None:
            info += f"  eval@{last_eval[0]} {fmt_eval(last_eval[1])}"
        done = min(seconds, self.budget) if self.budget is not None else step
        self.prog.update(self.task_id, completed=done, info=info)
