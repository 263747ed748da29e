"""Engine ``trl``: TRL's ``GRPOTrainer`` with gbmpo's loss (:mod:`gbmpo.engines.trl.runner`) as
an :class:`gbmpo.engines.base.Engine`. TRL is imported only when a method needs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gbmpo.engines.base import BaseEngine, PlainDryRun, Ready
from gbmpo.engines.checks import DryRunReport

__all__ = ["TrlEngine"]


class TrlEngine(BaseEngine):
    """:func:`gbmpo.engines.trl.runner.dry_run`, :func:`~gbmpo.engines.trl.runner.run` and
    :func:`~gbmpo.engines.trl.runner.resume` behind the engine interface."""

    name = "trl"

    def dry_run(self, cfg: Any) -> DryRunReport:
        # deferred: trl_runner imports torch; the engine registry imports without it
        from gbmpo.engines.trl import runner as trl_runner

        return trl_runner.dry_run(self.own(cfg))

    def train(self, cfg: Any, *, on_ready: Ready | None = None) -> dict[str, Any]:
        # deferred: trl_runner and gbmpo.train import torch; the registry imports without it
        from gbmpo.engines.trl import runner as trl_runner
        from gbmpo.train.device import check_device

        self.own(cfg)
        if on_ready is not None:
            on_ready()
        check_device(cfg.model.device)  # an absent device stops before anything is loaded
        return trl_runner.run(cfg)

    def resume(self, run_dir: str | Path, overrides: list[tuple[str, Any]], *,
               restart: bool = False) -> dict[str, Any]:  # fmt: skip
        # deferred: trl_runner imports torch; the engine registry imports without it
        from gbmpo.engines.trl import runner as trl_runner

        return trl_runner.resume(run_dir, overrides, restart=restart)

    def resume_dry_run(self, run_dir: str | Path,
                       overrides: list[tuple[str, Any]]) -> PlainDryRun:  # fmt: skip
        # deferred: trl_runner imports torch; the engine registry imports without it
        from gbmpo.engines.trl import runner as trl_runner

        return PlainDryRun(trl_runner.resume(run_dir, overrides, dry=True))
