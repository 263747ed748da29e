"""``gbmpo train``: RL-train a model.

With no arguments it trains the embedded tiny model on the built-in ``arithmetic`` task with
Dr. GRPO + ProbL2 and prints held-out accuracy before and after. Any configuration key can be set
as ``--section.key VALUE`` (e.g. ``--objective.regularizer.name kl_k3``, ``--optim.lr 1e-4``)
or through a short alias (``--regularizer kl_k3``, ``--lr 1e-4``); a YAML file is read with
``--config FILE``.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import TYPE_CHECKING, Any

from gbmpo.cli.args import UsageError, one_line, parse_overrides
from gbmpo.config import ALIASES, dump_yaml
from gbmpo.engines import EngineUnavailable, check_resumable, engine_for, get_engine
from gbmpo.train import load_config

if TYPE_CHECKING:
    from gbmpo.engines import DryRun

__all__ = ["add_train_parser", "run_train"]


def add_train_parser(subparsers: Any) -> None:
    aliases = "\n".join(f"  --{a:<18} = --{k}" for a, k in sorted(ALIASES.items()))
    p = subparsers.add_parser(
        "train",
        help="RL-train a model (default: the embedded tiny model, Dr. GRPO + ProbL2)",
        description=(
            "Train with a GRPO-family objective. Every configuration key can be overridden as "
            "--section.key VALUE (see --print-config for all keys and their defaults)."
        ),
        epilog="aliases:\n" + aliases,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--config", metavar="FILE", help="YAML configuration file")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue an unfinished run from its last checkpoint (its config.yaml is used; "
        "runs of every engine: trl through TRL's resume_from_checkpoint, verl through its "
        "trainer.resume_mode)",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="with --resume, for a run that has no checkpoint: start it over from step 0 in the "
        "same directory (its metrics.jsonl rows are dropped); without it such a resume exits 1 "
        "and changes nothing",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config and build everything but the model weights; no training",
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration and exit"
    )


def run_train(args: argparse.Namespace, extra: list[str]) -> int:
    """``gbmpo train``: the engine the config (or ``--resume DIR``'s run) names, from the
    registry :data:`gbmpo.engines.ENGINES`, through the same :class:`gbmpo.engines.Engine`
    methods for every engine; an engine that cannot run here exits 2 naming what is missing."""
    try:
        return _run_train(args, extra)
    except EngineUnavailable as err:
        print(f"gbmpo train: error: {one_line(err)}", file=sys.stderr)
        return 2


def _run_train(args: argparse.Namespace, extra: list[str]) -> int:
    # deferred: transformers is heavy; `gbmpo --help` imports this module without it
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight loading/saving bars; training has its own
    overrides = parse_overrides(extra, flags=getattr(args, "own_flags", ()))
    if args.resume:
        if args.config:
            raise UsageError("--resume uses the run's own config.yaml; drop --config")
        engine = get_engine(check_resumable(args.resume))  # the engine that trained it
        if args.dry_run:
            _print_dry_run(engine.resume_dry_run(args.resume, overrides))
            return 0
        summary = engine.resume(args.resume, overrides, restart=args.restart)
        _print_lines(engine.summary_lines(summary))
        return 0
    if args.restart:
        raise UsageError("--restart goes with --resume RUN_DIR")
    cfg = load_config_noting_renames(args.config, overrides)
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    engine = engine_for(cfg)
    # bad values and what the engine refuses stop here (exit 2), before any write; a dry run
    # checks a config whose mirror map an ES run has yet to write with the map's initialisation.
    # The no-effect notes print once the config has passed every check (dry run: the dry run's
    # too; a run: once the engine is ready to start), so a failing command prints its one
    # error line and nothing else
    notes = [f"note: {notice}" for notice in engine.check(cfg, dry=args.dry_run)]
    if args.dry_run:
        report = engine.dry_run(cfg)
        _print_lines(notes, err=True)
        print(dump_yaml(cfg), end="")
        _print_dry_run(report)
        return 0
    summary = engine.train(cfg, on_ready=lambda: _print_lines(notes, err=True))
    _print_lines(engine.summary_lines(summary))
    return 0


def _print_dry_run(report: DryRun) -> None:
    """A :class:`gbmpo.engines.DryRun`: its notes (stdout), its warnings (stderr) and the
    ``dry run OK: {...}`` line."""
    _print_lines(report.notes)
    _print_lines([f"warning: {line}" for line in report.warnings], err=True)
    print("dry run OK: " + json.dumps(report.to_dict()))


def _print_lines(lines: list[str], *, err: bool = False) -> None:
    for line in lines:
        print(line, file=sys.stderr if err else sys.stdout)


def load_config_noting_renames(path: str | None, overrides: list[tuple[str, Any]]) -> Any:
    """:func:`gbmpo.train.load_config`, printing each renamed key it read under its new name as
    a ``note:`` line on stderr (the library's ``DeprecationWarning``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        cfg = load_config(path, overrides)
    for w in caught:
        if issubclass(w.category, DeprecationWarning):
            print(f"note: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return cfg
