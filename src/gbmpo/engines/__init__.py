"""Engines: one gbmpo config, three trainers (``gbmpo train --engine gbmpo|trl|verl``).

* ``gbmpo`` (:mod:`gbmpo.engines.own`): the own trainer (:class:`gbmpo.train.Trainer`): one
  process, CPU or one GPU.
* ``trl`` (:mod:`gbmpo.engines.trl.engine`, :mod:`gbmpo.engines.trl.runner`): TRL's
  ``GRPOTrainer`` with gbmpo's loss (:class:`gbmpo.integrations.trl.GBMPOTrainer`), built from
  the same config; one process in-process, several through ``accelerate launch`` (gloo on CPU,
  NCCL on GPUs), vLLM generation with ``rollout.generator: vllm``.
* ``verl`` (:mod:`gbmpo.engines.verl.engine`, :mod:`gbmpo.engines.verl.runner`): verl's
  ``main_ppo`` (Ray, FSDP, vLLM) with the gbmpo plugin; the config becomes verl's data files,
  Hydra overrides and a reward function.

Every engine writes the same run directory: ``config.yaml``, ``metrics.jsonl``,
``summary.json`` (evaluation before / after) and ``model/`` (verl: its own checkpoints).

Each engine implements :class:`gbmpo.engines.base.Engine` and is registered once, in
:data:`ENGINES`; the names are the config's ``engine`` values
(:data:`gbmpo.config.TRAIN_ENGINES`, also the support matrix's columns). ``gbmpo train``
looks the engine up (:func:`engine_for`) and calls the same methods on every engine. Importing
this package imports none of TRL, verl, transformers or torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gbmpo.engines.base import DryRun, Engine
from gbmpo.engines.checks import Check, DryRunReport, EngineUnavailable
from gbmpo.engines.own import OwnEngine
from gbmpo.engines.trl.engine import TrlEngine
from gbmpo.engines.verl.engine import VerlEngine
from gbmpo.registry import Registry

__all__ = [
    "ENGINES",
    "Check",
    "DryRun",
    "DryRunReport",
    "Engine",
    "EngineUnavailable",
    "check_resumable",
    "dry_run",
    "engine_for",
    "get_engine",
    "run",
]

#: every engine of ``gbmpo train --engine NAME``, by name
ENGINES: Registry[Engine] = Registry("engine")
for _engine in (OwnEngine(), TrlEngine(), VerlEngine()):
    ENGINES.register(_engine.name, _engine)
del _engine


def get_engine(name: str) -> Engine:
    """The engine registered as ``name``; :class:`gbmpo.registry.UnknownNameError` (listing
    the valid names) for any other."""
    return ENGINES.get(name)


def engine_for(config: Any) -> Engine:
    """The engine ``config.engine`` names. For a name no engine has, the config's first error
    (:func:`gbmpo.config.validate`: its plugins, then ``'engine'`` with the valid
    names), as a config checked without an engine reports it."""
    if config.engine not in ENGINES:
        # deferred: gbmpo.config imports torch; the engine registry imports without it
        from gbmpo.config import validate

        validate(config)
    return get_engine(config.engine)


def run(config: Any) -> dict[str, Any]:
    """Train ``config`` with ``config.engine``; returns the run's summary.

    Raises :class:`EngineUnavailable` (the CLI exits 2, naming what is missing) when the engine
    cannot run here, e.g. verl without its package or GPUs."""
    return engine_for(config).train(config)


def dry_run(config: Any) -> DryRun:
    """Check ``config`` for ``config.engine`` without training (:meth:`Engine.dry_run`): for
    ``trl`` and ``verl`` the engine-independent checks
    (:func:`gbmpo.engines.checks.common_checks`) and the engine's own (TRL's ``GRPOConfig``;
    verl's composed Hydra config and its validation), GPU-only checks reported as skipped."""
    return engine_for(config).dry_run(config)


def check_resumable(run_dir: str) -> str:
    """The engine that trained ``run_dir`` (``gbmpo train --resume DIR`` continues it with that
    engine's :meth:`Engine.resume`); ``gbmpo`` where ``DIR/config.yaml`` is missing (the own
    trainer's resume reports it). ``ConfigError`` (exit 2) for a finished run."""
    # deferred: gbmpo.config imports torch; the engine registry imports without it
    from gbmpo.config import ConfigError, load_config

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return "gbmpo"
    if (Path(run_dir) / "summary.json").is_file():
        raise ConfigError(f"cannot resume {str(run_dir)!r}: the run already finished")
    return str(load_config(path).engine)
