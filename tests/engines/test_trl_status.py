"""A TRL run that ends on an exception says so in ``status.json`` (``failed`` with the error,
``interrupted`` for a Ctrl-C), as the own engine's does; a stop on a signal keeps the status it
wrote, and a run that never said ``running`` gets no status file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gbmpo.engines.trl import runner as trl_runner
from gbmpo.io import RunStopped
from gbmpo.lifecycle import STATUS_FILE, STATUS_KEYS, write_status


def _fails_with(err: BaseException, *, started: bool = True):  # noqa: ANN202
    def train(cfg, run_dir, life, *, resume_from, resuming):  # noqa: ANN001, ANN202
        if started:
            write_status(run_dir, "running", 3, engine="trl")
        raise err

    return train


@pytest.mark.parametrize(("err", "state"), [(RuntimeError("boom"), "failed"),
                                            (KeyboardInterrupt(), "interrupted")])
def test_an_exception_leaves_its_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        err: BaseException, state: str) -> None:
    monkeypatch.setattr(trl_runner, "_train_in_process", _fails_with(err))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(type(err)):
        trl_runner.train_in_process(None, tmp_path)
    status = json.loads((tmp_path / STATUS_FILE).read_text())
    assert status["status"] == state and status["step"] == 3 and status["engine"] == "trl"
    assert status["error"] == f"{type(err).__name__}: {err}"
    assert tuple(status) == STATUS_KEYS and status["signal"] is None


def test_a_signal_stop_and_a_run_not_started_are_left_alone(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:  # fmt: skip
    def stopped(cfg, run_dir, life, *, resume_from, resuming):  # noqa: ANN001, ANN202
        raise life.stopped("SIGTERM", 2, None)

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(trl_runner, "_train_in_process", stopped)
    with pytest.raises(RunStopped):
        trl_runner.train_in_process(None, tmp_path)
    status = json.loads((tmp_path / STATUS_FILE).read_text())
    assert status["status"] == "preempted" and status["signal"] == "SIGTERM"
    assert status["stopped"] == "after step" and status["error"] is None

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    monkeypatch.setattr(trl_runner, "_train_in_process",
                        _fails_with(RuntimeError("bad model"), started=False))  # fmt: skip
    with pytest.raises(RuntimeError):
        trl_runner.train_in_process(None, fresh)
    assert not (fresh / STATUS_FILE).exists()


def test_only_the_main_process_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trl_runner, "_train_in_process", _fails_with(RuntimeError("boom")))
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError):
        trl_runner.train_in_process(None, tmp_path)
    assert json.loads((tmp_path / STATUS_FILE).read_text())["status"] == "running"
