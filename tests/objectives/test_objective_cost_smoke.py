"""benchmarks/objective_cost.py runs (tiny shape, a few pairs, before = HEAD's objectives loaded
from git) and writes its result file; the figures themselves are in benchmarks/RESULTS.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_objective_cost_runs_on_a_toy_shape(tmp_path: Path) -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (--before loads a revision's objectives from git)")
    out = tmp_path / "cost.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "objective_cost.py"), "--shape", "4,32",
         "--reps", "1", "--surrogates", "clip,cispo,dc:dppo_kl", "--regularizers", "none,kl_k3",
         "--before", "HEAD", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6
    for row in rows:
        assert row["after"]["ratio_cpu"] > 0
        # HEAD has clip; the baselines added with this benchmark may be newer than HEAD
        if row["surrogate"] == "clip":
            assert row["before"]["ratio_cpu"] > 0
    assert "clip" in proc.stdout and "ratios:" in proc.stdout


def test_objective_cost_tabulated_mirror_cases(tmp_path: Path) -> None:
    """The explicit tabulated neural-mirror cases run and are reported (no 'before' for them)."""
    out = tmp_path / "cost.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "objective_cost.py"), "--shape", "4,32",
         "--reps", "1", "--surrogates", "clip,dc:neural_mirror_table",
         "--regularizers", "none,neural_mirror_table", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["surrogate"], r["regularizer"]) for r in rows] == [
        ("clip", "none"), ("clip", "neural_mirror_table"),
        ("dc:neural_mirror_table", "none"), ("dc:neural_mirror_table", "neural_mirror_table"),
    ]  # fmt: skip
    assert all(r["after"]["ratio_cpu"] > 0 for r in rows)
