"""SIGTERM / SIGINT on ``--engine trl`` (one process, and two through ``accelerate launch``):
the RL step under way finishes, TRL saves a checkpoint of it (completed by gbmpo), status.json
says ``preempted`` / ``interrupted`` with the step, one line names the checkpoint and the resume
command, the exit code is 143 / 130, and ``gbmpo train --resume`` ends with the uninterrupted
run's rows and weights. A resume without a checkpoint exits 1 and changes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("trl")

from gbmpo.cli import main  # noqa: E402
from gbmpo.io import LOCK_FILE  # noqa: E402
from gbmpo.lifecycle.logging import read_metrics, without_timing  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--engine", "trl", "--rollout.prompts_per_step", "2", "--num-generations", "4",
        "--max-new-tokens", "16", "--optim.mini_batch_size", "4", "--eval.limit", "4",
        "--eval.max_new_tokens", "16", "--eval-every", "0", "--eval.drift", "false",
        "--time-budget", "null", "--run.progress", "false", "--steps", "4"]  # fmt: skip
CLI = "import sys; from gbmpo.cli import main; sys.exit(main(sys.argv[1:]))"


def _rows(run: Path) -> list[dict]:
    return [{k: v for k, v in without_timing(r).items() if k != "trl/step_time"}
            for r in read_metrics(run)]  # fmt: skip


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (one process)."""
    ref = tmp_path_factory.mktemp("trl-signals") / "ref"
    assert main(["train", *TINY, "--output-dir", str(ref)]) == 0
    return ref


def _signal_after_a_step(args: list[str], run: Path, sig: signal.Signals) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-c", CLI, "train", *args, "--output-dir", str(run)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:  # the evaluation row + step 1
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=600)
    return proc.returncode, err


def _check_stopped(run: Path, code: int, err: str, sig: signal.Signals, expected: int) -> int:
    state = {signal.SIGTERM: "preempted", signal.SIGINT: "interrupted"}[sig]
    assert code == expected, err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("note: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    status = json.loads((run / "status.json").read_text())
    step = status["step"]
    assert status["status"] == state and status["signal"] == sig.name and 1 <= step < 4
    checkpoint = run / "checkpoints" / f"checkpoint-{2 * step}"  # 2 optimizer steps per RL step
    assert status["checkpoint"] == str(checkpoint)
    assert (checkpoint / "gbmpo_state.json").is_file()
    assert lines[0] == (f"gbmpo train: stopped ({state}, {sig.name}) after step {step}; "
                        f"checkpoint {checkpoint}; resume with: gbmpo train --resume {run}")
    assert not (run / "summary.json").exists() and not (run / LOCK_FILE).exists()
    assert not (run / ".gbmpo.stop").exists()
    return int(step)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_one_process_stops_with_a_checkpoint_and_resumes_identically(
    reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture, sig: signal.Signals, code: int
) -> None:
    run = tmp_path / "run"
    rc, err = _signal_after_a_step(TINY, run, sig)
    step = _check_stopped(run, rc, err, sig, code)
    assert [r["step"] for r in read_metrics(run)] == list(range(step + 1))
    assert main(["train", "--resume", str(run)]) == 0
    assert f"from checkpoint-{2 * step}" in capsys.readouterr().err
    assert _rows(run) == _rows(reference)
    a, b = _weights(reference), _weights(run)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    assert json.loads((run / "status.json").read_text())["status"] == "finished"
    assert not (run / LOCK_FILE).exists()


def test_two_processes_stop_together_and_resume(tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    """Two processes (gloo on CPU): SIGTERM to ``gbmpo train`` reaches the workers through the
    stop file; both stop after the same RL step; the resume (also on two processes) finishes
    with each step once, and ends as a 2-process run does: the summary line, ``summary.json``
    with both processes, the saved model (the one 2-process training launch of the suite's TRL
    tests: test_trl_engine.py relies on it)."""
    run = tmp_path / "run"
    args = [*TINY, "--run.num_processes", "2"]
    rc, err = _signal_after_a_step(args, run, signal.SIGTERM)
    step = _check_stopped(run, rc, err, signal.SIGTERM, 143)
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4] and step < 4
    assert "finished 4 steps (trl)" in capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["trl/world_size"] == 2
    assert (run / "model" / "config.json").is_file()


def test_resume_without_a_checkpoint_exits_1_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from gbmpo.cli.args import parse_overrides
    from gbmpo.config import dump_yaml, load_config

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(overrides=parse_overrides(TINY))
    cfg.run.output_dir = str(run)
    (run / "config.yaml").write_text(dump_yaml(cfg))
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.25}\n')
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    assert main(["train", "--resume", str(run)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no checkpoint" in err[0] and "--restart" in err[0]
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
