"""The layers contract (``[tool.importlinter]`` in pyproject.toml): imports point down only,
function-local ones included. ``lint-imports`` passes on the package, and fails on a copy of it
with one upward import added (a cycle: ``train`` imports ``objectives``). And no import circle
anywhere in the package, inside a folder included (the module graph built with ``ast``), not
even through imports for type hints only."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _lint_imports(src: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the repository's contract, on the ``gbmpo`` package under ``src``."""
    path = os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    code = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run(
        [sys.executable, "-c", code, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=src, env=env, capture_output=True, text=True, timeout=300,
    )


def test_layers_contract_is_kept() -> None:
    pytest.importorskip("importlinter")
    result = _lint_imports(SRC)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "KEPT" in out and "0 broken" in out, out


def test_layers_contract_breaks_on_an_introduced_cycle(tmp_path: Path) -> None:
    pytest.importorskip("importlinter")
    copy = tmp_path / "src" / "gbmpo"
    shutil.copytree(SRC / "gbmpo", copy,
                    ignore=shutil.ignore_patterns("assets", "data", "__pycache__"))
    loss = copy / "objectives" / "loss.py"
    # a function-local import from a lower layer up into train, which imports objectives
    loss.write_text(loss.read_text() + "\n\ndef _upward():\n    from gbmpo.train import Trainer"
                    "\n\n    return Trainer\n")
    result = _lint_imports(tmp_path / "src")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "BROKEN" in out and "1 broken" in out, out
    assert "gbmpo.objectives.loss -> gbmpo.train" in out, out


def test_layers_contract_has_no_exceptions() -> None:
    """Every module obeys the layers: the contract ignores no import (no old path re-exports an
    upper layer's code)."""
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    assert contracts and all(not c.get("ignore_imports") for c in contracts), contracts


# --- no import circle, inside a folder included ------------------------------------------------


def _modules(src: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``src`` by dotted name (a package by its own name)."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path], hints: bool = False) -> set[str]:
    """The modules ``name`` imports, wherever the import statement is (module level, a function,
    a branch), except under ``if TYPE_CHECKING:`` (hints only, never executed) unless ``hints``.
    ``from pkg import x`` is an edge to ``pkg.x`` where that is a module, else to ``pkg``; the
    parent packages Python imports on the way are not edges."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not hints and isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
        visit(node)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in modules and m != name}


def import_circles(src: Path, package: str = "gbmpo", *, hints: bool = False) -> list[list[str]]:
    """The import circles of ``package``: its strongly connected components of more than one
    module (Tarjan), each sorted; with ``hints``, imports under ``if TYPE_CHECKING:`` count."""
    modules = _modules(src, package)
    graph = {name: _imports(name, path, modules, hints) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return circles


def test_no_import_circle_anywhere_in_the_package() -> None:
    """No module of gbmpo reaches itself through imports, a folder's own modules included
    (``lint-imports`` checks the layers between the top-level packages only)."""
    assert import_circles(SRC) == []


def test_no_import_circle_even_through_type_hints() -> None:
    """No module of gbmpo reaches itself through imports, those for type hints included (a
    hint-only circle still sends a reader around it): where a module needs only the shape of a
    type defined above it, it names a Protocol of what it reads."""
    assert import_circles(SRC, hints=True) == []


def test_an_introduced_circle_is_found(tmp_path: Path) -> None:
    """A function-local import closes a circle (found); the same import under ``if
    TYPE_CHECKING:`` does not (hints are not imports), unless hints are counted."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from pkg.sub.b import f\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    assert import_circles(tmp_path, "pkg") == [["pkg.sub.a", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import a\n"
    )
    assert import_circles(tmp_path, "pkg") == []
    assert import_circles(tmp_path, "pkg", hints=True) == [["pkg.sub.a", "pkg.sub.b"]]
