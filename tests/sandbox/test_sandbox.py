"""The code sandbox: statuses, scoring by marker, protections report, strict mode, recovery."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gbmpo.rewards import REWARDS
from gbmpo.sandbox import (
    ALLOW_ENV,
    PROTECTIONS,
    STATUSES,
    Program,
    RunResult,
    Sandbox,
    SandboxError,
    SandboxUnavailableError,
    SandboxWarning,
    judge,
    run_program,
)

ADD = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(-1, 1) == 0"]


def test_all_protections_active_here(sandbox: Sandbox) -> None:
    assert sandbox.missing == ()
    assert set(sandbox.protections) == set(PROTECTIONS)
    assert all(sandbox.protections.values())
    assert "missing: none" in sandbox.describe()


def test_ok_failed_and_per_test_results(sandbox: Sandbox) -> None:
    ok = sandbox.run(ADD, ["assert add(1, 2) == 3", "assert add(0, 0) == 0"])
    assert (ok.status, ok.passed, ok.total, ok.all_passed) == ("ok", 2, 2, True)
    r = sandbox.run(ADD, TESTS)
    assert r.status == "failed"
    assert r.test_passed == (True, False, True)
    assert r.passed == 2 and r.total == 3
    assert r.pass_fraction == pytest.approx(2 / 3)
    assert not r.all_passed
    assert "test 1 raised AssertionError" in r.detail


def test_raising_test_counts_as_failed(sandbox: Sandbox) -> None:
    code = "def f(x):\n    raise ValueError('boom')\n"
    r = sandbox.run(code, ["f(1)", "assert True"])
    assert r.status == "failed"
    assert r.test_passed == (False, True)
    assert "ValueError" in r.detail


def test_syntax_error_and_top_level_raise_are_errors(sandbox: Sandbox) -> None:
    r = sandbox.run("def f(:\n    pass", ["assert True"])
    assert (r.status, r.passed) == ("error", 0)
    assert "SyntaxError" in r.detail
    r = sandbox.run("raise RuntimeError('x')", ["assert True"])
    assert (r.status, r.passed) == ("error", 0)
    assert "RuntimeError" in r.detail


def test_setup_runs_after_program_and_before_tests(sandbox: Sandbox) -> None:
    code = "class Box:\n    def __init__(self, v):\n        self.v = v\n"
    r = sandbox.run(code + "def get(b):\n    return b.v\n", ["assert get(box) == 7"],
                    setup="box = Box(7)\nimport math")
    assert r.status == "ok"
    r = sandbox.run("def get(b):\n    return 1\n", ["assert get(1) == 1"], setup="box = Box(7)")
    assert r.status == "error" and "setup" in r.detail and r.passed == 0


def test_output_is_captured_and_capped(sandbox: Sandbox) -> None:
    r = sandbox.run("print('hello sandbox')\n" + ADD, ["assert add(1, 1) == 2"])
    assert r.status == "ok" and "hello sandbox" in r.output and not r.output_truncated


def test_timeout(sandbox: Sandbox) -> None:
    r = sandbox.run("while True:\n    pass\n", ["assert True"], timeout_s=1.0)
    assert (r.status, r.passed) == ("timeout", 0)


def test_partial_credit_survives_a_timeout_in_a_later_test(sandbox: Sandbox) -> None:
    code = "def f(x):\n    while x > 1:\n        pass\n    return x\n"
    r = sandbox.run(code, ["assert f(1) == 1", "f(2)"], timeout_s=1.0)
    assert r.status == "timeout"
    assert r.test_passed == (True, False)


def test_shadowing_entry_point_is_kept_only_when_listed(sandbox: Sandbox) -> None:
    code = "def sum(a, b):\n    return a * b\n"  # MBPP task 126 names its function `sum`
    assert sandbox.run(code, ["assert sum(2, 3) == 6"], keep=["sum"]).status == "ok"
    # Not listed: the builtin is restored for the tests.
    assert sandbox.run(code, ["assert sum([2, 3]) == 5"]).status == "ok"


def test_run_many_keeps_order(sandbox: Sandbox) -> None:
    progs = [Program(ADD, [f"assert add({i}, 1) == {i + 1 if i % 2 else 0}"]) for i in range(12)]
    results = sandbox.run_many(progs)
    assert [r.status for r in results] == ["ok" if i % 2 else "failed" for i in range(12)]
    assert results[0].status == "failed"  # add(0, 1) == 0 is false


def test_module_level_run_program_and_registry() -> None:
    r = run_program(ADD, ["assert add(2, 3) == 5"], timeout_s=5.0)
    assert isinstance(r, RunResult) and r.status == "ok"
    assert {"math", "code_pass_fraction", "code_all_pass"} <= set(REWARDS.names())


def test_bad_arguments(sandbox: Sandbox) -> None:
    with pytest.raises(TypeError, match="sequence of test"):
        sandbox.run(ADD, "assert add(1, 2) == 3")
    with pytest.raises(ValueError, match="timeout_s"):
        sandbox.run(ADD, ["assert True"], timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        Sandbox(workers=0)
    with pytest.raises(SandboxError, match="interpreter"):
        Sandbox(workers=1, python="/nonexistent/python3")


def test_dead_worker_is_replaced() -> None:
    with Sandbox(workers=1, strict=True) as box:
        proc = box._workers[0].proc
        assert proc is not None
        os.killpg(proc.pid, signal.SIGKILL)  # the worker dies from outside
        proc.wait()
        first = box.run(ADD, ["assert add(1, 1) == 2"])
        assert first.status == "killed" and first.passed == 0
        assert box.run(ADD, ["assert add(1, 1) == 2"]).status == "ok"


def test_missing_isolation_refuses_by_default_naming_layers_and_fixes(monkeypatch) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.delenv("GBMPO_SANDBOX_STRICT", raising=False)
    with pytest.raises(SandboxUnavailableError) as err:
        Sandbox(workers=1, bubblewrap=False, seccomp=False)
    msg = str(err.value)
    assert "bubblewrap" in msg and "seccomp" in msg and "apt-get install" in msg
    assert "python3-seccomp" in msg and f"{ALLOW_ENV}=1" in msg


def test_machine_without_bwrap_runs_no_code_unless_opted_in(monkeypatch, tmp_path: Path) -> None:
    """The measured hole: without bubblewrap a program wrote into the host's /tmp."""
    import gbmpo.sandbox.client as sb

    real_which = sb.shutil.which
    monkeypatch.setattr(sb.shutil, "which",
                        lambda name, *a, **k: None if name == "bwrap" else real_which(name))
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.setattr(sb, "_default", None)
    target = tmp_path / "pwned.txt"
    os.chmod(tmp_path, 0o777)  # writable even for uid 65534: only the sandbox may stop it
    hostile = f"open({str(target)!r}, 'w').write('x')\n" + ADD
    with pytest.raises(SandboxUnavailableError, match="bubblewrap"):
        sb.run_program(hostile, ["assert add(1, 1) == 2"])
    assert not target.exists()
    # Opting in runs the program, weaker and with a warning naming what is missing.
    monkeypatch.setenv(ALLOW_ENV, "1")
    with pytest.warns(SandboxWarning, match="bubblewrap"), Sandbox(workers=1) as box:
        assert "bubblewrap" in box.missing
        assert box.run(ADD, TESTS).test_passed == (True, False, True)


