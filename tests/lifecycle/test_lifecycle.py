""":class:`gbmpo.lifecycle.RunLifecycle` on its own: the lock, the empty / finished checks,
``status.json`` with the same keys in every state, a stop after a step and at once (completed
from the hooks), an exception while running, and what is left alone."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from gbmpo.config import ConfigError
from gbmpo.io import LOCK_FILE, RunDirInUseError, RunStopped
from gbmpo.lifecycle import (
    STATUS_FILE,
    STATUS_KEYS,
    SUMMARY_FILE,
    RunLifecycle,
    read_status,
    write_status,
)


def _status(run: Path) -> dict:
    return json.loads((run / STATUS_FILE).read_text())


def test_the_lock_is_held_for_the_whole_run_and_removed_after(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with RunLifecycle(run, "trl"):
        assert (run / LOCK_FILE).read_text().strip() == str(os.getpid())
        with pytest.raises(RunDirInUseError, match=r"in use by another gbmpo process \(pid \d+\)"):
            RunLifecycle(run, "gbmpo").__enter__()
        with pytest.raises(RunDirInUseError):  # a resume too
            RunLifecycle(run, "trl", resuming=True).__enter__()
    assert not (run / LOCK_FILE).exists()
    with RunLifecycle(run, "trl"):  # free again
        pass


def test_a_fresh_run_needs_an_empty_directory_and_a_resume_an_unfinished_run(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("x: 1\n")
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        RunLifecycle(run, "verl").__enter__()
    assert not (run / LOCK_FILE).exists()  # refused: the lock released
    with RunLifecycle(run, "verl", resuming=True):
        pass
    (run / SUMMARY_FILE).write_text("{}")
    with pytest.raises(ConfigError, match="already finished"):
        RunLifecycle(run, "verl", resuming=True).__enter__()
    assert not (run / LOCK_FILE).exists()


def test_every_state_has_the_same_keys(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-2"
    with RunLifecycle(run, "gbmpo") as life:
        life.running(0, resumed_from=None)
        assert tuple(_status(run)) == STATUS_KEYS
        assert _status(run)["status"] == "running" and _status(run)["engine"] == "gbmpo"
        life.running(2)
        assert _status(run)["step"] == 2
        life.finished({"steps": 3, "status": "finished"})
    status = _status(run)
    assert tuple(status) == STATUS_KEYS and status["status"] == "finished" and status["step"] == 3
    assert json.loads((run / SUMMARY_FILE).read_text())["steps"] == 3

    stopped = tmp_path / "stopped"
    with pytest.raises(RunStopped) as info, RunLifecycle(stopped, "trl") as life:
        life.running(4, resumed_from=ckpt)
        raise life.stopped("SIGTERM", 5, ckpt)
    status = _status(stopped)
    assert tuple(status) == STATUS_KEYS
    assert (status["status"], status["step"], status["signal"], status["stopped"]) == (
        "preempted", 5, "SIGTERM", "after step")  # fmt: skip
    assert status["checkpoint"] == str(ckpt) and status["resumed_from"] == str(ckpt)
    assert status["resume"] == f"gbmpo train --resume {stopped}" and status["error"] is None
    assert info.value.exit_code == 143 and str(ckpt) in str(info.value)


@pytest.mark.parametrize(("err", "state"), [(RuntimeError("boom"), "failed"),
                                            (KeyboardInterrupt(), "interrupted")])  # fmt: skip
def test_an_exception_while_running_is_recorded(tmp_path: Path, err: BaseException,
                                                state: str) -> None:  # fmt: skip
    run = tmp_path / "run"
    with pytest.raises(type(err)), RunLifecycle(run, "verl") as life:
        life.running(7)
        raise err
    status = _status(run)
    assert tuple(status) == STATUS_KEYS and status["status"] == state and status["step"] == 7
    assert status["error"] == f"{type(err).__name__}: {err}" and status["signal"] is None
    assert not (run / LOCK_FILE).exists()


def test_what_is_left_alone(tmp_path: Path) -> None:
    # an exception before the run said running: no status at all
    run = tmp_path / "run"
    with pytest.raises(RuntimeError), RunLifecycle(run, "gbmpo"):
        raise RuntimeError("bad model")
    assert read_status(run) is None and not (run / LOCK_FILE).exists()
    # a resume that fails before it runs: the status a killed part left stays as it was
    killed = tmp_path / "killed"
    killed.mkdir()
    left = write_status(killed, "running", 5, engine="gbmpo")
    with pytest.raises(RuntimeError), RunLifecycle(killed, "gbmpo", resuming=True):
        raise RuntimeError("no checkpoint")
    assert _status(killed) == left
    # a stop another process recorded (a worker): kept as it is
    worker = tmp_path / "worker"
    with pytest.raises(RunStopped), RunLifecycle(worker, "trl") as life:
        write_status(worker, "interrupted", 3, engine="trl", signal="SIGINT",
                     stopped="after step", checkpoint="c", resume="r")  # fmt: skip
        raise RunStopped("SIGINT", step=3, checkpoint="c", run_dir=worker)
    assert _status(worker)["resume"] == "r"
    # not the main process: nothing written
    other = tmp_path / "other"
    with pytest.raises(RuntimeError), RunLifecycle(other, "trl", main=False) as life:
        life.running(1)
        raise RuntimeError("x")
    assert read_status(other) is None


def test_a_second_signal_is_completed_from_the_hooks(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-3"
    life = RunLifecycle(run, "gbmpo", signals=True, step=lambda: 4, checkpoint=lambda: ckpt)
    with pytest.raises(RunStopped) as info, life:
        life.running(4)
        assert life.stop is not None
        os.kill(os.getpid(), signal.SIGINT)  # the first: recorded, the run goes on
        assert life.stop.poll() == "SIGINT"
        raise RunStopped("SIGINT", now=True)  # what StopSignals raises on a second one
    assert info.value.run_dir == str(run) and info.value.step == 4
    assert info.value.checkpoint == str(ckpt) and info.value.exit_code == 130
    status = _status(run)
    assert (status["status"], status["stopped"], status["checkpoint"]) == (
        "interrupted", "at once", str(ckpt))  # fmt: skip
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_write_status_refuses_what_is_not_in_the_schema(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not one of"):
        write_status(tmp_path, "done", 1, engine="gbmpo")
    with pytest.raises(ValueError, match="no key 'extra'"):
        write_status(tmp_path, "running", 1, engine="gbmpo", extra=1)
    assert read_status(tmp_path) is None
