"""The ``gbmpo`` command line.

Subcommands: ``train`` (this module) and ``eval`` (:mod:`gbmpo.eval.cli`).

``gbmpo train`` with no arguments trains the embedded tiny model on the built-in ``arithmetic``
task with Dr. GRPO + ProbL2 and prints held-out accuracy before and after. Any configuration
key can be set as ``--section.key VALUE`` (e.g. ``--objective.regularizer.name kl_k3``,
``--optim.lr 1e-4``) or through a short alias (``--regularizer kl_k3``, ``--lr 1e-4``); a YAML
file is read with ``--config FILE``.

Exit codes: 0 success; 2 bad input (unknown key or name, wrong type, missing model, empty data,
a reward function that fails for a whole batch, ...), reported in one line naming the cause.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "parse_overrides"]


class UsageError(ValueError):
    """Malformed command-line arguments."""


def positive_int(text: str) -> int:
    """``argparse`` type of the subcommands' counts: an integer ``>= 1``."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def parse_overrides(tokens: Sequence[str]) -> list[tuple[str, Any]]:
    """``["--optim.lr", "1e-4", "--lora", "--steps=5"]`` -> ``[(key, value-or-True), ...]``.

    A flag without a value means ``true`` (only valid for boolean keys).
    """
    from gbmpo.train.config import _annotation_at, canonical_key

    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--") or tok == "--":
            raise UsageError(f"unexpected argument {tok!r}; settings look like --section.key VALUE")
        body = tok[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            key, value = body, tokens[i + 1]
            i += 2
        else:
            key, value = body, None
            i += 1
        if value is None:
            if _annotation_at(canonical_key(key).split(".")) is not bool:
                raise UsageError(f"--{key} needs a value")
            value = "true"
        out.append((key, value))
    return out


def split_imports(tokens: list[str]) -> tuple[list[str], list[str]]:
    """Take every ``--import MODULE`` / ``--import=MODULE`` (comma lists allowed) out of
    ``tokens``; returns ``(other tokens, modules)``."""
    rest: list[str] = []
    modules: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--import":
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("-"):
                raise SystemExit("gbmpo: error: --import needs a module name")
            value, i = tokens[i + 1], i + 2
        elif tok.startswith("--import="):
            value, i = tok.split("=", 1)[1], i + 1
        else:
            rest.append(tok)
            i += 1
            continue
        modules += [m.strip() for m in value.split(",") if m.strip()]
    return rest, modules


def _add_train_parser(subparsers: Any) -> None:
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
        help="continue an unfinished run from its last checkpoint (its config.yaml is used)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config and build everything but the model weights; no training",
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration and exit"
    )


def _run_train(args: argparse.Namespace, extra: list[str]) -> int:
    from transformers.utils import logging as hf_logging

    from gbmpo.train import Trainer, dry_run, load_config
    from gbmpo.train.config import dump_yaml

    hf_logging.disable_progress_bar()  # weight loading/saving bars; training has its own
    overrides = parse_overrides(extra)
    if args.resume:
        if args.config:
            raise UsageError("--resume uses the run's own config.yaml; drop --config")
        from gbmpo.engines import check_resumable

        check_resumable(args.resume)  # trl / verl runs are not resumed by the own trainer
        trainer = Trainer.resume(args.resume, overrides)
        summary = trainer.train()
        _print_summary(summary)
        return 0
    cfg = load_config(args.config, overrides)
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    if cfg.engine != "gbmpo":  # trl / verl: gbmpo.engines builds and launches them
        from gbmpo import engines

        return engines.main(cfg, dry=args.dry_run)
    if args.dry_run:
        info = dry_run(cfg)
        print(dump_yaml(cfg), end="")
        print("dry run OK: " + json.dumps(info))
        return 0
    summary = Trainer(cfg).train()
    _print_summary(summary)
    return 0


def _print_summary(summary: dict[str, Any]) -> None:
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


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from gbmpo.registry import PluginError, UnknownNameError
    from gbmpo.rewards.sandbox import SandboxUnavailableError
    from gbmpo.train import ConfigError, DataError, RewardError

    return (UsageError, ConfigError, DataError, RewardError, UnknownNameError, FileNotFoundError,
            PluginError, SandboxUnavailableError)


def _checkpoint_error() -> type[BaseException]:
    from gbmpo.train.checkpoint import CheckpointError

    return CheckpointError


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gbmpo`` command line with ``argv`` (default ``sys.argv[1:]``); return the exit
    code."""
    from gbmpo import __version__
    from gbmpo.eval.cli import add_eval_parser, run_eval
    from gbmpo.experiments.cli import (
        add_compare_parser,
        add_report_parser,
        run_compare,
        run_report,
    )
    from gbmpo.meta.cli import add_es_parser, run_es

    parser = argparse.ArgumentParser(
        prog="gbmpo",
        description="RL post-training of language models with the divergence geometry as a knob.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"gbmpo {__version__}")
    parser.add_argument(
        "--import", dest="imports", metavar="MODULE", action="append", default=[],
        help="import MODULE first, so that the tasks, rewards and regularizers it registers can "
             "be named (repeatable, or a comma list; allowed anywhere on the command line; "
             "packages can instead declare entry points in the groups gbmpo.tasks, "
             "gbmpo.rewards, gbmpo.regularizers)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    _add_train_parser(subparsers)
    add_eval_parser(subparsers)
    add_es_parser(subparsers)
    add_compare_parser(subparsers)
    add_report_parser(subparsers)

    tokens, plugins = split_imports(list(sys.argv[1:] if argv is None else argv))
    args, extra = parser.parse_known_args(tokens)
    try:
        if plugins:  # imported now, and through $GBMPO_PLUGINS in every process started later
            from gbmpo.registry import add_plugin_modules

            add_plugin_modules(plugins)
            if args.command in ("train", "compare") and not getattr(args, "resume", None):
                extra = extra + ["--run.plugins", ",".join(plugins)]
        if args.command == "train":
            return _run_train(args, extra)
        if args.command == "compare":  # unparsed options are train overrides for every run
            return int(run_compare(args, extra))
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command == "eval":
            return int(run_eval(args))
        if args.command == "es":
            return int(run_es(args))
        if args.command == "report":
            return int(run_report(args))
        parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    except _bad_input_errors() as err:
        print(f"gbmpo {args.command}: error: {err}", file=sys.stderr)
        return 2
    except _checkpoint_error() as err:  # no intact checkpoint, or one could not be written
        print(f"gbmpo {args.command}: error: {err}", file=sys.stderr)
        return 1
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
