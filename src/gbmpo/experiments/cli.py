"""Former home of ``gbmpo compare`` and ``gbmpo report``'s command-line code, now
:mod:`gbmpo.cli.compare` and :mod:`gbmpo.cli.report` (run-directory discovery:
:mod:`gbmpo.experiments.runs`); the names stay importable here, and
``python -m gbmpo.experiments.cli compare|report ...`` runs them. Nothing in gbmpo imports this
module (the layers contract allows it its upward imports)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gbmpo.cli.compare import add_compare_parser, run_compare
from gbmpo.cli.report import add_report_parser, run_report
from gbmpo.experiments.runs import assign_labels, find_run_dirs

__all__ = [
    "add_compare_parser",
    "add_report_parser",
    "assign_labels",
    "find_run_dirs",
    "main",
    "run_compare",
    "run_report",
]


def main(argv: Sequence[str] | None = None) -> int:
    """``gbmpo compare|report ...`` with ``argv`` (default ``sys.argv[1:]``); returns the exit
    code."""
    from gbmpo.cli import main as gbmpo_main

    return gbmpo_main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