def test_weaker_sandbox_says_what_is_missing_and_strict_refuses() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        box = Sandbox(workers=1, bubblewrap=False, seccomp=False, allow_unsandboxed=True)
    try:
        assert {"bubblewrap", "seccomp"} <= set(box.missing)
        assert not box.protections["bubblewrap"] and not box.protections["seccomp"]
        msgs = [str(w.message) for w in caught if issubclass(w.category, SandboxWarning)]
        assert msgs and "bubblewrap" in msgs[0] and "seccomp" in msgs[0]
        # Still correct, only weaker.
        assert box.run(ADD, TESTS).test_passed == (True, False, True)
        if os.geteuid() == 0:
            assert box.protections["unprivileged"]  # still uid 65534
    finally:
        box.close()
    with pytest.raises(SandboxUnavailableError, match="seccomp"):
        Sandbox(workers=1, seccomp=False, strict=True, allow_unsandboxed=True)


# ---------------------------------------------------------------------------------------------
# scoring of the result channel (pure)

MARK = "0123456789abcdef0123456789abcdef"


def _resp(results: str, **kw: object) -> dict[str, object]:
    base = {"exit": 0, "signal": None, "timed_out": False, "output_overflow": False,
            "output": "", "results": results, "duration_s": 0.01}
    base.update(kw)
    return base


