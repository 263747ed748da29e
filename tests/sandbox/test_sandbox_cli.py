"""Fail-closed from the command line: on a machine without an isolation layer, ``gbmpo train``
and ``gbmpo eval`` on a code task stop before anything runs (exit 2, naming the layer and the
opt-in), and the opt-in (``--run.allow_unsandboxed_code`` / ``--allow-unsandboxed-code`` /
``GBMPO_ALLOW_UNSANDBOXED_CODE=1``) lets them run with a warning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gbmpo.sandbox.client as sb
from gbmpo.cli import main

FAST = ["--rollout.prompts_per_step", "2", "--num-generations", "2", "--max-new-tokens", "8",
        "--eval.before", "false", "--eval.after", "false", "--eval-every", "0",
        "--time-budget", "null", "--run.progress", "false", "--mu", "1",
        "--optim.mini_batch_size", "null", "--steps", "1"]


@pytest.fixture
def no_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as one without bubblewrap (a fresh default sandbox, no opt-in)."""
    import torch

    torch.set_num_threads(1)
    real_which = sb.shutil.which
    monkeypatch.setattr(sb.shutil, "which",
                        lambda name, *a, **k: None if name == "bwrap" else real_which(name))
    monkeypatch.delenv(sb.ALLOW_ENV, raising=False)
    monkeypatch.delenv("GBMPO_SANDBOX_STRICT", raising=False)
    monkeypatch.setattr(sb, "_default", None)


def _code_task(tmp_path: Path) -> list[str]:
    rows = [{"q": f"Write f returning {i}.", "tests": [f"assert f() == {i}"]} for i in range(6)]
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return ["--task", "jsonl", "--task.template", "base", "--task.params.path", str(data),
            "--task.params.prompt_column", "q", "--task.params.answer_column", "null",
            "--task.params.reward", "code", "--task.params.test_path", str(data)]


def test_train_refuses_without_isolation_and_writes_nothing(
    no_bwrap: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(["train", *_code_task(tmp_path), *FAST, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "bubblewrap" in err and "apt-get install" in err and sb.ALLOW_ENV in err, err
    assert not out.exists()


def test_train_runs_weaker_only_when_opted_in(
    no_bwrap: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(sb.ALLOW_ENV, "0")  # restored after the test (the opt-in sets it)
    out = tmp_path / "run"
    with pytest.warns(sb.SandboxWarning, match="bubblewrap"):
        code = main(["train", *_code_task(tmp_path), *FAST, "--output-dir", str(out),
                     "--run.allow_unsandboxed_code", "true"])
    assert code == 0
    assert (out / "summary.json").is_file()
    assert "bubblewrap" in sb.get_default_sandbox().missing


def test_eval_refuses_then_runs_with_the_flag(
    no_bwrap: None, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "code.jsonl"
    _code_task(tmp_path)
    args = ["eval", "--task", "jsonl", "--template", "base", "--task-param", f"path={data}",
            "--task-param", "prompt_column=q", "--task-param", "answer_column=null",
            "--task-param", "reward=code", "--task-param", f"test_path={data}",
            "--limit", "2", "--max-new-tokens", "8"]
    assert main(args) == 2
    assert "bubblewrap" in capsys.readouterr().err
    monkeypatch.setenv(sb.ALLOW_ENV, "0")
    with pytest.warns(sb.SandboxWarning, match="bubblewrap"):
        assert main([*args, "--allow-unsandboxed-code"]) == 0
