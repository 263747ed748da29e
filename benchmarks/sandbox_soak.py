"""Soak test of the code sandbox: many thousands of programs through ONE client, looking for leaks.

A seeded mix of programs (:data:`KINDS`: passing, failing, raising, not compiling, timing out,
allocating past the memory limit, forking repeatedly, writing files, opening sockets, flooding
the output, threads, and the hostile programs of the sandbox's tests: exiting early, killing
their parent, patching builtins, closing the result channel) goes through one
:class:`~gbmpo.sandbox.Sandbox` in batches, as a reward function sends them. Every
``--sample-every`` executions the client process is measured:

* ``rss_mb``: resident set size of this (the client's) process;
* ``fds``: its open file descriptors; ``threads``: its threads;
* ``children``: its live descendant processes (bubblewrap, the workers, their pre-forked
  children);
* ``tmp_host``: entries in the client's temporary directory (a private one made for the soak,
  so other processes on the machine do not count);
* ``tmp_sandbox``: the most entries found in one worker's private ``/tmp`` (a probe program per
  worker lists it; probes are not counted as executions).

Each metric's least-squares slope per 1,000 executions is compared with a flatness bound
(:data:`BOUNDS`, reasoned in its comment). Reported besides: throughput (executions per second)
of the last 1,000 executions against the first 1,000, every verdict that differs from what its
kind must give, and whether the verdicts of a seeded sample re-run in a fresh client are
identical (status, tests passed).

    python benchmarks/sandbox_soak.py --executions 10000 --seed 0 --json OUT

The last printed line is a one-line summary; exit code 1 when a bound is exceeded, a verdict is
wrong or the re-run differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gbmpo.sandbox import Program, RunResult, Sandbox

RESULTS = Path(__file__).resolve().parent / "results" / "sandbox_soak.json"

#: Flatness bounds on the least-squares slope of each metric, per 1,000 executions. Counts
#: (descriptors, threads, processes, directory entries) must not drift at all: a leak of one
#: object per 1,000 executions (one per program of a kind that makes up 0.1% of the mix) gives
#: a slope of 1, so the bound is half of that. RSS: the client keeps one small verdict per
#: execution (about 0.2 KiB) and the allocator settles in over the first thousand; a leak of
#: 2 KiB per execution (one kept output buffer or response dict) gives 2 MiB per 1,000, so the
#: bound is 1 MiB. The slopes are fitted after the first sample (warm-up).
BOUNDS: dict[str, float] = {
    "rss_mb": 1.0,
    "fds": 0.5,
    "threads": 0.5,
    "children": 0.5,
    "tmp_host": 0.5,
    "tmp_sandbox": 0.5,
}

ADD = "def add(a, b):\n    return a + b\n"


@dataclass(frozen=True)
class Kind:
    """A kind of program: how to make one (from a seeded RNG) and the statuses it may end with."""

    name: str
    weight: float
    make: Callable[[random.Random], tuple[str, list[str]]]
    expect: frozenset[str]
    must_pass: bool = False  # every test must pass (a correct program)
    timeout_s: float | None = None
    memory_mb: int | None = None


def _passing(r: random.Random) -> tuple[str, list[str]]:
    a, b = r.randint(-999, 999), r.randint(-999, 999)
    k = r.randint(1, 9)
    code = f"def f(x, y):\n    return x * {k} + y\n"
    return code, [f"assert f({a}, {b}) == {a * k + b}", f"assert f(0, {b}) == {b}"]


def _failing(r: random.Random) -> tuple[str, list[str]]:
    a = r.randint(1, 999)
    return "def f(x):\n    return x + 1\n", [f"assert f({a}) == {a + 2}", f"assert f({a}) > 0"]


def _raising(r: random.Random) -> tuple[str, list[str]]:
    exc = r.choice(["ValueError", "KeyError", "ZeroDivisionError", "RecursionError"])
    if r.random() < 0.5:
        return f"raise {exc}('top level {r.randint(0, 99)}')\n" + ADD, ["assert add(1, 2) == 3"]
    return f"def add(a, b):\n    raise {exc}({r.randint(0, 99)})\n", ["assert add(1, 2) == 3"]


def _recursion(r: random.Random) -> tuple[str, list[str]]:
    return "def f(n):\n    return f(n + 1)\n", [f"assert f({r.randint(0, 9)})"]


def _syntax(r: random.Random) -> tuple[str, list[str]]:
    return f"def add(a, b)\n    return a + {r.randint(0, 9)}\n", ["assert add(1, 2) == 3"]


def _loop(r: random.Random) -> tuple[str, list[str]]:
    if r.random() < 0.5:
        return "while True:\n    pass\n", ["assert True"]
    return "import time\ndef f():\n    time.sleep(60)\n", ["f()"]


def _memory(r: random.Random) -> tuple[str, list[str]]:
    form = r.randrange(3)
    if form == 0:
        code = f"x = bytearray({r.randint(2, 50)} * 2**30)\n"
    elif form == 1:
        code = "xs = []\nwhile True:\n    xs.append(' ' * 10**7)\n"
    else:
        code = "x = [0] * (2**34)\n"
    return code + ADD, ["assert add(1, 2) == 3"]


def _fork(r: random.Random) -> tuple[str, list[str]]:
    form = r.randrange(4)
    code = [
        "import os\nwhile True:\n    os.fork()\n",
        "import os\nforked = 0\nfor _ in range(50):\n    try:\n        os.fork()\n"
        "        forked += 1\n    except OSError:\n        pass\n",
        "import subprocess\nsubprocess.run(['/bin/sh', '-c', ':(){ :|:& };:'])\n",
        "import multiprocessing as mp\nps = [mp.Process(target=print) for _ in range(20)]\n"
        "[p.start() for p in ps]\n",
    ][form]
    tests = ["assert forked > 0"] if form == 1 else ["assert add(1, 2) == 3"]
    return code + ADD, tests


def _files(r: random.Random) -> tuple[str, list[str]]:
    n = r.randint(5, 60)
    code = (
        "import os, tempfile\n"
        f"for i in range({n}):\n"
        "    open(f'out{i}.txt', 'w').write('x' * 1000)\n"
        "os.makedirs('a/b/c', exist_ok=True)\nopen('a/b/c/deep.txt', 'w').write('y')\n"
        "for d in ('/tmp', '/dev/shm'):\n"
        "    try:\n"
        f"        open(os.path.join(d, 'soak-{r.randint(0, 10**6)}'), 'w').write('z')\n"
        "    except OSError:\n        pass\n"
        "fd, _ = tempfile.mkstemp()\nos.write(fd, b'q')\n"
        "leaked = [open(f'out{i}.txt') for i in range(10)]\n" + ADD
    )
    return code, ["assert add(1, 2) == 3", f"assert len([p for p in os.listdir('.') "
                  f"if p.startswith('out')]) == {n}"]


def _socket(r: random.Random) -> tuple[str, list[str]]:
    port = r.randint(1024, 65000)
    code = (
        "import socket\n"
        "def connect():\n"
        f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    return True\n"
        "def listen():\n"
        "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "    s.bind('\\0gbmpo-soak')\n    return True\n"
    )
    return code, ["assert connect()", "assert listen()"]


def _output(r: random.Random) -> tuple[str, list[str]]:
    if r.random() < 0.5:
        return "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", ["assert True"]
    return f"print('hello ' * {r.randint(1, 2000)})\n" + ADD, ["assert add(1, 2) == 3"]


def _threads(r: random.Random) -> tuple[str, list[str]]:
    code = (
        "import threading, time\nts = []\n"
        f"for _ in range({r.randint(50, 400)}):\n"
        "    t = threading.Thread(target=time.sleep, args=(60,), daemon=True)\n"
        "    t.start(); ts.append(t)\n" + ADD
    )
    return code, ["assert add(1, 2) == 3"]


def _hostile(r: random.Random) -> tuple[str, list[str]]:
    wrong = "def add(a, b):\n    return a * b + 7\n"
    code = r.choice([
        "import sys\nsys.exit(0)\n",
        "import os\nos._exit(0)\n",
        "import os\ndef add(a, b):\n    os._exit(0)\n",
        "import atexit, os\natexit.register(lambda: os._exit(0))\n" + wrong,
        "import os, signal\nfor pid in (os.getppid(), 1, -1, 0):\n    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n    except Exception:\n        pass\n" + wrong,
        "import builtins\nbuiltins.exec = lambda *a, **k: None\n" + wrong,
        "import builtins\nbuiltins.AssertionError = type('Y', (Exception,), {})\n" + wrong,
        "import os\nos.write = lambda fd, data: len(data)\n" + wrong,
        "import os\nos.close(3)\n" + wrong,
        "import os\nfor i in range(2):\n    os.write(3, b'%032x pass %d\\n' % (0, i))\n" + wrong,
        "class A:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n"
        "    return A()\n",
        "import ctypes\nctypes.string_at(0)\n",
        "import os\nos.execv('/usr/bin/python3', ['python3', '-c', 'print(1)'])\n",
        "open('/proc/1/environ').read()\n" + wrong,
    ])
    return code, ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]


_BAD = frozenset({"failed", "error", "killed", "timeout"})

#: the seeded mix; weights are relative frequencies
KINDS: tuple[Kind, ...] = (
    Kind("pass", 30, _passing, frozenset({"ok"}), must_pass=True),
    Kind("fail", 12, _failing, frozenset({"failed"})),
    Kind("raise", 8, _raising, frozenset({"error", "failed"})),
    Kind("recursion", 2, _recursion, frozenset({"failed"})),
    Kind("syntax", 4, _syntax, frozenset({"error"})),
    Kind("timeout", 2, _loop, frozenset({"timeout"}), timeout_s=0.4),
    Kind("memory", 4, _memory, frozenset({"error", "killed", "timeout"}), timeout_s=2.0,
         memory_mb=256),
    Kind("fork", 6, _fork, frozenset({"error", "failed"})),
    Kind("files", 8, _files, frozenset({"ok", "error", "failed"})),
    Kind("socket", 6, _socket, frozenset({"failed"})),
    Kind("output", 4, _output, frozenset({"ok", "killed", "timeout"}), timeout_s=2.0),
    Kind("threads", 3, _threads, frozenset({"ok", "error"})),
    Kind("hostile", 11, _hostile, _BAD),
)
_BY_NAME = {k.name: k for k in KINDS}


@dataclass(frozen=True)
class Job:
    """One execution of the soak: its kind, the program and its per-run limits."""

    index: int
    kind: str
    program: Program
    timeout_s: float | None
    memory_mb: int | None


def make_jobs(n: int, seed: int) -> list[Job]:
    """``n`` programs of the seeded mix (the same ``n`` and ``seed`` give the same programs)."""
    rng = random.Random(seed)
    weights = [k.weight for k in KINDS]
    jobs = []
    for i in range(n):
        kind = rng.choices(KINDS, weights)[0]
        code, tests = kind.make(rng)
        jobs.append(Job(i, kind.name, Program(code, tuple(tests)), kind.timeout_s,
                        kind.memory_mb))
    return jobs


def verdict(r: RunResult) -> tuple[str, int, tuple[bool, ...]]:
    """What a run decided: its status and which tests passed (durations and output excluded)."""
    return (r.status, r.passed, tuple(r.test_passed))


_STATUS = ("ok", "failed", "timeout", "error", "killed")


class Verdicts:
    """Every verdict of the soak in preallocated arrays (status code, tests-passed mask,
    passed count), so that keeping them does not grow the client's heap during the soak."""

    def __init__(self, n: int) -> None:
        self.status = array("b", bytes(n))
        self.mask = array("q", bytes(8 * n))
        self.passed = array("h", bytes(2 * n))
        self.ntests = array("h", bytes(2 * n))

    def set(self, i: int, r: RunResult) -> None:
        self.status[i] = _STATUS.index(r.status)
        self.mask[i] = sum(1 << k for k, ok in enumerate(r.test_passed[:62]) if ok)
        self.passed[i] = r.passed
        self.ntests[i] = len(r.test_passed)

    def __getitem__(self, i: int) -> tuple[str, int, tuple[bool, ...]]:
        bits = tuple(bool(self.mask[i] >> k & 1) for k in range(self.ntests[i]))
        return (_STATUS[self.status[i]], self.passed[i], bits)


