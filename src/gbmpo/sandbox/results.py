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
    """One program to run: ``code`` (untrusted), then ``setup`` (trusted), then each test.

    ``keep`` lists names the program may define although they shadow a builtin (an entry point
    named ``sum``); every other such module-level name is removed before the tests run.
    """

    code: str
    tests: tuple[str, ...] | list[str]
    setup: str = ""
    keep: tuple[str, ...] = ()


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
    program_error = setup_error = first_fail = None
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
        elif kind == "done":
            done = True
        elif kind == "program-error":
            program_error = parts[2] if len(parts) > 2 else "an exception"
        elif kind == "setup-error":
            setup_error = parts[2] if len(parts) > 2 else "an exception"
    ok = tuple(p and not f for p, f in zip(passed, failed, strict=True))
    n_ok = sum(ok)
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
    )
