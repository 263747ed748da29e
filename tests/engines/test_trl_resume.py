"""``gbmpo train --resume DIR`` for ``--engine trl`` runs: a run killed (SIGKILL of its process
group) after a checkpoint continues with TRL's ``resume_from_checkpoint`` and gbmpo's state file,
and ends with the uninterrupted run's metrics.jsonl rows (each step once) and weights; what
completes a checkpoint, which checkpoint a resume uses, and what it refuses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("trl")

from gbmpo.cli import main  # noqa: E402
from gbmpo.engines.trl import args as trl_args
from gbmpo.engines.trl import checkpoints as trl_checkpoints  # noqa: E402
from gbmpo.io import CheckpointError  # noqa: E402
from gbmpo.lifecycle.logging import read_metrics, without_timing  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--engine", "trl", "--rollout.prompts_per_step", "2", "--num-generations", "4",
        "--max-new-tokens", "16", "--optim.mini_batch_size", "4", "--eval.limit", "4",
        "--eval.max_new_tokens", "16", "--eval-every", "2", "--time-budget", "null",
        "--run.progress", "false", "--run.checkpoint_every", "1", "--run.keep_checkpoints", "2",
        "--steps", "3"]  # fmt: skip
CLI = "import sys; from gbmpo.cli import main; sys.exit(main(sys.argv[1:]))"


def _rows(run: Path) -> list[dict]:
    # trl/step_time is TRL's wall-clock time of the step
    return [{k: v for k, v in without_timing(r).items() if k != "trl/step_time"}
            for r in read_metrics(run)]  # fmt: skip


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "model" / "model.safetensors"))


def test_killed_run_resumes_to_the_uninterrupted_result(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert main(["train", *TINY, "--output-dir", str(ref)]) == 0
    # the same run in a process group of its own, SIGKILLed once RL step 1's checkpoint is
    # complete (2 optimizer steps per RL step: checkpoint-2)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-c", CLI, "train", *TINY, "--output-dir", str(run)],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    done = run / "checkpoints" / "checkpoint-2" / trl_checkpoints.STATE_FILE
    deadline = time.monotonic() + 300
    while not done.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before the kill"
    assert not (run / "summary.json").exists()
    state = json.loads(done.read_text())
    assert state["rl_step"] == 1 and state["metrics_rows"] == 2  # rows of steps 0 and 1
    assert state["eval_before"] is not None and state["rl_seconds"] > 0

    assert main(["train", "--resume", str(run)]) == 0
    err = capsys.readouterr().err
    assert "resuming" in err and "checkpoint-" in err
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]  # each RL step once
    assert [r["step"] for r in rows] == [r["step"] for r in read_metrics(ref)]  # evals too
    assert _rows(run) == _rows(ref)  # losses, rewards, learning rates, evaluations
    a, b = _weights(ref), _weights(run)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["eval_before"] == json.loads((ref / "summary.json").read_text())["eval_before"]
    assert summary["wall_seconds"] > state["wall_seconds"]  # the first part's time counted
    # a finished run is not resumed
    assert main(["train", "--resume", str(run)]) == 2
    assert "the run already finished" in capsys.readouterr().err


def _fake_checkpoint(run: Path, step: int, *, complete: bool = True) -> Path:
    path = run / "checkpoints" / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x" * (10 + step))
    if complete:
        trl_checkpoints.complete_checkpoint(path, {"global_step": step}, keep=0)
    return path


def test_which_checkpoint_a_resume_uses(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert trl_checkpoints.latest_valid_checkpoint(run) is None
    two, four = _fake_checkpoint(run, 2), _fake_checkpoint(run, 4)
    six = _fake_checkpoint(run, 6, complete=False)  # killed while TRL wrote it
    assert [p for _, p in trl_checkpoints.checkpoints(run)] == [two, four]
    problem = trl_checkpoints.verify_checkpoint(six)
    assert problem and "missing" in problem
    assert trl_checkpoints.latest_valid_checkpoint(run) == four
    (four / "model.safetensors").write_bytes(b"x")  # damaged after it was completed
    assert "model.safetensors has 1 bytes" in str(trl_checkpoints.verify_checkpoint(four))
    assert trl_checkpoints.latest_valid_checkpoint(run) == two
    assert "checkpoint-4 is damaged" in capsys.readouterr().err
    # a resume removes what lies past its checkpoint (TRL writes those steps again)
    assert trl_checkpoints.prepare_resume(run) == two
    assert not four.exists() and not six.exists() and two.is_dir()
    (two / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no intact checkpoint.*checkpoint-2"):
        trl_checkpoints.latest_valid_checkpoint(run)


def test_completing_a_checkpoint_rotates_the_older_ones(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (2, 4):
        _fake_checkpoint(run, step)
    path = _fake_checkpoint(run, 6, complete=False)
    assert len(trl_checkpoints.checkpoints(run)) == 2  # nothing removed before 6 is complete
    trl_checkpoints.complete_checkpoint(path, {"global_step": 6}, keep=2)
    assert [n for n, _ in trl_checkpoints.checkpoints(run)] == [4, 6]


def test_worker_command_carries_the_resume_point(tmp_path: Path) -> None:
    from gbmpo.config import load_config

    cfg = load_config(None, [("engine", "trl"), ("run.num_processes", 2)])
    cmd = trl_args.launch_command(cfg, tmp_path, resume_from=tmp_path / "checkpoint-4",
                                resuming=True)  # fmt: skip
    assert cmd[-2:] == ["--resume-from", str(tmp_path / "checkpoint-4")]
    assert trl_args.launch_command(cfg, tmp_path, resuming=True)[-2:] == ["--resume-from", ""]
    assert "--resume-from" not in trl_args.launch_command(cfg, tmp_path)


def test_resume_dry_run_and_refused_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from gbmpo.config import dump_yaml, load_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_yaml(load_config(None, [("engine", "trl")])))
    four = _fake_checkpoint(run, 4)
    assert main(["train", "--resume", str(run), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.split("dry run OK: ", 1)[1]) == {"resume_from": str(four)}
    assert main(["train", "--resume", str(run), "--lr", "1"]) == 2
    assert "cannot change 'optim.lr' when resuming" in capsys.readouterr().err


def test_own_engine_resume_dry_run_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    small = [a for a in TINY if a not in ("--engine", "trl")]
    assert main(["train", *small, "--steps", "2", "--output-dir", str(run)]) == 0
    (run / "summary.json").unlink()  # as if killed after its last checkpoint
    before = sorted(str(p) for p in run.rglob("*"))
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out.split("dry run OK: ", 1)[1])
    assert plan["resume_from"].endswith("step-2")
    assert sorted(str(p) for p in run.rglob("*")) == before


def test_resume_continues_the_time_budget_and_drops_rows_past_the_checkpoint(
    tmp_path: Path,
) -> None:
    """Rows logged after the checkpoint go; RL seconds come back from gbmpo_state.json, so a
    budget they already use up stops the resumed run at the checkpoint, with its weights."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    assert main(["train", *TINY, "--run.keep_checkpoints", "3", "--output-dir", str(run)]) == 0
    (run / "summary.json").unlink()  # as if killed after RL step 3's row, keeping only step 1
    for n in (4, 6):
        shutil.rmtree(run / "checkpoints" / f"checkpoint-{n}", ignore_errors=True)
    one = run / "checkpoints" / "checkpoint-2"
    saved = json.loads((one / trl_checkpoints.STATE_FILE).read_text())
    weights = load_file(str(one / "model.safetensors"))
    budget = saved["rl_seconds"] / 2
    assert main(["train", "--resume", str(run), "--time-budget", str(budget)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "time_budget" and summary["steps"] == 1
    assert summary["rl_seconds"] == saved["rl_seconds"]
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 1]  # + the final evaluation
    final = _weights(run)
    assert all(bool((final[k] == weights[k]).all()) for k in final)
