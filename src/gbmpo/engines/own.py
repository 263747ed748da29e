"""Engine ``gbmpo``: the own trainer (:class:`gbmpo.train.Trainer`), one process on the CPU or
one GPU, as an :class:`gbmpo.engines.base.Engine`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gbmpo.engines.base import BaseEngine, PlainDryRun, Ready

__all__ = ["OwnEngine"]


class OwnEngine(BaseEngine):
    """:class:`gbmpo.train.Trainer`, :func:`gbmpo.train.dry_run` and
    :meth:`gbmpo.train.Trainer.resume` behind the engine interface."""

    name = "gbmpo"

    def dry_run(self, cfg: Any) -> PlainDryRun:
        # deferred: gbmpo.train imports torch; the engine registry imports without it
        from gbmpo.train import dry_run

        info = dry_run(self.own(cfg))
        return PlainDryRun(info, notes=list(info["notes"]), warnings=list(info["warnings"]))

    def train(self, cfg: Any, *, on_ready: Ready | None = None) -> dict[str, Any]:
        # deferred: gbmpo.train imports torch; the engine registry imports without it
        from gbmpo.train import Trainer

        trainer = Trainer(self.own(cfg))
        if on_ready is not None:
            on_ready()
        return trainer.train()

    def resume(self, run_dir: str | Path, overrides: list[tuple[str, Any]], *,
               restart: bool = False) -> dict[str, Any]:  # fmt: skip
        # deferred: gbmpo.train imports torch; the engine registry imports without it
        from gbmpo.train import Trainer

        return Trainer.resume(run_dir, overrides, restart=restart).train()

    def resume_dry_run(self, run_dir: str | Path,
                       overrides: list[tuple[str, Any]]) -> PlainDryRun:  # fmt: skip
        # deferred: gbmpo.lifecycle and gbmpo.train import torch; the engine registry imports
        # without them
        from gbmpo.lifecycle import resume_config
        from gbmpo.train.checkpoint import latest_valid_checkpoint

        _, path = resume_config(run_dir, overrides)
        found = latest_valid_checkpoint(path)
        return PlainDryRun({"resume_from": str(found) if found else None})

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        """``finished N steps in S s; held-out KEY: A% -> B% (+G points)`` and the run
        directory."""
        before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
        key = next((k for k in ("accuracy", "pass@1") if k in before or k in after), None)
        line = f"finished {summary['steps']} steps in {summary['wall_seconds']:.0f} s"
        if key is not None and key in before and key in after:
            gain = 100 * (after[key] - before[key])
            line += (
                f"; held-out {key}: {100 * before[key]:.1f}% -> {100 * after[key]:.1f}% "
                f"({gain:+.1f} points)"
            )
        return [line, f"run directory: {summary['run_dir']}"]
