"""Engine ``verl``: verl's ``main_ppo`` with the gbmpo plugin (:mod:`gbmpo.engines.verl.runner`)
as an :class:`gbmpo.engines.base.Engine`. verl runs in its own environment; nothing of it is
imported here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gbmpo.engines.base import BaseEngine, Ready
from gbmpo.engines.checks import DryRunReport

__all__ = ["VerlEngine"]


class VerlEngine(BaseEngine):
    """:func:`gbmpo.engines.verl.runner.dry_run`, :func:`~gbmpo.engines.verl.runner.run`,
    :func:`~gbmpo.engines.verl.runner.resume` and
    :func:`~gbmpo.engines.verl.runner.resume_dry_run` behind the engine interface."""

    name = "verl"

    def dry_run(self, cfg: Any) -> DryRunReport:
        # deferred: verl_runner imports torch (gbmpo.train); the engine registry imports without it
        from gbmpo.engines.verl import runner as verl_runner

        return verl_runner.dry_run(self.own(cfg))

    def train(self, cfg: Any, *, on_ready: Ready | None = None) -> dict[str, Any]:
        # deferred: verl_runner imports torch (gbmpo.train); the engine registry imports without it
        from gbmpo.engines.verl import runner as verl_runner

        self.own(cfg)
        if on_ready is not None:
            on_ready()
        return verl_runner.run(cfg)

    def resume(self, run_dir: str | Path, overrides: list[tuple[str, Any]], *,
               restart: bool = False) -> dict[str, Any]:  # fmt: skip
        # deferred: verl_runner imports torch (gbmpo.train); the engine registry imports without it
        from gbmpo.engines.verl import runner as verl_runner

        if not restart and not verl_runner.resume_dry_run(run_dir, overrides).info["resume_step"]:
            # deferred: gbmpo.lifecycle imports torch (through gbmpo.config); the engine registry
            # imports without it
            from gbmpo.lifecycle import no_checkpoint_error

            raise no_checkpoint_error(run_dir)
        return verl_runner.resume(run_dir, overrides)

    def resume_dry_run(self, run_dir: str | Path,
                       overrides: list[tuple[str, Any]]) -> DryRunReport:  # fmt: skip
        # deferred: verl_runner imports torch (gbmpo.train); the engine registry imports without it
        from gbmpo.engines.verl import runner as verl_runner

        return verl_runner.resume_dry_run(run_dir, overrides)
