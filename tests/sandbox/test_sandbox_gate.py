"""Tasks own the sandbox gate: ``Task.prepare_reward`` starts the sandbox for a task whose reward
runs model-written code (and fails closed where an isolation layer is missing), and does nothing
for other tasks, so a trainer or evaluator calls it without looking at the task's kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gbmpo.sandbox.client as client
from gbmpo.sandbox import ALLOW_ENV, SandboxUnavailableError, SandboxWarning
from gbmpo.tasks import get_task


@pytest.fixture
def no_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as one without bubblewrap (no default sandbox yet, no opt-in)."""
    real_which = client.shutil.which
    monkeypatch.setattr(client.shutil, "which",
                        lambda name, *a, **k: None if name == "bwrap" else real_which(name))
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.delenv("GBMPO_SANDBOX_STRICT", raising=False)
    monkeypatch.setattr(client, "_default", None)


def test_math_task_needs_no_sandbox(no_bwrap: None) -> None:
    task = get_task("arithmetic")
    assert not task.requires_sandbox
    task.prepare_reward()
    assert client._default is None  # nothing was started


def test_code_task_refuses_without_isolation_unless_allowed(
    no_bwrap: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "code.jsonl"
    data.write_text(json.dumps({"q": "Write f.", "tests": ["assert f() == 1"]}) + "\n")
    task = get_task("jsonl", path=str(data), prompt_column="q", answer_column=None,
                    reward="code", test_path=str(data), template="base")
    assert task.requires_sandbox
    with pytest.raises(SandboxUnavailableError, match="bubblewrap"):
        task.prepare_reward()
    monkeypatch.setenv(ALLOW_ENV, "0")  # restored after the test (the opt-in exports it)
    with pytest.warns(SandboxWarning, match="bubblewrap"):
        task.prepare_reward(allow_unsandboxed_code=True)
    assert "bubblewrap" in client.get_default_sandbox().missing
