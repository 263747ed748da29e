"""The ``gbmpo train`` commands of docs/engines.md run verbatim here, as dry runs (``--dry-run``
appended where missing: GPU-only parts are checked, not trained). Lines with placeholders
(``...``, ``my.yaml``, ``my_config.yaml``) are templates and are skipped."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from gbmpo.cli import main

PLACEHOLDERS = ("...", "my.yaml", "my_config")
DOC = Path(__file__).resolve().parents[1] / "docs" / "engines.md"


@pytest.fixture(scope="module", autouse=True)
def _verl_validates_each_config_once(verl_check_memo: dict) -> dict:
    """verl's validation of a composed config runs once per distinct config in this file (the
    ``packed`` and ``hidden`` dry runs of a config compose the same one: tests/conftest.py);
    module-scoped, so this file's tests stay on one xdist worker and share it."""
    return verl_check_memo


def _commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    seen: dict[str, None] = {}
    for block in blocks:
        for line in block.splitlines():
            cmd = line.split("#", 1)[0].strip()
            if not cmd.startswith("gbmpo train") or any(p in cmd for p in PLACEHOLDERS):
                continue
            if "--dry-run" not in cmd:
                cmd += " --dry-run"
            seen.setdefault(cmd)
    return list(seen)


def test_doc_has_commands_for_every_engine() -> None:
    text = " ".join(_commands())
    assert "--engine trl" in text  # the own engine is the default; verl through a paper config
    assert "configs/paper/rpg-" in text and "configs/paper/gbmpo-" in text


@pytest.mark.parametrize("command", _commands())
def test_doc_command_runs(command: str, data_mode: str, capsys: pytest.CaptureFixture) -> None:
    """Each command exits 0 with this checkout's data and in a user's clone without it."""
    argv = shlex.split(command)[1:]
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    assert "dry run OK" in capsys.readouterr().out
