"""The engine interface: what ``gbmpo train`` asks of every engine (:class:`Engine`).

An engine trains one gbmpo config (:class:`gbmpo.train.TrainConfig`) its own way and writes the
same run directory. The command line looks an engine up by name in
:data:`gbmpo.engines.ENGINES` and calls the same methods on each:

* :meth:`Engine.check`: the config's values and the support matrix (``ConfigError``, exit 2,
  for a value the engine cannot honour); returns the no-effect notices.
* :meth:`Engine.plan`: the memory plan per GPU (:func:`gbmpo.train.memory.memory_plan`).
* :meth:`Engine.dry_run`: everything but training (:class:`DryRun`: what to print).
* :meth:`Engine.train`: the run; returns its summary (``summary.json``).
* :meth:`Engine.resume` / :meth:`Engine.resume_dry_run`: ``gbmpo train --resume DIR``.
* :meth:`Engine.summary_lines`: the lines the command prints about a finished run.

:class:`BaseEngine` implements :meth:`~Engine.check`, :meth:`~Engine.plan` and
:meth:`~Engine.summary_lines` for every engine; an engine adds the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gbmpo.engines.checks import (
    ASSUMED_PROMPT_TOKENS,
    model_config_for,
    plan_memory,
    without_missing_mirror,
)

__all__ = ["BaseEngine", "DryRun", "Engine", "PlainDryRun", "Ready"]

#: called by :meth:`Engine.train` once the run has passed its checks, before it trains
Ready = Callable[[], None]


@runtime_checkable
class DryRun(Protocol):
    """What a dry run found, as ``gbmpo train --dry-run`` prints it: :attr:`notes` on stdout,
    each of :attr:`warnings` on stderr as ``warning: ...``, then ``dry run OK: `` and
    :meth:`to_dict` as JSON."""

    @property
    def notes(self) -> list[str]: ...

    @property
    def warnings(self) -> list[str]: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass
class PlainDryRun:
    """A :class:`DryRun` from a plain dict (``info``) and its lines."""

    info: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return self.info


@runtime_checkable
class Engine(Protocol):
    """One engine of ``gbmpo train --engine NAME`` (see the module docstring). The methods
    take a config whose ``engine`` is :attr:`name` (:meth:`plan` takes any). Bad input raises
    what the own trainer raises (``ConfigError``, ``UnknownNameError``, ``DataError``,
    ``FileNotFoundError``: exit 2); an engine that cannot run here raises
    :class:`gbmpo.engines.EngineUnavailable` (exit 2, naming what is missing) before anything
    is written."""

    name: str

    def check(self, cfg: Any, *, dry: bool = False) -> list[str]:
        """Validate ``cfg`` and refuse what this engine cannot honour (``ConfigError``); the
        no-effect notices. ``dry``: a mirror map an ES run has yet to write is checked with its
        initialisation."""
        ...

    def plan(self, cfg: Any, prompt_tokens: int | None = None) -> dict[str, Any]:
        """The memory plan per GPU of ``cfg`` on this engine, prompts of ``prompt_tokens``
        tokens (default :data:`gbmpo.engines.checks.ASSUMED_PROMPT_TOKENS`); ``OSError`` /
        ``ValueError`` where the model's shape is not known here."""
        ...

    def dry_run(self, cfg: Any) -> DryRun:
        """Check ``cfg`` and build everything but the weights; nothing written."""
        ...

    def train(self, cfg: Any, *, on_ready: Ready | None = None) -> dict[str, Any]:
        """Train ``cfg``; ``on_ready()`` runs once the run has passed the checks that come
        before it starts. Returns the summary (also written to ``summary.json``)."""
        ...

    def resume(self, run_dir: str | Path, overrides: list[tuple[str, Any]], *,
               restart: bool = False) -> dict[str, Any]:  # fmt: skip
        """Continue the unfinished run ``run_dir`` from its last intact checkpoint (only the
        resumable keys may be overridden); without one :class:`gbmpo.io.CheckpointError`
        (exit 1, nothing changed) unless ``restart`` (start over in the same directory).
        Returns the summary."""
        ...

    def resume_dry_run(self, run_dir: str | Path,
                       overrides: list[tuple[str, Any]]) -> DryRun:  # fmt: skip
        """What :meth:`resume` would do (the checkpoint it continues from); nothing written."""
        ...

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        """The lines ``gbmpo train`` prints about the finished run ``summary``."""
        ...


class BaseEngine:
    """:meth:`Engine.check`, :meth:`Engine.plan` and :meth:`Engine.summary_lines`, the same for
    every engine; a subclass sets :attr:`name` and adds the run itself."""

    name: str = ""

    def check(self, cfg: Any, *, dry: bool = False) -> list[str]:
        # deferred: gbmpo.config imports torch; the engine registry imports without it
        from gbmpo.config import validate
        from gbmpo.config.support import check_support

        self.own(cfg)
        validate(without_missing_mirror(cfg) if dry else cfg)
        return check_support(cfg, self.name)

    def plan(self, cfg: Any, prompt_tokens: int | None = None) -> dict[str, Any]:
        if cfg.engine != self.name:
            cfg = dataclasses.replace(cfg, engine=self.name)
        return plan_memory(cfg, model_config_for(cfg), prompt_tokens or ASSUMED_PROMPT_TOKENS)

    def summary_lines(self, summary: dict[str, Any]) -> list[str]:
        before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
        line = f"finished {summary.get('steps')} steps ({self.name}) in "
        line += f"{summary.get('wall_seconds', 0):.0f} s"
        key = next((k for k in ("accuracy", "pass@1") if k in before and k in after), None)
        if key is not None:
            line += f"; held-out {key}: {100 * before[key]:.1f}% -> {100 * after[key]:.1f}%"
        return [line, f"run directory: {summary.get('run_dir')}"]

    def own(self, cfg: Any) -> Any:
        """``cfg``; ``ValueError`` when it names another engine (a caller's mistake)."""
        if cfg.engine != self.name:
            raise ValueError(f"engine {self.name!r} was given a config for engine {cfg.engine!r}")
        return cfg

    def __repr__(self) -> str:
        return f"<engine {self.name!r}>"

