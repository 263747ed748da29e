"""Engines: one gbmpo config, three trainers (``gbmpo train --engine gbmpo|trl|verl``).

* ``gbmpo``: the own trainer (:class:`gbmpo.train.Trainer`): one process, CPU or one GPU.
* ``trl`` (:mod:`gbmpo.engines.trl_runner`): TRL's ``GRPOTrainer`` with gbmpo's loss
  (:class:`gbmpo.integrations.trl.GBMPOTrainer`), built from the same config; one process
  in-process, several through ``accelerate launch`` (gloo on CPU, NCCL on GPUs), vLLM
  generation with ``rollout.generator: vllm``.
* ``verl`` (:mod:`gbmpo.engines.verl_runner`): verl's ``main_ppo`` (Ray, FSDP, vLLM) with the
  gbmpo plugin; the config becomes verl's data files, Hydra overrides and a reward function.

Every engine writes the same run directory: ``config.yaml``, ``metrics.jsonl``,
``summary.json`` (evaluation before / after) and ``model/`` (verl: its own checkpoints).

:func:`run` and :func:`dry_run` dispatch on ``config.engine``; the CLI's ``train`` subcommand
calls them for the ``trl`` and ``verl`` engines, and :func:`resume` for ``--resume DIR`` of a
``trl`` or ``verl`` run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gbmpo.engines.checks import Check, DryRunReport, EngineUnavailable

__all__ = [
    "Check",
    "DryRunReport",
    "EngineUnavailable",
    "check_resumable",
    "dry_run",
    "main",
    "resume",
    "run",
]


def run(config: Any) -> dict[str, Any]:
    """Train with ``config.engine`` (``trl`` or ``verl``); returns the run's summary.

    Raises :class:`EngineUnavailable` (the CLI exits 2, naming what is missing) when the engine
    cannot run here, e.g. verl without its package or GPUs."""
    if config.engine == "trl":
        from gbmpo.engines import trl_runner
        from gbmpo.train.device import check_device

        check_device(config.model.device)  # an absent device stops before anything is loaded
        return trl_runner.run(config)
    if config.engine == "verl":
        from gbmpo.engines import verl_runner

        return verl_runner.run(config)
    raise ValueError(f"gbmpo.engines.run: engine {config.engine!r} is the own trainer's")


def check_resumable(run_dir: str) -> str:
    """The engine that trained ``run_dir`` (``gbmpo train --resume DIR`` continues it with that
    engine: :func:`resume`); ``gbmpo`` where ``DIR/config.yaml`` is missing (the own trainer's
    resume reports it). ``ConfigError`` (exit 2) for a finished run."""
    from pathlib import Path

    from gbmpo.train.config import ConfigError, load_config

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return "gbmpo"
    if (Path(run_dir) / "summary.json").is_file():
        raise ConfigError(f"cannot resume {str(run_dir)!r}: the run already finished")
    return str(load_config(path).engine)


def resume(run_dir: str, overrides: list[tuple[str, Any]], *, dry: bool = False,
           restart: bool = False) -> int:
    """``gbmpo train --resume DIR [--dry-run]`` for a ``trl`` or ``verl`` run: continue it from
    its last intact checkpoint with the engine's own resume
    (:func:`gbmpo.engines.trl_runner.resume`, :func:`gbmpo.engines.verl_runner.resume`); prints
    the summary line (dry run: the plan); returns the exit code (2 where the engine cannot run
    here, nothing written). Without a checkpoint: :class:`gbmpo.io.CheckpointError` (exit 1,
    nothing changed) unless ``restart`` (start over in the same directory)."""
    import json
    import sys

    engine = check_resumable(run_dir)
    try:
        if engine == "trl":
            from gbmpo.engines import trl_runner

            if dry:
                print("dry run OK: " + json.dumps(trl_runner.resume(run_dir, overrides, dry=True)))
                return 0
            summary = trl_runner.resume(run_dir, overrides, restart=restart)
        elif engine == "verl":
            from gbmpo.engines import verl_runner

            if dry:
                report = verl_runner.resume_dry_run(run_dir, overrides)
                for check in report.skipped:
                    print(f"warning: {check.name}: {check.detail}", file=sys.stderr)
                print("dry run OK: " + json.dumps(report.to_dict()))
                return 0
            if not restart and not verl_runner.resume_dry_run(run_dir, overrides).info[
                "resume_step"
            ]:
                from gbmpo.train.run import no_checkpoint_error

                raise no_checkpoint_error(run_dir)
            summary = verl_runner.resume(run_dir, overrides)
        else:
            raise ValueError(f"gbmpo.engines.resume: engine {engine!r} is the own trainer's")
    except EngineUnavailable as err:
        print(f"gbmpo train: error: {err}", file=sys.stderr)
        return 2
    _print_summary(summary, engine)
    return 0


def dry_run(config: Any) -> DryRunReport:
    """Check ``config`` for ``config.engine`` without training: the engine-independent checks
    (:func:`gbmpo.engines.checks.common_checks`) and the engine's own (TRL's ``GRPOConfig``;
    verl's composed Hydra config and its validation). GPU-only checks are reported as skipped."""
    if config.engine == "trl":
        from gbmpo.engines import trl_runner

        return trl_runner.dry_run(config)
    if config.engine == "verl":
        from gbmpo.engines import verl_runner

        return verl_runner.dry_run(config)
    raise ValueError(f"gbmpo.engines.dry_run: engine {config.engine!r} is the own trainer's")


def main(config: Any, *, dry: bool = False, notes: Sequence[str] = ()) -> int:
    """The ``gbmpo train`` hook for ``engine: trl | verl``: dry run (prints the resolved config
    and the report) or run (prints the summary line); returns the exit code (2 where the engine
    cannot run here, naming what is missing). ``notes`` (lines for stderr) print once the dry
    run's checks have passed, or before the run starts."""
    import json
    import sys

    from gbmpo.train.config import dump_yaml

    try:
        if dry:
            report = dry_run(config)
            for line in notes:
                print(line, file=sys.stderr)
            print(dump_yaml(config), end="")
            for check in report.skipped:
                print(f"warning: {check.name}: {check.detail}", file=sys.stderr)
            print("dry run OK: " + json.dumps(report.to_dict()))
            return 0
        for line in notes:
            print(line, file=sys.stderr)
        summary = run(config)
    except EngineUnavailable as err:
        print(f"gbmpo train: error: {err}", file=sys.stderr)
        return 2
    _print_summary(summary, config.engine)
    return 0


def _print_summary(summary: dict[str, Any], engine: str) -> None:
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    line = f"finished {summary.get('steps')} steps ({engine}) in "
    line += f"{summary.get('wall_seconds', 0):.0f} s"
    key = next((k for k in ("accuracy", "pass@1") if k in before and k in after), None)
    if key is not None:
        line += f"; held-out {key}: {100 * before[key]:.1f}% -> {100 * after[key]:.1f}%"
    print(line)
    print(f"run directory: {summary.get('run_dir')}")
