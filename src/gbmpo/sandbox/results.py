"""What a sandboxed run gives back: :class:`Program` in, :class:`RunResult` out, and
:func:`judge`, which scores the worker's raw result channel (only lines carrying the run's random
marker count, so a program that exits early or prints fake results earns nothing)."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

__all__ = ["STATUSES", "Program", "RunResult", "judge"]

#: every status a run can end with
STATUSES = ("ok", "failed", "timeout", "error", "killed")


@dataclass(frozen=True)
class Program:
    """One program to run: ``code`` (untrusted, in the program's process), and in the judge:
    ``prelude`` (trusted), then ``setup`` (trusted), then each test.

    ``prelude``: trusted code whose names the judge keeps over the program's (HumanEval's prompt:
    its imports and helpers such as ``poly``; its stub of the entry point gives way to the
    program's when the entry point is in ``keep``). ``keep`` lists names the program may define
    although they shadow a builtin or a prelude name (an entry point named ``sum``); every other
    such name of the program is not seen by the tests.
    """

    code: str
    tests: tuple[str, ...] | list[str]
    setup: str = ""
    keep: tuple[str, ...] = ()
    prelude: str = ""


@dataclass(frozen=True)
class RunResult:
    """Outcome of one sandboxed run.

    ``status`` is one of :data:`STATUSES`:

    * ``ok``: every test ran to completion without raising;
    * ``failed``: the harness finished but at least one test raised (e.g. ``AssertionError``);
    * ``timeout``: the wall-clock deadline or the CPU-time limit was reached;
    * ``error``: the program did not compile or raised at top level, or the process ended
      (for example by ``exit(0)``) before the harness finished;
    * ``killed``: the program was killed for too much output, died by a signal, or the worker
      itself died.

    ``passed`` counts tests reported as passed with the run's marker, whatever the status.
    ``unjudged`` counts tests whose verdict would need the program's own objects (comparing
    two of them, their truth, ``len``...; or a setup that does): they never count as passed
    (status ``failed`` when nothing else went wrong), and evaluation reports them apart.
    """

    status: str
    passed: int
    total: int
    test_passed: tuple[bool, ...] = ()
    detail: str = ""
    exit_code: int | None = None
    signal: int | None = None
    output: str = ""
    output_truncated: bool = False
    duration_s: float = 0.0
    unjudged: int = 0

    @property
    def pass_fraction(self) -> float:
        """``passed / total`` (0 when there are no tests)."""
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        """True iff there is at least one test and every test passed."""
        return self.status == "ok" and self.total > 0 and self.passed == self.total


# --------------------------------------------------------------------------------------------
# scoring of the result channel


def judge(
    response: dict[str, Any], marker: str, total: int, keep_output_bytes: int = 8192
) -> RunResult:
    """Turn a worker response into a :class:`RunResult` (only ``marker`` lines count)."""
    passed = [False] * total
    failed = [False] * total
    done = False
    unjudged = [False] * total
    program_error = setup_error = first_fail = None
    setup_unjudged = False
    for line in str(response.get("results", "")).splitlines():
        parts = line.split(" ")
        if len(parts) < 2 or parts[0] != marker:
            continue
        kind = parts[1]
        if kind in ("pass", "fail") and len(parts) >= 3 and parts[2].isdigit():
            i = int(parts[2])
            if 0 <= i < total:
                if kind == "pass":
                    passed[i] = True
                else:
                    failed[i] = True
                    if first_fail is None:
                        name = parts[3] if len(parts) > 3 else "an exception"
                        first_fail = f"test {i} raised {name}"
        elif kind == "unjudged" and len(parts) >= 3 and parts[2].isdigit():
            if int(parts[2]) < total:
                unjudged[int(parts[2])] = True
        elif kind == "setup-unjudged":
            setup_unjudged = True
        elif kind == "done":
            done = True
        elif kind == "program-error":
            program_error = parts[2] if len(parts) > 2 else "an exception"
        elif kind == "setup-error":
            setup_error = parts[2] if len(parts) > 2 else "an exception"
    if setup_unjudged:
        unjudged = [True] * total
    ok = tuple(p and not f and not u for p, f, u in zip(passed, failed, unjudged, strict=True))
    n_ok = sum(ok)
    n_unjudged = sum(u and not f for u, f in zip(unjudged, failed, strict=True))
    sig = response.get("signal")
    exit_code = response.get("exit")
    if response.get("timed_out") or sig == signal.SIGXCPU:
        status, detail = "timeout", "time limit reached"
    elif response.get("output_overflow"):
        status, detail = "killed", "output limit exceeded"
    elif sig is not None:
        status, detail = "killed", f"killed by signal {signal.Signals(sig).name}"
    elif setup_error is not None:
        status, detail = "error", f"the task's setup code raised {setup_error}"
    elif program_error is not None:
        status, detail = "error", f"program raised {program_error}"
    elif not done:
        status = "error"
        detail = f"process exited (code {exit_code}) before the tests finished"
    elif n_ok == total and total > 0:
        status, detail = "ok", ""
    else:
        status, detail = "failed", first_fail or "no tests"
        if n_unjudged and first_fail is None:
            detail = (f"{n_unjudged} test(s) need the program's own objects (unjudged)"
                      if not setup_unjudged else
                      "the task's setup code needs the program's own objects (unjudged)")
    output = str(response.get("output", ""))
    truncated = bool(response.get("output_overflow")) or len(output) > keep_output_bytes
    return RunResult(
        status=status,
        passed=n_ok,
        total=total,
        test_passed=ok,
        detail=detail,
        exit_code=exit_code,
        signal=sig,
        output=output[:keep_output_bytes],
        output_truncated=truncated,
        duration_s=float(response.get("duration_s", 0.0)),
        unjudged=n_unjudged,
    )
