"""A griffe extension for the API reference: gbmpo's docstrings use Sphinx roles
(``:func:`x```, ``:math:`x```) and ``.. math::`` blocks, which mkdocstrings would print as they
are written. This turns each role into inline code and each math block into a fenced block, so
the API pages read as text. Loaded by ``mkdocs.yml`` (``extensions`` of the python handler).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(func|class|meth|mod|data|attr|exc|obj|math):`([^`]+)`")
_MATH_BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)\.\. math::[ \t]*(?P<first>.*)\n"
    r"(?P<body>(?:[ \t]*\n|(?P=indent)[ \t]+\S.*\n?)*)",
    re.MULTILINE)


def _role(match: re.Match[str]) -> str:
    """A role as inline code: ``:func:`~a.b.c``` -> ```c```, ``:class:`title <a.b>``` ->
    ```title```, ``:math:`x``` -> ```x```."""
    kind, text = match.group(1), match.group(2)
    if kind != "math":
        text = text.lstrip("!")
        titled = re.fullmatch(r"(.+?)\s*<[^>]+>", text)
        if titled:
            text = titled.group(1)
        elif text.startswith("~"):
            text = text[1:].rsplit(".", 1)[-1]
    return f"`{text}`"


def _math_block(match: re.Match[str]) -> str:
    """An indented ``.. math::`` block -> a fenced block at the directive's indentation."""
    indent = match.group("indent")
    lines = match.group("body").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    body = [line for line in lines if line.strip()]
    cut = min(len(line) - len(line.lstrip()) for line in body) if body else 0
    text = "\n".join(indent + line[cut:] if line.strip() else "" for line in lines).strip("\n")
    first = match.group("first").strip()
    if first:
        text = f"{indent}{first}\n{text}" if text else f"{indent}{first}"
    return f"{indent}```text\n{text}\n{indent}```\n\n"


def render_sphinx_markup(text: str) -> str:
    """The docstring ``text`` with its Sphinx roles and math blocks made Markdown."""
    return _ROLE.sub(_role, _MATH_BLOCK.sub(_math_block, text))


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring as it is loaded (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = render_sphinx_markup(obj.docstring.value)
