"""Parity with TRL and verl (docs/results.md#parity): run the four parity tests, each writing the
largest loss and gradient differences it measured (tests/parity_record.py, ``$GBMPO_PARITY_JSON``),
and merge them, with the commands, versions and machine, into one result file:

    python scripts/collect_parity.py [--out docs/results/parity/results.json]

The TRL tests run in ``.venv``, the verl ones in ``.venv-verl``; a failing test stops the script
(its figures would be those of a broken comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "results" / "parity" / "results.json"
#: row -> (environment, library whose version is recorded, pytest arguments)
RUNS: dict[str, tuple[str, str, list[str]]] = {
    "trl_trainer": (".venv", "trl", ["tests/integrations/test_trl_parity.py"]),
    "verl_ppo_loss": (".venv-verl", "verl", ["tests_verl/test_parity.py", "-k", "equals"]),
    "trl_loss": (".venv", "trl", ["tests/objectives/test_trl_loss_parity.py"]),
    "verl_baselines": (".venv-verl", "verl", ["tests_verl/test_baseline_parity.py"]),
}


def _version(python: Path, library: str) -> str:
    code = f"import {library}, torch; print({library}.__version__, torch.__version__)"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    lib, torch = out.stdout.split()
    return f"{library} {lib}, torch {torch}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    result: dict[str, object] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, CPU only",
    }
    with tempfile.TemporaryDirectory() as tmp:
        for row, (venv, library, pytest_args) in RUNS.items():
            python = ROOT / venv / "bin" / "python"
            figures = Path(tmp) / f"{row}.json"
            argv = ["-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
            env = {**os.environ, "GBMPO_PARITY_JSON": str(figures), "OMP_NUM_THREADS": "1"}
            proc = subprocess.run([python, *argv], cwd=ROOT, env=env, capture_output=True,
                                  text=True)  # fmt: skip
            if proc.returncode != 0 or not figures.exists():
                sys.exit(f"{venv}: pytest {' '.join(pytest_args)} failed:\n{proc.stdout[-3000:]}")
            tests = json.loads(figures.read_text())
            result[row] = {"command": f"{venv}/bin/python " + " ".join(argv),
                           "versions": _version(python, library), "tests": tests}  # fmt: skip
            print(f"{row}: {len(tests)} tests recorded")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