def unexpected(job: Job, r: RunResult) -> str | None:
    """Why a verdict is wrong for its kind, or None."""
    kind = _BY_NAME[job.kind]
    if r.status not in kind.expect:
        return f"status {r.status!r} not in {sorted(kind.expect)}"
    if kind.must_pass and not r.all_passed:
        return "a correct program did not pass"
    if kind.name in ("hostile", "fork", "memory", "socket", "syntax") and r.passed:
        return f"{r.passed} test(s) passed"
    return None


# --------------------------------------------------------------------------------------------
# measuring the client


def _probe_sandbox_tmp(box: Sandbox) -> int:
    """The most entries in one worker's ``/tmp`` (besides the probe's own directory)."""
    code = (
        "import os\nhere = os.path.basename(os.getcwd())\n"
        "n = len([e for e in os.listdir('/tmp') if e != here])\n"
        "def count():\n    return n\n"
    )
    most = 0
    for _ in range(box.num_workers):  # the idle queue is FIFO: sequential runs visit each worker
        r = box.run(code, ["print('N=%d' % count())"], timeout_s=5.0)
        for line in r.output.splitlines():
            if line.startswith("N="):
                most = max(most, int(line[2:]))
    return most


def sample(box: Sandbox, tmp_dir: str) -> dict[str, float]:
    """The client's resources now (psutil when installed, else ``/proc``)."""
    tmp_sandbox = _probe_sandbox_tmp(box)
    try:
        import psutil

        me = psutil.Process()
        rss = me.memory_info().rss
        fds = me.num_fds()
        threads = me.num_threads()

        def descendants() -> int:
            return len(me.children(recursive=True))
    except ImportError:  # pragma: no cover - psutil is a test dependency
        rss = _proc_rss()
        fds = len(os.listdir("/proc/self/fd"))
        threads = len(os.listdir("/proc/self/task"))

        def descendants() -> int:
            return _proc_descendants(os.getpid())

    # A worker forks its next child just after answering: wait until the count settles.
    children = descendants()
    for _ in range(50):
        time.sleep(0.02)
        again = descendants()
        if again == children:
            break
        children = again
    return {
        "rss_mb": rss / 2**20,
        "fds": fds,
        "threads": threads,
        "children": children,
        "tmp_host": len(os.listdir(tmp_dir)),
        "tmp_sandbox": tmp_sandbox,
    }


