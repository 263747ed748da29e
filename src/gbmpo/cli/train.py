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
from typing import Any

from gbmpo.cli.args import UsageError, parse_overrides

__all__ = ["add_train_parser", "print_summary", "run_train"]


def add_train_parser(subparsers: Any) -> None:
    from gbmpo.train.config import ALIASES

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
    from transformers.utils import logging as hf_logging

    from gbmpo.train import Trainer, dry_run
    from gbmpo.train.config import dump_yaml

    hf_logging.disable_progress_bar()  # weight loading/saving bars; training has its own
    overrides = parse_overrides(extra, flags=getattr(args, "own_flags", ()))
    if args.resume:
        if args.config:
            raise UsageError("--resume uses the run's own config.yaml; drop --config")
        from gbmpo.engines import check_resumable

        engine = check_resumable(args.resume)
        if engine != "gbmpo":  # trl / verl: the engine's own resume, driven by gbmpo.engines
            from gbmpo import engines

            return engines.resume(args.resume, overrides, dry=args.dry_run,
                                  restart=args.restart)  # fmt: skip
        if args.dry_run:
            from gbmpo.train.checkpoint import latest_valid_checkpoint
            from gbmpo.train.run import resume_config

            _, path = resume_config(args.resume, overrides)
            found = latest_valid_checkpoint(path)
            print("dry run OK: " + json.dumps({"resume_from": str(found) if found else None}))
            return 0
        trainer = Trainer.resume(args.resume, overrides, restart=args.restart)
        summary = trainer.train()
        print_summary(summary)
        return 0
    if args.restart:
        raise UsageError("--restart goes with --resume RUN_DIR")
    cfg = load_config_noting_renames(args.config, overrides)
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    # bad values and what the engine refuses stop here (exit 2), before any write; a dry run
    # checks a config whose mirror map an ES run has yet to write with the map's initialisation
    from gbmpo.engines.checks import without_missing_mirror
    from gbmpo.train.config import validate
    from gbmpo.train.support import check_support

    validate(without_missing_mirror(cfg) if args.dry_run else cfg)
    # the no-effect notes print once the config has passed every check: a failing command
    # prints its one error line and nothing else
    notes = [f"note: {notice}" for notice in check_support(cfg)]
    if cfg.engine != "gbmpo":  # trl / verl: gbmpo.engines builds and launches them
        from gbmpo import engines

        return engines.main(cfg, dry=args.dry_run, notes=notes)
    if args.dry_run:
        info = dry_run(cfg)
        _print_notes(notes)
        print(dump_yaml(cfg), end="")
        for line in info["notes"]:
            print(line)
        for line in info["warnings"]:
            print(f"warning: {line}", file=sys.stderr)
        print("dry run OK: " + json.dumps(info))
        return 0
    trainer = Trainer(cfg)
    _print_notes(notes)
    summary = trainer.train()
    print_summary(summary)
    return 0


def _print_notes(notes: list[str]) -> None:
    for line in notes:
        print(line, file=sys.stderr)


def load_config_noting_renames(path: str | None, overrides: list[tuple[str, Any]]) -> Any:
    """:func:`gbmpo.train.load_config`, printing each renamed key it read under its new name as
    a ``note:`` line on stderr (the library's ``DeprecationWarning``)."""
    import warnings

    from gbmpo.train import load_config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        cfg = load_config(path, overrides)
    for w in caught:
        if issubclass(w.category, DeprecationWarning):
            print(f"note: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return cfg


def print_summary(summary: dict[str, Any]) -> None:
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    key = next((k for k in ("accuracy", "pass@1") if k in before or k in after), None)
    line = f"finished {summary['steps']} steps in {summary['wall_seconds']:.0f} s"
    if key is not None and key in before and key in after:
        gain = 100 * (after[key] - before[key])
        line += (
            f"; held-out {key}: {100 * before[key]:.1f}% -> {100 * after[key]:.1f}% "
            f"({gain:+.1f} points)"
        )
    print(line)
    print(f"run directory: {summary['run_dir']}")