def test_judge_statuses() -> None:
    done = f"{MARK} pass 0\n{MARK} pass 1\n{MARK} done\n"
    assert judge(_resp(done), MARK, 2).status == "ok"
    failed = f"{MARK} pass 0\n{MARK} fail 1 X\n{MARK} done\n"
    assert judge(_resp(failed), MARK, 2).status == "failed"
    assert judge(_resp(f"{MARK} pass 0\n"), MARK, 2).status == "error"  # exited early
    assert judge(_resp(f"{MARK} program-error NameError\n"), MARK, 2).status == "error"
    assert judge(_resp("", timed_out=True), MARK, 2).status == "timeout"
    assert judge(_resp("", signal=24), MARK, 2).status == "timeout"  # SIGXCPU
    assert judge(_resp("", output_overflow=True), MARK, 2).status == "killed"
    assert judge(_resp("", signal=9, exit=None), MARK, 2).status == "killed"
    assert set(STATUSES) == {"ok", "failed", "timeout", "error", "killed"}


def test_judge_ignores_lines_without_the_marker_and_out_of_range_tests() -> None:
    forged = "pass 0\nPASS\n" + "f" * 32 + " pass 0\n" + f"{MARK} pass 7\n{MARK}x pass 1\n"
    r = judge(_resp(forged + f"{MARK} done\n"), MARK, 2)
    assert r.passed == 0 and r.status == "failed"
    # A test reported both passed and failed does not count.
    r = judge(_resp(f"{MARK} pass 0\n{MARK} fail 0 E\n{MARK} done\n"), MARK, 1)
    assert r.passed == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pass", "fail", "done", "program-error"]),
                          st.integers(0, 5), st.text(alphabet="0123456789abcdef", max_size=32)),
                max_size=20))
def test_judge_never_credits_a_wrong_marker(lines: list[tuple[str, int, str]]) -> None:
    text = "".join(f"{m} {k} {i}\n" for k, i, m in lines if m != MARK)
    r = judge(_resp(text), MARK, 6)
    assert r.passed == 0 and r.status != "ok"


def test_large_programs_and_outputs_travel_through_pipes(sandbox: Sandbox) -> None:
    big = ADD + "".join(f"CONST_{i} = {i}\n" for i in range(20000))  # ~300 kB of source
    assert len(big) > 200_000
    assert sandbox.run(big, ["assert add(CONST_5, 1) == 6"]).status == "ok"


#: a user's program that forks daemonic pool workers after using the sandbox. It runs in a fresh
#: interpreter: forking the test process itself could copy a lock held by a thread that an
#: earlier test left running (Ray's, for one), and the forked worker would wait on it forever
_FORKED_POOL = """
import multiprocessing as mp
from gbmpo.sandbox import run_program

ADD = {add!r}


def run_in_child(_):
    return run_program(ADD, ["assert add(1, 2) == 3"]).status


if __name__ == "__main__":
    assert run_program(ADD, ["assert add(1, 2) == 3"]).status == "ok"  # the parent's sandbox
    with mp.get_context("fork").Pool(2) as pool:
        assert pool.map(run_in_child, range(4)) == ["ok"] * 4
    assert run_program(ADD, ["assert add(1, 2) == 3"]).status == "ok"  # still the parent's
    print("forked-pool-ok")
"""


def test_run_program_from_forked_daemonic_workers(tmp_path: Path) -> None:
    script = tmp_path / "forked_pool.py"
    script.write_text(_FORKED_POOL.format(add=ADD))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "forked-pool-ok" in proc.stdout, proc.stderr[-3000:]
