"""Former home of ``gbmpo es``'s command-line code, now :mod:`gbmpo.cli.es` (its configuration:
:mod:`gbmpo.meta.config`); its names stay importable here, and ``python -m gbmpo.meta.cli`` runs
``gbmpo es``. Nothing in gbmpo imports this module (the layers contract allows it its upward
imports)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gbmpo.cli.es import add_es_parser, run_es
from gbmpo.meta.config import DEFAULT_ES_CONFIG, load_es_config

__all__ = ["DEFAULT_ES_CONFIG", "add_es_parser", "load_es_config", "main", "run_es"]


def main(argv: Sequence[str] | None = None) -> int:
    """``gbmpo es`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    from gbmpo.cli import main as gbmpo_main

    return gbmpo_main(["es", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
