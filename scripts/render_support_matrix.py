"""Write the support matrix (gbmpo.config.support) into docs/cli-and-config.md, between its
``support-matrix`` markers; ``--check`` only reports whether the page is up to date (exit 1 if
not). Run it after changing an engine's entries:

    python scripts/render_support_matrix.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gbmpo.config.support import render_markdown

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli-and-config.md"
START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"


def rendered(text: str) -> str:
    """``text`` with the block between the markers replaced by the current matrix."""
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{render_markdown()}{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = ap.parse_args()
    text = PAGE.read_text()
    new = rendered(text)
    if args.check:
        if new != text:
            print(f"{PAGE} is out of date: run python scripts/render_support_matrix.py")
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
