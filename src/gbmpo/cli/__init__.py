"""The ``gbmpo`` command line: one module per subcommand, :mod:`gbmpo.cli.args` for what they
share (argument types, ``--section.key VALUE`` overrides, the error -> exit-code map).

Subcommands: ``train`` (:mod:`gbmpo.cli.train`), ``eval`` (:mod:`gbmpo.cli.eval`), ``es``
(:mod:`gbmpo.cli.es`), ``compare`` (:mod:`gbmpo.cli.compare`) and ``report``
(:mod:`gbmpo.cli.report`).

``gbmpo train`` with no arguments trains the embedded tiny model on the built-in ``arithmetic``
task with Dr. GRPO + ProbL2 and prints held-out accuracy before and after. Any configuration
key can be set as ``--section.key VALUE`` (e.g. ``--objective.regularizer.name kl_k3``,
``--optim.lr 1e-4``) or through a short alias (``--regularizer kl_k3``, ``--lr 1e-4``); a YAML
file is read with ``--config FILE``.

Exit codes: 0 success; 2 bad input (unknown key or name, wrong type, missing model, empty data,
a reward function that fails for a whole batch, ...), reported in one line naming the cause
(:func:`gbmpo.cli.args.report_errors`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gbmpo import __version__
from gbmpo.cli.args import (
    UsageError,
    own_flags,
    parse_overrides,
    positive_int,
    report_errors,
    split_imports,
    unrecognized,
)
from gbmpo.cli.compare import add_compare_parser, run_compare
from gbmpo.cli.es import add_es_parser, run_es
from gbmpo.cli.eval import add_eval_parser, run_eval
from gbmpo.cli.report import add_report_parser, run_report
from gbmpo.cli.train import add_train_parser, run_train
from gbmpo.registry import add_plugin_modules

__all__ = ["UsageError", "main", "parse_overrides", "positive_int", "split_imports"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gbmpo`` command line with ``argv`` (default ``sys.argv[1:]``); return the exit
    code."""
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
    add_train_parser(subparsers)
    add_eval_parser(subparsers)
    add_es_parser(subparsers)
    add_compare_parser(subparsers)
    add_report_parser(subparsers)

    tokens, plugins = split_imports(list(sys.argv[1:] if argv is None else argv))
    args, extra = parser.parse_known_args(tokens)
    args.own_flags = own_flags(subparsers.choices[args.command])  # for "did you mean"

    def run() -> int:
        nonlocal extra
        if plugins:  # imported now, and through $GBMPO_PLUGINS in every process started later

            add_plugin_modules(plugins)
            if args.command in ("train", "compare") and not getattr(args, "resume", None):
                extra = extra + ["--run.plugins", ",".join(plugins)]
        if args.command == "train":
            return run_train(args, extra)
        if args.command == "compare":  # unparsed options are train overrides for every run
            return int(run_compare(args, extra))
        if extra:
            raise unrecognized(extra, args.own_flags)
        if args.command == "eval":
            return int(run_eval(args))
        if args.command == "es":
            return int(run_es(args))
        if args.command == "report":
            return int(run_report(args))
        parser.error(f"unknown command {args.command!r}")  # pragma: no cover
        return 0  # pragma: no cover

    return report_errors(args.command, run)
