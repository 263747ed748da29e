"""Function-local imports carry their reason.

The rule: an import inside a function (or any other indented import) is there only to break a
real import cycle or to defer a heavy or optional dependency, and says which in a comment, on
its line or directly above it (one comment may head a group of imports)::

    # deferred: ray is optional (the ray extra)
    import ray

    # cycle: gbmpo.rewards (which defines REWARDS) imports this module
    from gbmpo.rewards import REWARDS

``# local:`` marks the sandbox's deliberate local bindings (a module bound inside a function
before an untrusted program runs, so that the program cannot patch it through module globals).
Not function-local, so not checked: ``if TYPE_CHECKING:`` blocks, and a module-level ``try:``
whose ``except`` catches ``ImportError`` (an optional dependency guarded at import, and its
fallback).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gbmpo"
TAGS = ("# deferred:", "# cycle:", "# local:")



def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    t = handler.type
    elts = t.elts if isinstance(t, ast.Tuple) else [t] if t is not None else []
    names = {getattr(e, "id", getattr(e, "attr", "")) for e in elts}
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return getattr(t, "id", getattr(t, "attr", "")) == "TYPE_CHECKING"


def indented_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports of ``tree`` that the rule covers (see the module docstring)."""
    exempt: set[int] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and _is_type_checking(node):
            exempt |= {id(n) for n in ast.walk(node)}
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            guarded = node.body + [s for h in node.handlers for s in h.body]
            exempt |= {id(n) for stmt in guarded for n in ast.walk(stmt)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
            and n.col_offset > 0 and id(n) not in exempt]  # fmt: skip


def untagged(source: str) -> list[int]:
    """Line numbers of the covered imports of ``source`` without a reason comment: on the
    statement's lines, or in the comment and import lines directly above it (a blank line
    between two imports, as between the third-party and the gbmpo group, stays in the
    group)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    import_lines: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            import_lines |= set(range(n.lineno, (n.end_lineno or n.lineno) + 1))
    out = []
    for node in indented_imports(tree):
        own = lines[node.lineno - 1:node.end_lineno]
        if any(tag in text for text in own for tag in TAGS):
            continue
        i = node.lineno - 1  # walk up through comments and the imports of the same group
        found = False
        while i >= 1:
            text = lines[i - 1].strip()
            if text.startswith("#") or i in import_lines or (not text and i - 1 in import_lines):
                if any(tag in text for tag in TAGS):
                    found = True
                    break
                i -= 1
                continue
            break
        if not found:
            out.append(node.lineno)
    return sorted(out)


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_indented_import_says_why() -> None:
    bad = []
    for path in _files():
        rel = path.relative_to(PACKAGE).as_posix()
        lines = path.read_text().splitlines()
        for ln in untagged(path.read_text()):
            bad.append(f"src/gbmpo/{rel}:{ln}: {lines[ln - 1].strip()}")
    assert not bad, (
        "function-local imports without '# deferred: ...' (a heavy or optional dependency) or "
        "'# cycle: ...' (an import cycle): move them to the module top, or say why:\n"
        + "\n".join(bad)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f():\n    import json\n    return json\n", [2]),
        ("def f():\n    # deferred: ray is optional\n    import ray\n    import os\n", []),
        ("def f():\n    # deferred: ray is optional\n\n    import ray\n", [4]),
        ("def f():\n    # deferred: heavy\n    import torch\n\n    from gbmpo import x\n", []),
        ("def f():\n    # deferred: heavy\n    import torch\n    y = 1\n    import os\n", [5]),
        ("def f():\n    from a import (\n        b,  # cycle: a imports this module\n    )\n", []),
        ("def f():\n    x = 1\n    import os  # deferred: nothing\n", []),
        ("try:\n    import verl\nexcept ImportError:\n    verl = None\n", []),
        ("try:\n    import verl\nexcept ValueError:\n    pass\n", [2]),
        ("try:\n    import a\nexcept ImportError:\n    from b import a\n", []),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n", []),
        ("class A:\n    def f(self):\n        import os\n", [3]),
    ],
)
def test_the_check_itself(source: str, expected: list[int]) -> None:
    assert untagged(source) == expected
