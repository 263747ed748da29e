"""Shared helpers of the benchmark scripts: machine load, memory counters, JSON output.

Memory is read from ``/proc/self/status``: ``VmRSS`` (current resident set) and ``VmHWM`` (its
peak). Writing ``5`` to ``/proc/self/clear_refs`` resets the peak to the current RSS (Linux >= 4.0),
so "extra peak" = VmHWM after the measured call - VmRSS before it. PyTorch's CPU allocations go
through malloc/mmap and are invisible to ``tracemalloc``; RSS sees them (and also sees what the
allocator keeps cached or fragmented, which is part of the real cost).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
GB = 1e9


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not found in /proc/self/status")


def rss_bytes() -> int:
    """Current resident set size of this process."""
    return _status_kb("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter to the current RSS; False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak RSS since the last :func:`reset_peak_rss` (or since the process started)."""
    try:
        return _status_kb("VmHWM") * 1024
    except RuntimeError:  # pragma: no cover - non-Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_average() -> list[float]:
    """1, 5 and 15-minute load averages (the machine's 2 cores are shared)."""
    return [round(x, 2) for x in os.getloadavg()]


def _torch_version() -> str:
    """The installed torch's version, from its package metadata: a driver that only starts
    children (which measure) does not import torch for it (a second and more per benchmark)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:  # a torch without metadata (e.g. on the path from a build)
        import torch

        return str(torch.__version__)


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": _torch_version(),
        "loadavg_start": load_average(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def run_child(args: list[str], env: dict[str, str] | None = None, timeout: float = 3600) -> Any:
    """Run ``python <args>`` in a fresh process; it must print one JSON object as its last line."""
    full_env = dict(os.environ)
    full_env.setdefault("HF_HUB_OFFLINE", "1")
    full_env.setdefault("TOKENIZERS_PARALLELISM", "false")
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=full_env, timeout=timeout
    )
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"benchmark child {' '.join(args)} failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return json.loads(lines[-1])


def serve_child(
    a: argparse.Namespace, roles: dict[str, Callable[[argparse.Namespace], Any]]
) -> bool:
    """In a child process (``--child ROLE``): run that role and print its result as one JSON
    line (what :func:`run_child` reads); False in the driver process (no ``--child``)."""
    if not a.child:
        return False
    print(json.dumps(roles[a.child](a)))
    return True


def run_child_logged(args: list[str], env: dict[str, str] | None = None) -> Any:
    """:func:`run_child`, with the load average just before it started as ``loadavg_start``."""
    load = load_average()
    res = run_child(args, env)
    res["loadavg_start"] = load
    return res


def start_result(name: str) -> dict[str, Any]:
    """The head of a result file: the benchmark's name, the command line and the machine."""
    return {
        "benchmark": name,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
    }


def finish_result(result: dict[str, Any], out: str | Path | None = None) -> Path:
    """Record the load average at the end and write ``result`` (from :func:`start_result`) to
    ``out`` (default ``benchmarks/results/<benchmark>.json``); returns the path."""
    result["machine"]["loadavg_end"] = load_average()
    path = Path(out) if out else RESULTS_DIR / f"{result['benchmark']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    return path


@dataclass
class Measurement:
    """Wall and CPU seconds of a measured block, the RSS before it and the peak RSS during it."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0
    rss_before: int = 0
    peak: int = 0

    def record(self) -> dict[str, float]:
        """``seconds``, ``cpu_seconds`` and ``extra_peak_gb`` (peak minus the RSS before)."""
        return {
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "extra_peak_gb": (self.peak - self.rss_before) / GB,
        }


@contextmanager
def measure() -> Iterator[Measurement]:
    """Measure the ``with`` block: after a ``gc.collect()``, the RSS is read and the peak-RSS
    counter reset; the yielded :class:`Measurement` is filled in when the block ends."""
    m = Measurement()
    gc.collect()
    m.rss_before = rss_bytes()
    reset_peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    yield m
    m.seconds, m.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    m.peak = peak_rss_bytes()


def best_of(runs: list[dict[str, float]]) -> dict[str, float]:
    """The figures of repeated :meth:`Measurement.record` s: the fastest wall and CPU time, and
    the memory of the first run (the one that pays for any one-time allocation)."""
    return {
        "seconds_min": min(r["seconds"] for r in runs),
        "cpu_seconds_min": min(r["cpu_seconds"] for r in runs),
        "extra_peak_gb": runs[0]["extra_peak_gb"],
    }


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        raise ValueError("median of nothing")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
