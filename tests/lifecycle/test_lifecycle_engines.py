"""Every engine's runner goes through :class:`gbmpo.lifecycle.RunLifecycle`: a finished run and a
failed run leave ``status.json`` with the same keys (:data:`gbmpo.lifecycle.STATUS_KEYS`) and the
same meanings on the own engine (end to end on the micro model), TRL (end to end, one process)
and verl (its runner with a stand-in for ``verl.trainer.main_ppo``: a finished, a failed and a
signalled launch); a fresh TRL run holds the lock (a second run on its directory is refused with
one line, exit 2) and a fresh verl run too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gbmpo.cli.args import parse_overrides
from gbmpo.config import load_config
from gbmpo.io import LOCK_FILE, RunStopped
from gbmpo.lifecycle import STATUS_FILE, STATUS_KEYS

ROOT = Path(__file__).resolve().parents[2]
CLI = "import sys; from gbmpo.cli import main; sys.exit(main(sys.argv[1:]))"
SMALL = ["--rollout.prompts_per_step", "2", "--num-generations", "4", "--max-new-tokens", "8",
         "--optim.mini_batch_size", "4", "--eval.before", "false", "--eval.after", "false",
         "--eval.drift", "false", "--eval-every", "0", "--time-budget", "null",
         "--run.progress", "false", "--run.checkpoint_every", "0", "--steps", "1"]  # fmt: skip


def _status(run: Path) -> dict[str, Any]:
    status = json.loads((run / STATUS_FILE).read_text())
    assert tuple(status) == STATUS_KEYS, status  # every engine, every state: the same keys
    assert not (run / LOCK_FILE).exists()
    return status


def _finished(status: dict[str, Any], engine: str, steps: int) -> None:
    assert (status["status"], status["engine"], status["step"]) == ("finished", engine, steps)
    assert [status[k] for k in STATUS_KEYS[4:]] == [None] * len(STATUS_KEYS[4:])


def _failed(status: dict[str, Any], engine: str, error: str) -> None:
    assert (status["status"], status["engine"]) == ("failed", engine)
    assert status["error"].startswith(error), status["error"]
    assert status["signal"] is None and status["stopped"] is None


def _cfg(model: Path, run: Path, *settings: tuple[str, Any]) -> Any:
    return load_config(overrides=[*parse_overrides(["--model.path", str(model), *SMALL]),
                                  ("run.output_dir", str(run)), *settings])  # fmt: skip


# ------------------------------------------------------------------------------ own engine


def test_own_engine(micro_model_dir: Path, tmp_path: Path) -> None:
    from gbmpo.train import Trainer

    done = tmp_path / "done"
    Trainer(_cfg(micro_model_dir, done)).train()
    _finished(_status(done), "gbmpo", 1)

    def broken(prompts: list, completions: list, **kw: object) -> list[float]:
        raise RuntimeError("reward service down")

    failed = tmp_path / "failed"
    with pytest.raises(Exception, match="reward"):
        Trainer(_cfg(micro_model_dir, failed), reward_fn=broken).train()
    _failed(_status(failed), "gbmpo", "RewardError")


# ------------------------------------------------------------------------------ TRL


def test_trl(micro_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("trl")
    from gbmpo.engines.trl import runner as trl_runner

    done = tmp_path / "done"
    trl_runner.run(_cfg(micro_model_dir, done, ("engine", "trl")))
    _finished(_status(done), "trl", 1)

    real = trl_runner.engine_trainer_class()

    class Failing(real):  # type: ignore[misc, valid-type]
        def train(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(trl_runner, "engine_trainer_class", lambda: Failing)
    failed = tmp_path / "failed"
    with pytest.raises(RuntimeError, match="illegal memory"):
        trl_runner.run(_cfg(micro_model_dir, failed, ("engine", "trl")))
    _failed(_status(failed), "trl", "RuntimeError: CUDA error")


def test_a_fresh_trl_run_holds_the_lock(micro_model_dir: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """While a fresh TRL run trains, ``gbmpo train --engine trl`` on its directory exits 2 with
    one line naming the owner's pid; the lock file goes when the run ends."""
    pytest.importorskip("trl")
    from gbmpo.engines.trl import runner as trl_runner

    run = tmp_path / "run"
    seen: dict[str, Any] = {}

    def training(cfg: Any, run_dir: Path, life: Any, **kw: Any) -> dict[str, Any]:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false"}
        second = subprocess.run(
            [sys.executable, "-c", CLI, "train", "--engine", "trl", "--output-dir", str(run_dir),
             "--model.path", str(micro_model_dir), *SMALL],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        seen["code"], seen["err"] = second.returncode, second.stderr
        seen["lock"] = (run_dir / LOCK_FILE).read_text().strip()
        return {}

    monkeypatch.setattr(trl_runner, "_train_in_process", training)
    trl_runner.run(_cfg(micro_model_dir, run, ("engine", "trl")))
    errors = [line for line in seen["err"].splitlines() if "error" in line]
    assert seen["code"] == 2, seen["err"]
    assert errors == [f"gbmpo train: error: run directory {str(run)!r} is in use by another "
                      f"gbmpo process (pid {os.getpid()}); wait for it to finish or choose "
                      "another output directory"], seen["err"]  # fmt: skip
    assert seen["lock"] == str(os.getpid()) and not (run / LOCK_FILE).exists()


# ------------------------------------------------------------------------------ verl


def _fake_main_ppo(tmp_path: Path, body: str) -> str:
    """A stand-in for verl's interpreter: ``python -m verl.trainer.main_ppo ...`` runs
    ``body`` (shell) instead."""
    script = tmp_path / "fake-python"
    script.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    script.chmod(0o755)
    return str(script)


def _verl_run(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch, body: str,
              name: str) -> Path:  # fmt: skip
    from gbmpo.config.support import VERL_REQUIRED
    from gbmpo.engines.verl import runner as verl_runner

    (tmp_path / name).mkdir()
    python = _fake_main_ppo(tmp_path / name, body)
    monkeypatch.setattr(verl_runner, "_gpu_python", lambda cfg: python)
    monkeypatch.setattr(verl_runner, "summarize_run", lambda cfg, run_dir, **kw: {
        "status": "finished", "engine": "verl", "steps": 2, "run_dir": str(run_dir)})  # fmt: skip
    run = tmp_path / name / "run"
    # no drift: the fake verl saves no checkpoint to merge
    cfg = _cfg(model, run, ("engine", "verl"), ("model.device", "cpu"), ("eval.max_new_tokens", 8),
               ("task.params", {"num_train": 64, "num_test": 8}), ("eval.drift", False),
               *VERL_REQUIRED.items())  # fmt: skip
    verl_runner.run(cfg)
    return run


def test_verl(micro_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    done = _verl_run(tmp_path, micro_model_dir, monkeypatch, name="done", body="""
        # verl's lock is gbmpo's: the launching process holds it while verl runs
        test -f "$(dirname "$VERL_FILE_LOGGER_PATH")/.gbmpo.lock" || exit 9
        exit 0
        """)  # fmt: skip
    _finished(_status(done), "verl", 2)
    assert json.loads((done / "summary.json").read_text())["steps"] == 2

    with pytest.raises(RuntimeError, match=r"main_ppo failed \(exit 3\)"):
        _verl_run(tmp_path, micro_model_dir, monkeypatch, name="failed", body="exit 3\n")
    _failed(_status(tmp_path / "failed" / "run"), "verl",
            "RuntimeError: verl.trainer.main_ppo failed (exit 3)")  # fmt: skip

    # SIGTERM reaches gbmpo train while verl runs (here: verl's stand-in sends it): passed on
    # to verl, which ends; the run stops at once with verl's newest checkpoint (none yet)
    with pytest.raises(RunStopped) as info:
        _verl_run(tmp_path, micro_model_dir, monkeypatch, name="stopped",
                  body='kill -TERM "$PPID"\nsleep 60\nexit 0\n')  # fmt: skip
    status = _status(tmp_path / "stopped" / "run")
    assert (status["status"], status["engine"], status["signal"], status["stopped"]) == (
        "preempted", "verl", "SIGTERM", "at once")  # fmt: skip
    assert status["checkpoint"] is None and status["error"] is None
    assert info.value.exit_code == 143 and "verl writes no checkpoint" in str(info.value)


def test_no_runner_writes_the_lifecycle_files_itself() -> None:
    """The lock, the signal handlers, ``status.json`` and ``summary.json`` are taken and written
    only in :mod:`gbmpo.lifecycle.core`: no engine's runner nor the own trainer does it."""
    import re

    own = re.compile(r"write_status\(|RunLock\(|StopSignals\(|write_json_atomic\([^)]*SUMMARY")
    src = ROOT / "src" / "gbmpo"
    found = [f"{path.relative_to(src)}:{n}" for folder in ("engines", "train")
             for path in sorted((src / folder).glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if own.search(line)]
    assert not found, found
    assert own.search((src / "lifecycle" / "core.py").read_text())  # the pattern finds them
