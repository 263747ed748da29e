"""The Makefile's install check, on a copy of it beside a stand-in ``scripts/install.sh`` that only
counts its runs: ``make test`` / ``make run`` install when ``.venv`` (or ``.venv-verl``) is
missing or an install input is newer than the stamp, and go straight to the command otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INPUTS = ["requirements.txt", "requirements-verl.txt", "pyproject.toml", "scripts/install.sh",
          "scripts/install_verl_env.sh", "scripts/pack_data.py"]
# stands in for scripts/install.sh: counts its runs and makes the two environments, whose
# python and gbmpo print what they were asked to run
FAKE_INSTALL = """#!/usr/bin/env bash
set -euo pipefail
echo run >> installs.log
for env in .venv .venv-verl; do
  if [ "$env" = .venv-verl ] && [ "${GBMPO_INSTALL_VERL:-1}" = 0 ]; then continue; fi
  mkdir -p "$env/bin"
  for exe in python gbmpo; do
    printf '#!/usr/bin/env bash\\necho "%s $*"\\n' "$env/bin/$exe" > "$env/bin/$exe"
    chmod +x "$env/bin/$exe"
  done
done
"""

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    for rel in INPUTS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(FAKE_INSTALL if rel == "scripts/install.sh" else "x\n")
    past = time.time() - 3600  # inputs an hour old, so a fresh stamp is newer
    for rel in INPUTS:
        os.utime(tmp_path / rel, (past, past))
    return tmp_path


def _make(tree: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    full.pop("GBMPO_INSTALL_VERL", None)
    full.update(env)
    return subprocess.run(["make", "--no-print-directory", *args], cwd=tree, env=full,
                          capture_output=True, text=True, timeout=60)


def _installs(tree: Path) -> int:
    log = tree / "installs.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_installs_once_then_runs_the_command_directly(tree):
    proc = _make(tree, "test", "ARGS=-x tests/test_cli.py")
    assert proc.returncode == 0, proc.stderr
    assert _installs(tree) == 1
    assert ".venv/bin/python -m pytest -x tests/test_cli.py" in proc.stdout
    assert (tree / ".venv" / ".gbmpo-installed").is_file()
    # nothing missing: no install, straight to the command (a dry make shows only it)
    assert _make(tree, "-q", "install").returncode == 0
    proc = _make(tree, "run", "ARGS=--steps 3")
    assert proc.returncode == 0, proc.stderr
    assert ".venv/bin/gbmpo train --steps 3" in proc.stdout
    assert _installs(tree) == 1
    assert "install.sh" not in _make(tree, "-n", "test").stdout


@pytest.mark.parametrize("changed", INPUTS)
def test_a_newer_install_input_reinstalls(tree, changed):
    assert _make(tree, "install").returncode == 0
    future = time.time() + 60
    os.utime(tree / changed, (future, future))
    assert _make(tree, "-q", "install").returncode == 1  # out of date
    assert "bash scripts/install.sh" in _make(tree, "-n", "test").stdout
    assert _make(tree, "test").returncode == 0
    assert _installs(tree) == 2


def test_a_missing_environment_reinstalls(tree):
    assert _make(tree, "install").returncode == 0
    shutil.rmtree(tree / ".venv-verl")
    assert _make(tree, "-q", "install").returncode == 1
    # unless the verl environment is not wanted
    assert _make(tree, "-q", "install", GBMPO_INSTALL_VERL="0").returncode == 0
    assert _make(tree, "install").returncode == 0
    assert (tree / ".venv-verl" / "bin" / "python").is_file()
    shutil.rmtree(tree / ".venv")
    assert _make(tree, "-q", "install").returncode == 1
    assert _make(tree, "run").returncode == 0
    assert _installs(tree) == 3


def test_a_failed_install_leaves_no_stamp(tree):
    (tree / "scripts" / "install.sh").write_text("echo run >> installs.log; exit 3\n")
    proc = _make(tree, "test")
    assert proc.returncode != 0
    assert not (tree / ".venv" / ".gbmpo-installed").exists()
    assert _make(tree, "-q", "install").returncode == 1  # the next call tries again
