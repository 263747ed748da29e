"""Write the provenance table of ``configs/paper/*.yaml`` into docs/methods.md, between its
``provenance`` markers; ``--check`` only reports whether the page is up to date (exit 1 if not).
Run it after changing a paper config:

    python scripts/render_provenance.py

Every value line of a paper config starts its comment with one source tag:

* ``[paper LOCATION]``: the paper's text, ``LOCATION`` being where in it (``App. H``,
  ``Table 3``, ``abstract``); the paper is the config's ``# source paper: arXiv ID (NAME)``;
* ``[code NAME]``: the authors' code, ``NAME`` declared in the header as
  ``# source code NAME: OWNER/REPO@COMMIT PATH``;
* ``[gbmpo]``: gbmpo's choice (the paper gives no value, or the value was not available).

A value without a tag, a tag naming an undeclared source, or a tagged key the YAML does not hold
is an error, so a config cannot drift from its table.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "paper"
PAGE = ROOT / "docs" / "methods.md"
START, END = "<!-- provenance:start -->", "<!-- provenance:end -->"

_PAPER = re.compile(r"#\s*source paper:\s*(arXiv \S+)\s*\(([^)]*)\)")
_CODE = re.compile(r"#\s*source code ([\w-]+):\s*(\S+)@([0-9a-f]{7,40})\s+(\S+)")
_KEY = re.compile(r"^(\s*)([A-Za-z_][\w]*):(.*)$")
_TAG = re.compile(r"^\[(paper [^\]]+|code [\w-]+|gbmpo)\]")


class ProvenanceError(ValueError):
    """A paper config whose values are not all tagged with a declared source."""


@dataclass(frozen=True)
class Row:
    config: str
    key: str
    value: str
    source: str


def _split_comment(rest: str) -> tuple[str, str]:
    """``value  # comment`` -> (value, comment); a ``#`` inside quotes is part of the value."""
    quote = ""
    for i, ch in enumerate(rest):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or rest[i - 1].isspace()):
            return rest[:i].strip(), rest[i + 1 :].strip()
    return rest.strip(), ""


def _leaves(data: Any, flow: set[str], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of the block mappings down to their values (a ``{...}`` value is one leaf)."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in flow:
            out.update(_leaves(v, flow, f"{key}."))
        else:
            out[key] = v
    return out


def _show(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


def parse_config(path: Path) -> list[Row]:
    """The rows of one paper config; :class:`ProvenanceError` when a value is untagged."""
    lines = path.read_text().splitlines()
    paper: tuple[str, str] | None = None
    code: dict[str, str] = {}
    for line in lines:
        if m := _PAPER.match(line):
            paper = (m.group(1), m.group(2))
        elif m := _CODE.match(line):
            name = m.group(4).rsplit("/", 1)[-1]
            code[m.group(1)] = f"`{name}` ({m.group(2)} @ {m.group(3)})"
    stack: list[tuple[int, str]] = []
    tagged: dict[str, str] = {}
    flow: set[str] = set()
    for n, line in enumerate(lines, 1):
        m = _KEY.match(line)
        if not m:
            continue
        indent, name, rest = len(m.group(1)), m.group(2), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([s for _, s in stack] + [name])
        value, comment = _split_comment(rest)
        if not value:  # a section: its keys follow, indented
            stack.append((indent, name))
            continue
        if value.startswith("{"):
            flow.add(key)
        t = _TAG.match(comment)
        if not t:
            raise ProvenanceError(
                f"{path.name}:{n}: {key!r} has no source tag; start its comment with [paper "
                "LOCATION], [code NAME] or [gbmpo]"
            )
        tag = t.group(1)
        if tag == "gbmpo":
            source = "gbmpo's choice"
        elif tag.startswith("paper "):
            if paper is None:
                raise ProvenanceError(f"{path.name}:{n}: [paper] without a '# source paper:' line")
            source = f"{paper[0]} ({paper[1]}), {tag[6:].strip()}"
        else:
            ref = tag[5:].strip()
            if ref not in code:
                raise ProvenanceError(
                    f"{path.name}:{n}: [code {ref}] is not declared ('# source code {ref}: "
                    "OWNER/REPO@COMMIT PATH')"
                )
            source = f"authors' code: {code[ref]}"
        tagged[key] = source
    data = yaml.safe_load(path.read_text())
    leaves = _leaves(data, flow)
    missing = sorted(set(leaves) - set(tagged))
    extra = sorted(set(tagged) - set(leaves))
    if missing or extra:
        raise ProvenanceError(f"{path.name}: untagged values {missing}, tags without a value "
                              f"{extra}")  # fmt: skip
    short = re.sub(r"-qwen3-[\d.]+b", "", path.stem)
    return [Row(short, k, _show(leaves[k]), tagged[k]) for k in leaves]


def render_markdown(configs: Path = CONFIGS) -> str:
    """One table: each (key, value, source) with the configs that set it."""
    rows: list[Row] = []
    for path in sorted(configs.glob("*.yaml")):
        rows += parse_config(path)
    order: dict[str, int] = {}
    groups: dict[tuple[str, str, str], list[str]] = {}
    for r in rows:
        order.setdefault(r.key, len(order))
        groups.setdefault((r.key, r.value, r.source), []).append(r.config)
    lines = ["| key | value | source | configs |", "|---|---|---|---|"]
    for (key, value, source), names in sorted(
        groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][2], kv[0][1])
    ):
        shown = value.replace("|", "\\|")
        lines.append(f"| `{key}` | `{shown}` | {source} | {', '.join(names)} |")
    return "\n".join(lines) + "\n"


def rendered(text: str) -> str:
    """``text`` with the block between the markers replaced by the current table."""
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{render_markdown()}{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = ap.parse_args()
    text = PAGE.read_text()
    try:
        new = rendered(text)
    except ProvenanceError as err:
        print(f"render_provenance: {err}", file=sys.stderr)
        return 1
    if args.check:
        if new != text:
            print(f"{PAGE} is out of date: run python scripts/render_provenance.py")
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
