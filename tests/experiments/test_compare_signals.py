"""SIGTERM to ``gbmpo compare`` (a scheduler's notice, sent to the command's own process only):
the run in flight saves a checkpoint after its step, no further run starts, one line says so,
the exit code is 143, no report is written; the same command then goes on (the stopped run is
resumed) and finishes. On the process pool: the worker gets the signal passed on, and the
runs queued behind the one in flight never start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = "import sys; from gbmpo.cli import main; sys.exit(main(sys.argv[1:]))"

pytestmark = pytest.mark.slow


def _argv(model: Path, out: Path, backend: list[str]) -> list[str]:
    return ["compare", "--regularizers", "kl_k3,none", "--seeds", "0",
            "--output-dir", str(out), *backend,
            "--model.path", str(model), "--steps", "6", "--time-budget", "null",
            "--rollout.prompts_per_step", "2", "--num-generations", "2",
            "--optim.mini_batch_size", "null", "--max-new-tokens", "8", "--eval.limit", "2",
            "--eval.max_new_tokens", "4", "--eval-every", "0", "--eval.before", "false",
            "--eval.drift", "false"]  # fmt: skip


def _run(argv: list[str], *, signal_when: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-c", CLI, *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    if signal_when is not None:  # SIGTERM once the first run has logged a step
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if signal_when.is_file() and signal_when.read_text().strip():
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the grid ended before the signal"
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_sigterm_stops_the_grid_and_the_same_command_goes_on(micro_model_dir: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "grid"
    runs = out / "runs" / "arithmetic"
    argv = _argv(micro_model_dir, out, ["--backend", "local", "--workers", "1"])
    stopped = _run(argv, signal_when=runs / "kl_k3" / "seed0" / "metrics.jsonl")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("gbmpo compare: stopped (preempted, SIGTERM): 0 of 2 runs finished")
    assert "run the same gbmpo compare command to go on" in last
    status = json.loads((runs / "kl_k3" / "seed0" / "status.json").read_text())
    assert status["status"] == "preempted" and status["signal"] == "SIGTERM"
    assert not (runs / "none").exists()  # queued behind the first: never started
    assert not (out / "report.md").exists() and not (out / "results.json").exists()

    again = _run(argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "2 runs: 0 finished (reused), 1 to resume, 1 to train" in again.stdout
    assert (out / "report.md").is_file()
    for label in ("kl_k3", "none"):
        summary = json.loads((runs / label / "seed0" / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["steps"] == 6
