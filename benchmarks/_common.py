"""Shared helpers of the benchmark scripts: machine load, memory counters, JSON output.

Memory is read from ``/proc/self/status``: ``VmRSS`` (current resident set) and ``VmHWM`` (its
peak). Writing ``5`` to ``/proc/self/clear_refs`` resets the peak to the current RSS (Linux >= 4.0),
so "extra peak" = VmHWM after the measured call - VmRSS before it. PyTorch's CPU allocations go
through malloc/mmap and are invisible to ``tracemalloc``; RSS sees them (and also sees what the
allocator keeps cached or fragmented, which is part of the real cost).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
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


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
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


def write_result(name: str, data: dict[str, Any], out: str | Path | None = None) -> Path:
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        raise ValueError("median of nothing")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
