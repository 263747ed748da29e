"""A griffe extension for the API reference: gbmpo's docstrings use Sphinx roles
(``:func:`x```, ``:math:`x```) and ``.. math::`` blocks, which mkdocstrings would print as they
are written. This turns each cross-reference role into inline code, each ``:math:`` role into
inline math (``$x$``) and each math block into a display block (``$$ ... $$``), which
``pymdownx.arithmatex`` hands to MathJax (served from the site, see ``scripts/mkdocs_hooks.py``).
Loaded by ``mkdocs.yml`` (``extensions`` of the python handler).
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
    ```title```; ``:math:`x``` -> ``$x$`` (inline math, its line breaks and continuation
    backslashes joined into one line)."""
    kind, text = match.group(1), match.group(2)
    if kind == "math":
        return "$" + " ".join(re.sub(r"(?<!\\)\\[ \t]*\n", " ", text).split()) + "$"
    text = text.lstrip("!")
    titled = re.fullmatch(r"(.+?)\s*<[^>]+>", text)
    if titled:
        text = titled.group(1)
    elif text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    return f"`{text}`"


def _math_block(match: re.Match[str]) -> str:
    """An indented ``.. math::`` block -> a ``$$`` display block at the directive's indentation."""
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
    return f"{indent}$$\n{text}\n{indent}$$\n\n"


_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Attributes):\s*$")
_ENTRY = re.compile(r"^(\s*)([A-Za-z_]\w*(?:,\s*[A-Za-z_]\w*)+):(.*)$")


def split_shared_entries(text: str) -> str:
    """Google-style entries that document several names at once (``eps_low, eps_high: ...``)
    become one entry per name with the same description, which griffe's Google parser reads
    (it takes ``a, b`` for one parameter named so)."""
    lines = text.splitlines()
    out: list[str] = []
    i, in_section, entry_indent = 0, False, -1
    while i < len(lines):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        if _SECTION.match(line):
            in_section, entry_indent = True, -1
            out.append(line)
            i += 1
            continue
        if in_section and line.strip():
            if entry_indent < 0:
                entry_indent = indent
            elif indent < entry_indent:
                in_section = False
        m = _ENTRY.match(line) if in_section and indent == entry_indent else None
        if not m:
            out.append(line)
            i += 1
            continue
        block = [line]
        i += 1
        while i < len(lines) and (not lines[i].strip() or
                                  len(lines[i]) - len(lines[i].lstrip()) > entry_indent):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            i -= 1
            block.pop()
        for name in (n.strip() for n in m.group(2).split(",")):
            out.append(f"{m.group(1)}{name}:{m.group(3)}")
            out += block[1:]
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def render_sphinx_markup(text: str) -> str:
    """The docstring ``text`` with its Sphinx roles and math blocks made Markdown, and
    shared Google-style entries split (:func:`split_shared_entries`)."""
    return split_shared_entries(_ROLE.sub(_role, _MATH_BLOCK.sub(_math_block, text)))


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring as it is loaded (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = render_sphinx_markup(obj.docstring.value)
