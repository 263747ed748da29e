"""The ``gbmpo`` entry point: subcommands, help, exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gbmpo.cli import main


def test_help_lists_train_and_eval(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "train" in out and "eval" in out


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_train_help_shows_aliases(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--regularizer" in out and "objective.regularizer.name" in out and "--resume" in out


def test_eval_subcommand_is_wired(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--help"])
    assert exc.value.code == 0
    assert "--task" in capsys.readouterr().out


def test_eval_missing_model_exit_2(tmp_path, capsys):
    code = main(["eval", "--task", "arithmetic", "--model", str(tmp_path / "no-model")])
    assert code == 2
    assert "no-model" in capsys.readouterr().err


def test_console_script_exit_code(tmp_path):
    """The installed ``gbmpo`` script (or ``python -m gbmpo.cli``) returns 2 on bad input."""
    script = Path(sys.executable).with_name("gbmpo")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "gbmpo.cli"]
    proc = subprocess.run(
        [*cmd, "train", "--regularizer", "not_a_regularizer", "--output-dir", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "not_a_regularizer" in proc.stderr and "prob_l2" in proc.stderr
    assert not (tmp_path / "r").exists()
