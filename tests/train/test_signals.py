"""SIGTERM (a scheduler's preemption notice) and SIGINT (Ctrl-C) on the own engine: the step
under way finishes, a checkpoint of it is written, status.json says why and at which step, one
line names the checkpoint and the resume command, the exit code is 143 / 130, and the resume
gives the uninterrupted run's metrics. A second signal stops at once. A resume without a
checkpoint exits 1 and changes nothing; no lock file outlives a run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gbmpo.cli import main
from gbmpo.io import LOCK_FILE, RunStopped
from gbmpo.lifecycle.logging import read_metrics, without_timing
from gbmpo.train import Trainer
from gbmpo.train.checkpoint import list_checkpoints

ROOT = Path(__file__).resolve().parents[2]
CLI = "import sys; from gbmpo.cli import main; sys.exit(main(sys.argv[1:]))"


def _args(model: Path, steps: int = 30) -> list[str]:
    return ["--model.path", str(model), "--rollout.prompts_per_step", "2", "--num-generations",
            "4", "--max-new-tokens", "8", "--eval.before", "true", "--eval.limit", "4",
            "--eval.max_new_tokens", "8", "--eval-every", "0", "--eval.after", "false",
            "--eval.drift", "false", "--time-budget", "null", "--run.progress", "false",
            "--optim.mini_batch_size", "null", "--optim.schedule", "cosine",
            "--steps", str(steps)]  # fmt: skip


def _config(model: Path, run: Path, steps: int, **extra: str):  # noqa: ANN202
    from gbmpo.cli.args import parse_overrides
    from gbmpo.config import load_config

    extra = {"eval.before": "false", "run.output_dir": str(run), **extra}
    return load_config(overrides=[*parse_overrides(_args(model, steps)), *extra.items()])


def _rows(run: Path) -> list[dict]:
    return [without_timing(r) for r in read_metrics(run)]


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(run.rglob("*"))}  # fmt: skip


def _signal_after_a_step(args: list[str], run: Path, sig: signal.Signals, *,
                         rows: int = 2) -> subprocess.CompletedProcess:  # fmt: skip
    """``gbmpo train ARGS --output-dir RUN`` in a subprocess, sent ``sig`` once ``rows`` rows
    (the evaluation before training and a step) are in metrics.jsonl."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-c", CLI, "train", *args, "--output-dir", str(run)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= rows:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize(("sig", "code", "state"), [(signal.SIGTERM, 143, "preempted"),
                                                     (signal.SIGINT, 130, "interrupted")])
def test_a_signal_checkpoints_the_step_and_the_resume_continues_identically(
    micro_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
    sig: signal.Signals, code: int, state: str,
) -> None:  # fmt: skip
    ref, run = tmp_path / "ref", tmp_path / "run"
    args = _args(micro_model_dir)
    proc = _signal_after_a_step(args, run, sig)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    status = json.loads((run / "status.json").read_text())
    step = status["step"]
    assert status["status"] == state and status["signal"] == sig.name and 1 <= step < 30
    checkpoint = run / "checkpoints" / f"step-{step}"
    assert status["checkpoint"] == str(checkpoint) and checkpoint.is_dir()
    assert lines[0] == (f"gbmpo train: stopped ({state}, {sig.name}) after step {step}; "
                        f"checkpoint {checkpoint}; resume with: gbmpo train --resume {run}")
    assert [r["step"] for r in read_metrics(run)] == list(range(step + 1))  # eval row + steps
    assert not (run / LOCK_FILE).exists() and not (run / "summary.json").exists()

    assert main(["train", "--resume", str(run)]) == 0
    assert f"resuming {str(run)!r} from step-{step} (step {step} of 30)" in capsys.readouterr().err
    assert main(["train", *args, "--output-dir", str(ref)]) == 0
    assert _rows(run) == _rows(ref)
    assert json.loads((run / "status.json").read_text())["status"] == "finished"
    assert not (run / LOCK_FILE).exists() and not (ref / LOCK_FILE).exists()


def test_a_second_signal_stops_at_once_keeping_the_last_checkpoint(
    micro_model_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cfg = _config(micro_model_dir, run, 30, **{"run.checkpoint_every": "2"})
    calls = []

    def reward(prompts: list, completions: list, **kw: object) -> list[float]:
        calls.append(1)
        if len(calls) == 3:  # during step 3: the first signal, and a second one 1.2 s later
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Timer(1.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
            time.sleep(5)  # the second signal interrupts this step
        return [float(len(c) % 3) / 2 for c in completions]

    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunStopped) as info:
        Trainer(cfg, reward_fn=reward).train()
    assert signal.getsignal(signal.SIGTERM) is previous  # the handlers before are back
    err = info.value
    assert err.now and err.exit_code == 143 and err.step == 2
    assert err.checkpoint == str(run / "checkpoints" / "step-2")  # the periodic one
    assert str(err).startswith("stopped (preempted, SIGTERM) at once on a second signal")
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "preempted" and status["stopped"] == "at once"
    assert status["step"] == 2 and status["checkpoint"] == err.checkpoint
    assert [s for s, _ in list_checkpoints(run)] == [2]
    assert not (run / LOCK_FILE).exists()


def test_resume_without_a_checkpoint_exits_1_and_changes_nothing(
    micro_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    args = _args(micro_model_dir, steps=2)
    assert main(["train", *args, "--run.checkpoint_every", "0", "--output-dir", str(run)]) == 0
    # what a run killed before its first checkpoint leaves: config, status, some rows
    for name in ("summary.json",):
        (run / name).unlink()
    import shutil

    shutil.rmtree(run / "model")
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    (run / LOCK_FILE).write_text("1\n")  # a kill -9 leaves the lock file
    capsys.readouterr()
    before = _snapshot(run)
    assert main(["train", "--resume", str(run)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gbmpo train: error: cannot resume {str(run)!r}: it has no checkpoint (it "
                   "stopped before its first); start it over in the same directory with "
                   f"`gbmpo train --resume {run} --restart`"]  # fmt: skip
    assert _snapshot(run) == before
    # --restart starts over in place: the earlier rows are replaced, the run finishes
    rows = _rows(run)
    assert main(["train", "--resume", str(run), "--restart"]) == 0
    assert "restarting" in capsys.readouterr().err
    assert _rows(run) == rows and not (run / LOCK_FILE).exists()
    assert main(["train", *args, "--restart"]) == 2  # only with --resume


def test_no_lock_file_after_a_failed_run(micro_model_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = _config(micro_model_dir, run, 2)

    def broken(prompts: list, completions: list, **kw: object) -> list[float]:
        raise RuntimeError("reward service down")

    with pytest.raises(Exception, match="reward"):
        Trainer(cfg, reward_fn=broken).train()
    assert json.loads((run / "status.json").read_text())["status"] == "failed"
    assert not (run / LOCK_FILE).exists()
