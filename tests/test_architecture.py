"""The layers contract (``[tool.importlinter]`` in pyproject.toml): imports point down only,
function-local ones included. ``lint-imports`` passes on the package, and fails on a copy of it
with one upward import added (a cycle: ``train`` imports ``objectives``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

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
    result = _lint_imports(SRC)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "KEPT" in out and "0 broken" in out, out


def test_layers_contract_breaks_on_an_introduced_cycle(tmp_path: Path) -> None:
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
