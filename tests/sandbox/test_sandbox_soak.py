"""Short profile of ``benchmarks/sandbox_soak.py``: 300 programs of the seeded hostile mix through
one sandbox client, sampled every 100, stay within the flatness bounds, give the verdicts their
kinds must give and the same verdicts in a fresh client; and the same check flags a client that
leaks a descriptor, a child process or memory (so the bounds can fail)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gbmpo.sandbox import Sandbox, SandboxError, SandboxUnavailableError

ROOT = Path(__file__).resolve().parents[2]


def _soak_module() -> Any:
    spec = importlib.util.spec_from_file_location("sandbox_soak",
                                                  ROOT / "benchmarks" / "sandbox_soak.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sandbox_soak"] = mod
    spec.loader.exec_module(mod)
    return mod


soak = _soak_module()

#: The short profile fits 3 points during the warm-up of the strict-compare cache (one entry per
#: distinct test, bounded at 4,096): RSS gets twice the long run's bound. Counts keep theirs.
SHORT_BOUNDS = {**soak.BOUNDS, "rss_mb": 2.0}


def _sandbox(**kw: Any) -> Sandbox:
    try:
        return Sandbox(workers=2, strict=True, **kw)
    except SandboxUnavailableError as exc:
        pytest.skip(f"full sandbox unavailable here: {exc}")
    except SandboxError as exc:
        pytest.skip(f"sandbox cannot start here: {exc}")


class LeakySandbox(Sandbox):
    """A client that leaks what the soak must notice: one descriptor per 10 executions, one
    child process per 100, 16 KiB per execution."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.calls = 0
        self.fds: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.heap: list[bytes] = []

    def run(self, *args: Any, **kw: Any) -> Any:
        self.calls += 1
        if self.calls % 10 == 0:
            self.fds.append(os.open(os.devnull, os.O_RDONLY))
        if self.calls % 100 == 0:
            self.procs.append(subprocess.Popen(["sleep", "60"]))
        self.heap.append(os.urandom(16 << 10))
        return super().run(*args, **kw)

    def close(self) -> None:
        super().close()
        for fd in getattr(self, "fds", []):
            os.close(fd)
        for p in getattr(self, "procs", []):
            p.kill()
            p.wait()
        self.fds, self.procs = [], []


def _in_fresh_python(call: str) -> dict[str, Any]:
    """``call`` (an expression on this module's names) evaluated in a new interpreter, as the
    benchmark runs: the measured process then holds the sandbox client and nothing of the rest
    of the test session (whose allocator reuses freed memory and whose descriptors come and
    go, which made the in-process slopes depend on the tests that ran before)."""
    import json

    code = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('soak_test', {str(Path(__file__))!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        f"print(json.dumps(mod.{call}, default=str))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_short_soak_is_flat_and_deterministic() -> None:
    _sandbox().close()  # skip early where the sandbox cannot run
    res = _in_fresh_python("soak.run_soak(300, 0, sample_every=100, workers=2, rerun=40)")
    flat = soak.flatness(res["samples"], SHORT_BOUNDS)
    assert all(v["flat"] for v in flat.values()), flat
    assert res["wrong_verdicts"] == []
    assert res["rerun"]["identical"], res["rerun"]["differences"]
    assert res["tmp_host_after_close"] == 0
    assert len(res["samples"]) == 4 and res["samples"][-1]["executions"] == 300
    # the mix reaches every kind and every status a hostile program can end with
    assert set(res["kinds"]) == {k.name for k in soak.KINDS}
    assert {"ok", "failed", "error", "timeout", "killed"} <= set(res["statuses"])


def leaky_run() -> dict[str, Any]:
    """The short soak through a :class:`LeakySandbox` (run in a fresh interpreter)."""
    boxes: list[LeakySandbox] = []

    def factory() -> Sandbox:
        boxes.append(LeakySandbox(workers=2, strict=True))
        return boxes[-1]

    res = soak.run_soak(300, 1, sample_every=100, workers=2, rerun=0, box_factory=factory)
    res["fds_left_open"] = len(boxes[0].fds) if boxes else None
    return res


def test_short_soak_catches_injected_leaks() -> None:
    _sandbox().close()
    res = _in_fresh_python("leaky_run()")
    flat = soak.flatness(res["samples"], SHORT_BOUNDS)
    assert not flat["fds"]["flat"] and flat["fds"]["slope_per_1000"] >= 90, flat["fds"]
    assert not flat["children"]["flat"], flat["children"]
    assert not flat["rss_mb"]["flat"] and flat["rss_mb"]["slope_per_1000"] > 10, flat["rss_mb"]
    assert flat["threads"]["flat"] and flat["tmp_sandbox"]["flat"]
    assert not res["ok"]
    assert res["fds_left_open"] == 0  # closed by the soak


def test_slope_and_throughput_helpers() -> None:
    assert soak.slope_per_1000([0, 100, 200], [5, 6, 7]) == pytest.approx(10.0)
    assert soak.slope_per_1000([100], [3]) == 0.0
    tp = soak.throughput([0.5 * (i + 1) for i in range(100)], window=10)
    assert tp["first_per_s"] == pytest.approx(2.0) and tp["last_over_first"] == pytest.approx(1)
    assert [j.program for j in soak.make_jobs(20, 3)] == [j.program for j in soak.make_jobs(20, 3)]