def _proc_rss() -> int:  # pragma: no cover - fallback without psutil
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _proc_descendants(pid: int) -> int:  # pragma: no cover - fallback without psutil
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = 0, [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += len(kids)
        frontier.extend(kids)
    return found


def slope_per_1000(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` against ``xs``, times 1,000 (0 with fewer than 2 points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def flatness(samples: list[dict[str, float]], bounds: dict[str, float] | None = None
             ) -> dict[str, dict[str, float | bool]]:
    """Each metric's slope per 1,000 executions (after the first sample) against its bound."""
    bounds = BOUNDS if bounds is None else bounds
    fit = samples[1:] if len(samples) > 2 else samples
    xs = [s["executions"] for s in fit]
    out: dict[str, dict[str, float | bool]] = {}
    for key, bound in bounds.items():
        ys = [s[key] for s in fit]
        slope = slope_per_1000(xs, ys)
        half = len(fit) // 2
        out[key] = {"slope_per_1000": round(slope, 4), "bound": bound,
                    "slope_second_half": round(slope_per_1000(xs[half:], ys[half:]), 4),
                    "first": samples[0][key], "last": samples[-1][key],
                    "flat": abs(slope) <= bound}
    return out


# --------------------------------------------------------------------------------------------
# the soak


def run_jobs(box: Sandbox, jobs: Sequence[Job]) -> list[RunResult]:
    """Run ``jobs`` on ``box`` in order: consecutive jobs with the same limits go together to
    :meth:`Sandbox.run_many` (all workers busy, as a reward function uses it)."""
    results: list[RunResult] = []
    i = 0
    while i < len(jobs):
        j = i
        limits = (jobs[i].timeout_s, jobs[i].memory_mb)
        while j < len(jobs) and (jobs[j].timeout_s, jobs[j].memory_mb) == limits:
            j += 1
        results += box.run_many([jb.program for jb in jobs[i:j]], timeout_s=limits[0],
                                memory_mb=limits[1])
        i = j
    return results


def soak(box: Sandbox, jobs: Sequence[Job], *, sample_every: int, tmp_dir: str,
         batch: int = 32, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Send every job through ``box``; measure it every ``sample_every`` executions."""
    samples = [{"executions": 0, "seconds": 0.0, "load1": os.getloadavg()[0],
                **sample(box, tmp_dir)}]
    verdicts = Verdicts(len(jobs))
    wrong: list[dict[str, Any]] = []
    done_at = array("d", bytes(8 * len(jobs)))  # run time after each execution (no sampling)
    statuses: dict[str, int] = {}
    run_s = 0.0
    start = 0
    while start < len(jobs):
        # batches never straddle a sampling point
        stop = min(start + batch, len(jobs), (start // sample_every + 1) * sample_every)
        chunk = jobs[start:stop]
        t0 = time.perf_counter()
        results = run_jobs(box, chunk)
        elapsed = time.perf_counter() - t0
        for k, (job, r) in enumerate(zip(chunk, results, strict=True)):
            done_at[start + k] = run_s + elapsed * (k + 1) / len(chunk)
            verdicts.set(start + k, r)
            statuses[r.status] = statuses.get(r.status, 0) + 1
            why = unexpected(job, r)
            if why is not None:
                wrong.append({"index": job.index, "kind": job.kind, "why": why,
                              "status": r.status, "detail": r.detail[:200]})
        run_s += elapsed
        if stop % sample_every == 0 or stop == len(jobs):
            samples.append({"executions": stop, "seconds": round(run_s, 3),
                            "load1": os.getloadavg()[0], **sample(box, tmp_dir)})
            if progress is not None:
                last = samples[-1]
                progress(f"{stop} executions, {run_s:.0f} s: rss {last['rss_mb']:.1f} MiB, "
                         f"fds {last['fds']}, threads {last['threads']}, children "
                         f"{last['children']}, tmp {last['tmp_host']}/{last['tmp_sandbox']}")
        start = stop
    return {"samples": samples, "verdicts": verdicts, "wrong": wrong, "statuses": statuses,
            "done_at": done_at, "run_seconds": run_s}


def throughput(done_at: Sequence[float], window: int = 1000) -> dict[str, float]:
    """Executions per second over the first and the last ``window`` executions."""
    n = len(done_at)
    w = min(window, n // 2) if n >= 2 else n
    if w == 0:
        return {"window": 0, "first_per_s": 0.0, "last_per_s": 0.0, "last_over_first": 0.0}
    first = w / done_at[w - 1]
    last = w / (done_at[-1] - done_at[n - w - 1]) if n > w else first
    return {"window": w, "first_per_s": round(first, 2), "last_per_s": round(last, 2),
            "last_over_first": round(last / first, 3)}


def rerun_sample(jobs: Sequence[Job], verdicts: Verdicts, size: int, seed: int,
                 workers: int) -> dict[str, Any]:
    """Re-run ``size`` seeded jobs in a fresh client; list those whose verdict differs."""
    rng = random.Random(seed + 1)
    picks = sorted(rng.sample(range(len(jobs)), min(size, len(jobs))))
    with Sandbox(workers=workers, strict=True) as fresh:
        again = run_jobs(fresh, [jobs[i] for i in picks])
    diff = [{"index": i, "kind": jobs[i].kind, "soak": verdicts[i], "fresh": verdict(r)}
            for i, r in zip(picks, again, strict=True) if verdict(r) != verdicts[i]]
    return {"size": len(picks), "identical": not diff, "differences": diff}


def run_soak(executions: int, seed: int, *, sample_every: int, workers: int, rerun: int,
             box_factory: Callable[[], Sandbox] | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole soak: one client, samples, slopes, throughput and the fresh-client re-run."""
    jobs = make_jobs(executions, seed)
    tmp_dir = tempfile.mkdtemp(prefix="gbmpo-soak-")
    old_tempdir = tempfile.tempdir
    tempfile.tempdir = tmp_dir  # the client's own temporary files land (and are counted) here
    try:
        factory = box_factory or (lambda: Sandbox(workers=workers, strict=True))
        box = factory()
        try:
            started = time.time()
            out = soak(box, jobs, sample_every=sample_every, tmp_dir=tmp_dir,
                       progress=progress)
        finally:
            box.close()
        leftover_after_close = len(os.listdir(tmp_dir))
    finally:
        tempfile.tempdir = old_tempdir
        shutil.rmtree(tmp_dir, ignore_errors=True)
    flat = flatness(out["samples"])
    kinds: dict[str, int] = {}
    for j in jobs:
        kinds[j.kind] = kinds.get(j.kind, 0) + 1
    result: dict[str, Any] = {
        "executions": executions,
        "seed": seed,
        "workers": workers,
        "sample_every": sample_every,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)) + " UTC",
        "run_seconds": round(out["run_seconds"], 1),
        "kinds": kinds,
        "statuses": out["statuses"],
        "samples": out["samples"],
        "flatness": flat,
        "flat": all(v["flat"] for v in flat.values()),
        "throughput": throughput(out["done_at"]),
        "wrong_verdicts": out["wrong"],
        "tmp_host_after_close": leftover_after_close,
    }
    if rerun:
        result["rerun"] = rerun_sample(jobs, out["verdicts"], rerun, seed, workers)
    result["ok"] = (result["flat"] and not out["wrong"]
                    and result.get("rerun", {"identical": True})["identical"]
                    and leftover_after_close == 0)
    return result


def summary(res: dict[str, Any]) -> str:
    flat = res["flatness"]
    slopes = ", ".join(f"{k} {v['slope_per_1000']:+g}/1k (bound {v['bound']:g})"
                       for k, v in flat.items())
    rerun = res.get("rerun")
    rr = (f"re-run of {rerun['size']} in a fresh client "
          f"{'identical' if rerun['identical'] else 'DIFFERS'}") if rerun else "no re-run"
    tp = res["throughput"]
    return (f"sandbox_soak: {res['executions']} executions in {res['run_seconds']} s; "
            f"{'FLAT' if res['flat'] else 'NOT FLAT'}: {slopes}; throughput last/first "
            f"{tp['window']} = {tp['last_per_s']}/{tp['first_per_s']} per s "
            f"({tp['last_over_first']}x); wrong verdicts {len(res['wrong_verdicts'])}; {rr}; "
            f"{'OK' if res['ok'] else 'FAILED'}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--executions", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(RESULTS), help="where to write the result JSON")
    ap.add_argument("--sample-every", type=int, default=500)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rerun", type=int, default=500,
                    help="programs re-run in a fresh client to compare verdicts (0: none)")
    a = ap.parse_args(argv)
    res = run_soak(a.executions, a.seed, sample_every=a.sample_every, workers=a.workers,
                   rerun=a.rerun, progress=lambda s: print(s, flush=True))
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("flatness", "throughput", "statuses")}))
    print(summary(res) + f"; written to {path}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
