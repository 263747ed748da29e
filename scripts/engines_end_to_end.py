"""The engines end to end (docs/results.md#engines): two steps of ``gbmpo train --engine trl`` on
one and on two processes (accelerate, gloo), and the first TRL update on a fixed batch on one
against two processes (tests/engines/test_trl_engine.py, which writes its figures to
``$GBMPO_RESULT_JSON``); the commands, the machine, its load and the measured values go to one
result file:

    python scripts/engines_end_to_end.py [--out docs/results/engines-e2e/results.json]

Seconds are the whole command's wall time; accuracies are read from each run's summary.json (the
run directories, in a temporary folder, are not kept). Run it on an otherwise quiet machine: the
load average before and after each command is recorded next to its time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "results" / "engines-e2e" / "results.json"
TRAIN = ["gbmpo", "train", "--engine", "trl", "--steps", "2", "--time-budget", "null",
         "--eval.limit", "20"]  # fmt: skip
RUNS = {"trl_1_process": TRAIN, "trl_2_processes": [*TRAIN[:4], "--num-processes", "2",
                                                       *TRAIN[4:]]}  # fmt: skip
TEST = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "tests/engines/test_trl_engine.py::"
        "test_first_update_on_a_fixed_batch_is_the_same_on_two_processes"]  # fmt: skip


def _timed(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run ``argv`` (its first word from this interpreter's environment) from the repository
    root; its wall seconds and the 1-minute load average before and after. Exits on failure."""
    exe = Path(sys.executable)
    first = str(exe) if argv[0] == "python" else str(exe.with_name(argv[0]))
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run([first, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{shlex.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"command": shlex.join(argv), "seconds": round(seconds, 2),
            "load_1min_before": load_before, "load_1min_after": os.getloadavg()[0]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, CPU only",
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in RUNS.items():
            run_dir = Path(tmp) / name
            row = _timed([*argv, "--output-dir", str(run_dir)], env)
            row["command"] = row["command"].replace(str(run_dir), "DIR")
            summary = json.loads((run_dir / "summary.json").read_text())
            row.update(steps=summary["steps"], eval_n=summary["eval_after"]["n"],
                       before=summary["eval_before"]["accuracy"],
                       after=summary["eval_after"]["accuracy"])  # fmt: skip
            result[name] = row
        figures = Path(tmp) / "fixed_batch.json"
        row = _timed(TEST, {**env, "GBMPO_RESULT_JSON": str(figures)})
        row["per_aggregation"] = json.loads(figures.read_text())
        result["fixed_batch_1_vs_2_processes"] = row
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
