"""The Makefile's install check, on a copy of it beside stand-ins for ``scripts/install.sh``
(.venv) and ``scripts/install_verl_env.sh`` (.venv-verl) that only log their runs: each command
installs the environments it needs when one is missing or one of its inputs is newer than its
stamp, and goes straight to the command otherwise. ``make run`` needs only .venv; ``make test``
(what CI runs) needs both, so the verl tests run in CI; ``make verl`` builds .venv-verl alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_INPUTS = ["requirements.txt", "pyproject.toml", "scripts/install.sh", "scripts/pack_data.py"]
VERL_INPUTS = ["requirements-verl.txt", "pyproject.toml", "scripts/install_verl_env.sh"]
INPUTS = sorted(set(VENV_INPUTS + VERL_INPUTS))
# stands in for both install scripts: logs which ran and makes that environment, whose python and
# gbmpo print what they were asked to run
FAKE_INSTALL = """#!/usr/bin/env bash
set -euo pipefail
echo {env} >> installs.log
mkdir -p {env}/bin
for exe in python gbmpo; do
  printf '#!/usr/bin/env bash\\necho "%s $*"\\n' "{env}/bin/$exe" > "{env}/bin/$exe"
  chmod +x "{env}/bin/$exe"
done
"""
FAKES = {"scripts/install.sh": ".venv", "scripts/install_verl_env.sh": ".venv-verl"}

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    for rel in INPUTS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        text = FAKE_INSTALL.format(env=FAKES[rel]) if rel in FAKES else "x\n"
        (tmp_path / rel).write_text(text)
    past = time.time() - 3600  # inputs an hour old, so a fresh stamp is newer
    for rel in INPUTS:
        os.utime(tmp_path / rel, (past, past))
    return tmp_path


def _make(tree: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    full.pop("GBMPO_INSTALL_VERL", None)
    full.update(env)
    return subprocess.run(["make", "--no-print-directory", *args], cwd=tree, env=full,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def _installs(tree: Path) -> list[str]:
    log = tree / "installs.log"
    return log.read_text().split() if log.exists() else []


def test_run_installs_only_venv_and_never_mentions_verl(tree):
    plan = _make(tree, "-n", "run").stdout
    assert "bash scripts/install.sh" in plan
    assert "install_verl_env" not in plan and ".venv-verl" not in plan
    proc = _make(tree, "run", "ARGS=--steps 3")
    assert proc.returncode == 0, proc.stderr
    assert _installs(tree) == [".venv"]
    assert ".venv/bin/gbmpo train --steps 3" in proc.stdout
    assert not (tree / ".venv-verl").exists()
    # installed: straight to the command, whatever the verl environment's state
    assert _make(tree, "-n", "run").stdout.strip() == ".venv/bin/gbmpo train"


def test_test_installs_both_once_then_runs_the_command_directly(tree):
    proc = _make(tree, "test", "ARGS=-x tests/cli/test_cli.py")
    assert proc.returncode == 0, proc.stderr
    assert _installs(tree) == [".venv", ".venv-verl"]  # CI's `make test` runs the verl tests too
    # on 2 pytest-xdist workers, the ARGS after the defaults (so a later `-n 0` wins)
    assert ".venv/bin/python -m pytest -n 2 -x tests/cli/test_cli.py" in proc.stdout
    serial = _make(tree, "test", "JOBS=0", "ARGS=tests/io").stdout
    assert ".venv/bin/python -m pytest -n 0 tests/io" in serial
    assert (tree / ".venv" / ".gbmpo-installed").is_file()
    assert (tree / ".venv-verl" / ".gbmpo-installed").is_file()
    for target in ("install", "verl", "test", "run"):
        plan = _make(tree, "-n", target).stdout
        assert "bash scripts/install" not in plan, (target, plan)
    assert _make(tree, "-q", "install").returncode == 0
    assert _make(tree, "-q", "verl").returncode == 0
    assert _make(tree, "run").returncode == 0
    assert _installs(tree) == [".venv", ".venv-verl"]


def test_verl_builds_only_the_verl_environment(tree):
    assert _make(tree, "verl").returncode == 0
    assert _installs(tree) == [".venv-verl"]
    assert _make(tree, "-q", "verl").returncode == 0
    assert _make(tree, "test").returncode == 0
    assert _installs(tree) == [".venv-verl", ".venv"]


@pytest.mark.parametrize("changed", INPUTS)
def test_a_newer_input_reinstalls_the_environments_it_feeds(tree, changed):
    assert _make(tree, "test").returncode == 0
    future = time.time() + 60
    os.utime(tree / changed, (future, future))
    plan = _make(tree, "-n", "test").stdout
    assert ("bash scripts/install.sh" in plan) == (changed in VENV_INPUTS)
    assert ("bash scripts/install_verl_env.sh" in plan) == (changed in VERL_INPUTS)
    assert _make(tree, "test").returncode == 0
    expected = [".venv", ".venv-verl"]
    expected += [env for env, inputs in ((".venv", VENV_INPUTS), (".venv-verl", VERL_INPUTS))
                 if changed in inputs]  # fmt: skip
    assert _installs(tree) == expected


def test_a_missing_environment_reinstalls_where_needed(tree):
    assert _make(tree, "test").returncode == 0
    shutil.rmtree(tree / ".venv-verl")
    assert _make(tree, "run").returncode == 0  # make run does not need it
    assert _make(tree, "-q", "verl").returncode == 1
    # GBMPO_INSTALL_VERL=0: make test without the verl environment (its tests skip)
    proc = _make(tree, "test", GBMPO_INSTALL_VERL="0")
    assert proc.returncode == 0 and "install_verl_env" not in proc.stdout
    assert _make(tree, "test").returncode == 0
    assert (tree / ".venv-verl" / "bin" / "python").is_file()
    shutil.rmtree(tree / ".venv")
    assert _make(tree, "-q", "install").returncode == 1
    assert _make(tree, "run").returncode == 0
    assert _installs(tree) == [".venv", ".venv-verl", ".venv-verl", ".venv"]


@pytest.mark.parametrize("script", sorted(FAKES))
def test_a_failed_install_leaves_no_stamp(tree, script):
    (tree / script).write_text("echo failed >> installs.log; exit 3\n")
    assert _make(tree, "test").returncode != 0
    assert not (tree / FAKES[script] / ".gbmpo-installed").exists()
    target = "install" if FAKES[script] == ".venv" else "verl"
    assert _make(tree, "-q", target).returncode == 1  # the next call tries again


def test_portable_runs_the_numerics_and_parity_tests_with_plain_kernels(tree):
    """``make test-portable`` runs the named numerics and parity paths (which exist) under
    ATEN_CPU_CAPABILITY=default, and CI runs it after ``make test``."""
    proc = _make(tree, "test-portable", "ARGS=-x")
    assert proc.returncode == 0, proc.stderr
    assert "ATEN_CPU_CAPABILITY=default .venv/bin/python -m pytest" in proc.stdout
    # what the (stand-in) python was asked to run
    line = next(x for x in proc.stdout.splitlines() if x.startswith(".venv/bin/python -m pytest"))
    assert line.startswith(".venv/bin/python -m pytest -n 2 ")
    paths = line.split("-n 2 ", 1)[1].split()
    assert paths[-1] == "-x"
    for required in ("tests/objectives", "tests/integrations", "tests/engines"):
        assert required in paths
    assert all((REPO / p).exists() for p in paths[:-1]), paths
    ci = (REPO / ".ci" / "run").read_text().split()
    assert ci.index("test-portable") > ci.index("test")
