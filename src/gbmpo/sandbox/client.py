"""Hardened execution of untrusted Python programs against unit tests: the client API.

The subpackage's modules: this client (the worker pool and the process-wide default),
:mod:`~gbmpo.sandbox.results` (programs in, scored results out),
:mod:`~gbmpo.sandbox.isolation` (the layers and the command that starts a worker inside them),
:mod:`~gbmpo.sandbox.channel` (the host side of one worker), :mod:`~gbmpo.sandbox.worker` (the
program that runs in the sandbox), :mod:`~gbmpo.sandbox.run_sides` (its program's process and
judge) and :mod:`~gbmpo.sandbox.strict_compare` (the reward-hacking defences: test rewrite and
comparison helpers).

Layered design:

1. The calling process never runs untrusted code itself. It talks to long-lived *workers* over
   pipes and restarts a worker that dies or stops answering.
2. Each worker is ``python3 -I -S`` (a system interpreter that uid 65534 can execute, by default
   ``/usr/bin/python3``) running :mod:`gbmpo.sandbox.worker`, started as uid/gid 65534 (when
   the caller is root), in a new session, with an empty environment, inside **bubblewrap**:
   new user/PID/network/IPC/UTS/mount namespaces, the host's ``/usr`` read-only and nothing
   else of the host file system, private size-limited tmpfs on ``/tmp`` and ``/dev/shm``, no
   capabilities, no nested user namespaces, the worker as PID 1 of its namespace, and the
   sandbox dies with its parent.
3. The worker forks one child per program, the *program's process* (a "zygote": no
   interpreter start per program), ahead of time, so that forking and sandboxing overlap with
   the caller's work, and one *judge* that judges one run after another (forked again after a
   run it did not finish). Each starts its own session, gets rlimits
   (``RLIMIT_AS`` = ``memory_mb``, ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``,
   ``RLIMIT_CORE``), a **seccomp** filter (no sockets, no fork/vfork/process-creating clone, no
   exec, no signals to other PIDs, no ptrace, mount or namespaces), is not dumpable, works in a
   fresh directory, reads stdin from /dev/null and writes output into one capped pipe.
4. **The verdict comes from the judge, which never runs the program.** The program's process
   gets only the code; the judge gets the trusted prelude, setup and tests and the run's random
   marker (128 bits from :func:`secrets.token_hex`), and holds the only descriptor of the
   result channel. A name of the program is, in the judge, a proxy whose calls, attribute reads
   and writes cross to the program's process as plain data (:mod:`~gbmpo.sandbox.plain_data`);
   whatever is not plain data stays there as a handle, and a test that would compare such
   objects or take their truth is *unjudged* (:attr:`RunResult.unjudged`: never passed). The
   worker enforces the wall-clock deadline, kills the program's process (and, inside its PID
   namespace, every other process but the judge) afterwards, removes every file the run left,
   and returns
   the raw result channel; the client scores it (:func:`~gbmpo.sandbox.results.judge`): a test
   counts only if the judge reported it with the marker, so exiting early, raising, printing
   fake results or reading the harness's frames, ``gc`` or memory earns nothing.

**Fail closed.** When an isolation layer (:data:`ISOLATION_LAYERS`) is unavailable (no
``bwrap``, no ``python3-seccomp``, bubblewrap unusable here) the sandbox refuses to start with a
:class:`SandboxUnavailableError` that names each missing layer and how to install it. Running
weaker is an explicit opt-in, as with Hugging Face evaluate's ``HF_ALLOW_CODE_EVAL``:
``GBMPO_ALLOW_UNSANDBOXED_CODE=1`` in the environment, ``allow_unsandboxed=True`` here, or
``run.allow_unsandboxed_code: true`` in a training config; the missing layers are then reported
(:attr:`Sandbox.missing`, a :class:`SandboxWarning`). ``strict=True`` (or
``GBMPO_SANDBOX_STRICT=1``) refuses even then, and also without ``pidfd``. Install the layers on
Debian/Ubuntu with ``apt-get install -y bubblewrap python3-seccomp``.

**Reward-hacking defences** (``strict_compare=True``, the default). The trusted test code is
compiled with type-strict comparisons (:func:`~gbmpo.sandbox.strict_compare.strict_test_source`):
``==``, ``!=``, ``in``, ``not in``, ``<``, ``<=``, ``>``, ``>=`` and the truth of every
``assert`` go through helpers that compare builtin values by kind (numbers with numbers,
strings with strings, containers element by element) and refuse ``True`` for an expected ``1``
(or ``1`` for ``True``: equal only by coercion). An object whose ``__eq__`` is always true, a
subclass of ``int`` with its own ``__eq__``, an always-true ``__bool__`` never reach the judge
(they stay in the program's process as handles), and a program that patches ``abs`` or
``math.isclose`` patches its own process, not the judge's.

Limits (docs/sandbox.md, "Limits"): an answer can be right without being computed honestly (a
table of the visible tests); tests that need the program's own objects are unjudged; generators
are drawn whole; chained comparisons (``a < b < c``) keep Python's semantics. One MBPP
reference solution of 974 (task 414, which returns ``1``/``0`` where the tests expect
``True``/``False``) fails under strict comparison; ``strict_compare=False`` restores Python's
comparisons.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gbmpo.sandbox.channel import Spawner, WorkerProcess
from gbmpo.sandbox.errors import SandboxError, SandboxUnavailableError, SandboxWarning
from gbmpo.sandbox.isolation import (
    ALLOW_ENV,
    DEFAULT_PYTHON,
    ISOLATION_LAYERS,
    NOBODY,
    PROTECTIONS,
    REMEDY,
    bwrap_args,
    env_flag,
    worker_program,
)
from gbmpo.sandbox.results import STATUSES, Program, RunResult, judge
from gbmpo.sandbox.strict_compare import strict_test_source

__all__ = [
    "ALLOW_ENV",
    "ISOLATION_LAYERS",
    "PROTECTIONS",
    "STATUSES",
    "Program",
    "RunResult",
    "Sandbox",
    "SandboxError",
    "SandboxUnavailableError",
    "SandboxWarning",
    "get_default_sandbox",
    "require_sandbox",
    "run_program",
    "run_programs",
    "strict_test_source",
]

_GRACE_S = 5.0  # extra wait for the worker's answer beyond the program's own deadline


# --------------------------------------------------------------------------------------------
# the pool


class Sandbox:
    """A pool of sandbox workers; thread-safe. See the module docstring for the layers.

    Args:
        workers: number of worker processes (default: number of CPUs, at most 8).
        python: interpreter for the workers (default ``$GBMPO_SANDBOX_PYTHON`` or
            ``/usr/bin/python3``); it must be executable by uid 65534 when the caller is root.
        allow_unsandboxed: run although an isolation layer is missing (with a
            :class:`SandboxWarning`); default ``$GBMPO_ALLOW_UNSANDBOXED_CODE``, else refuse
            with :class:`SandboxUnavailableError`.
        strict: refuse unless every protection, ``pidfd`` included, is active, whatever
            ``allow_unsandboxed`` says (default ``$GBMPO_SANDBOX_STRICT``).
        strict_compare: compile the tests with type-strict comparisons (the reward-hacking
            defences of the module docstring); ``False``: Python's own ``==``.
        bubblewrap, seccomp, drop_privileges: turn a layer off (for tests and diagnosis; the
            missing layer is then reported like an unavailable one, so turning off an
            isolation layer also needs ``allow_unsandboxed``).
        timeout_s, memory_mb: defaults for :meth:`run` (wall clock and ``RLIMIT_AS``).
        fsize_mb: largest file a program may write.
        max_output_bytes: a program printing more is killed (status ``killed``).
        keep_output_bytes: how much of the output a :class:`RunResult` keeps.
        tmp_mb, shm_mb: sizes of the private ``/tmp`` and ``/dev/shm`` inside bubblewrap.
        max_answer_bytes: largest encoded answer of one call of the program (a larger one
            fails that test).
    """

    def __init__(
        self,
        workers: int | None = None,
        *,
        python: str | None = None,
        allow_unsandboxed: bool | None = None,
        strict: bool | None = None,
        strict_compare: bool = True,
        bubblewrap: bool = True,
        seccomp: bool = True,
        drop_privileges: bool = True,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        fsize_mb: int = 16,
        max_output_bytes: int = 1 << 20,
        keep_output_bytes: int = 8192,
        tmp_mb: int = 64,
        shm_mb: int = 16,
        max_answer_bytes: int = 16 << 20,
    ) -> None:
        if workers is None:
            workers = min(8, os.cpu_count() or 1)
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if timeout_s <= 0 or memory_mb <= 0:
            raise ValueError("timeout_s and memory_mb must be positive")
        self.num_workers = workers
        self.python = python or os.environ.get("GBMPO_SANDBOX_PYTHON") or DEFAULT_PYTHON
        if not os.path.isfile(self.python) or not os.access(self.python, os.X_OK):
            raise SandboxError(
                f"sandbox interpreter {self.python!r} does not exist or is not executable; "
                "install python3 (Debian: apt-get install python3) or set GBMPO_SANDBOX_PYTHON"
            )
        self.strict = env_flag("GBMPO_SANDBOX_STRICT") if strict is None else strict
        self.allow_unsandboxed = (
            env_flag(ALLOW_ENV) if allow_unsandboxed is None else bool(allow_unsandboxed)
        )
        self.strict_compare = bool(strict_compare)
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.fsize_mb = int(fsize_mb)
        self.max_output_bytes = int(max_output_bytes)
        self.keep_output_bytes = int(keep_output_bytes)
        self.max_answer_bytes = int(max_answer_bytes)
        self._use_seccomp = seccomp
        self._reasons: dict[str, str] = {}
        self._base_dir: str | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()

        is_root = os.geteuid() == 0
        self._drop = drop_privileges and is_root
        if is_root and not drop_privileges:
            self._reasons["unprivileged"] = "drop_privileges=False: programs run as root"
        bwrap = shutil.which("bwrap") if bubblewrap else None
        if not bubblewrap:
            self._reasons["bubblewrap"] = "disabled (bubblewrap=False)"
        elif bwrap is None:
            self._reasons["bubblewrap"] = "bwrap not found (apt-get install bubblewrap)"
        self._bwrap = bwrap
        self._argv, self._popen_kw = self._command(tmp_mb, shm_mb)
        self._spawner = Spawner()
        self._idle: queue.Queue[WorkerProcess] = queue.Queue()
        self._workers: list[WorkerProcess] = []
        try:
            first = self._new_worker()
            if self._bwrap is not None and first.hello.get("pid") != 1:
                self._reasons["bubblewrap"] = "worker is not PID 1 of its own namespace"
            self.protections = self._protections(first.hello, is_root)
            self.missing = tuple(p for p in PROTECTIONS if not self.protections[p])
            if self.missing:
                why = "; ".join(f"{p}: {self._reasons.get(p, 'unavailable')}" for p in self.missing)
                isolation = [p for p in self.missing if p in ISOLATION_LAYERS]
                if self.strict:
                    raise SandboxUnavailableError(
                        f"strict sandbox refused to run without {', '.join(self.missing)} ({why})"
                    )
                if isolation and not self.allow_unsandboxed:
                    fixes = "; ".join(f"{p}: {REMEDY[p]}" for p in isolation if p in REMEDY)
                    raise SandboxUnavailableError(
                        f"refusing to run untrusted code without the isolation layer(s) "
                        f"{', '.join(isolation)} ({why}). To fix: {fixes}. To run with fewer "
                        f"protections at your own risk, set {ALLOW_ENV}=1 (or "
                        "run.allow_unsandboxed_code: true in a training config)"
                    )
                warnings.warn(
                    f"code sandbox runs without {', '.join(self.missing)} ({why})",
                    SandboxWarning,
                    stacklevel=2,
                )
            self._idle.put(first)
            for _ in range(workers - 1):
                self._idle.put(self._new_worker())
        except BaseException:
            self.close()
            raise

    # -- construction -------------------------------------------------------------------------
    def _command(self, tmp_mb: int, shm_mb: int) -> tuple[list[str], dict[str, Any]]:
        src = worker_program()
        cfg = json.dumps({"seccomp": self._use_seccomp})
        kw: dict[str, Any] = {"env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}}
        if self._drop:
            kw.update(user=NOBODY, group=NOBODY, extra_groups=[])
        if self._bwrap is not None:
            kw["cwd"] = "/"
            argv = [self._bwrap, *bwrap_args(self.python, tmp_mb, shm_mb), self.python,
                    "-I", "-S", "-c", src, "/tmp", cfg]
            if not self._probe_bwrap(argv[:-7], kw):
                self._bwrap = None
        if self._bwrap is None:
            # Fallback: a private 0700 work area on the host, owned by the sandbox uid.
            self._base_dir = tempfile.mkdtemp(prefix="gbmpo-sandbox-")
            if self._drop:
                os.chown(self._base_dir, NOBODY, NOBODY)
            kw["cwd"] = self._base_dir
            argv = [self.python, "-I", "-S", "-c", src, self._base_dir, cfg]
        return argv, kw

    def _probe_bwrap(self, prefix: list[str], kw: dict[str, Any]) -> bool:
        try:
            proc = subprocess.run(
                [*prefix, self.python, "-I", "-S", "-c", "pass"],
                capture_output=True, timeout=30, **kw,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._reasons["bubblewrap"] = f"bwrap failed to start: {exc}"
            return False
        if proc.returncode != 0:
            err = proc.stderr.decode("utf-8", "replace").strip()[:300]
            self._reasons["bubblewrap"] = f"bwrap failed here ({err or proc.returncode})"
            return False
        return True

    def _protections(self, hello: dict[str, Any], is_root: bool) -> dict[str, bool]:
        selftest = hello.get("seccomp_selftest") or {}
        seccomp_ok = bool(hello.get("seccomp_active")) and bool(selftest.get("ok"))
        if not self._use_seccomp:
            self._reasons["seccomp"] = "disabled (seccomp=False)"
        elif not seccomp_ok:
            self._reasons["seccomp"] = (
                f"python3-seccomp unusable in {self.python} ({hello.get('seccomp') or selftest})"
                " (apt-get install python3-seccomp)"
            )
        bwrap_ok = self._bwrap is not None and hello.get("pid") == 1
        unprivileged = hello.get("uid") == NOBODY if self._drop else (not is_root and bwrap_ok)
        if not unprivileged and "unprivileged" not in self._reasons:
            self._reasons["unprivileged"] = (
                "programs run as the calling user without bubblewrap"
                if not is_root else "could not switch to uid 65534"
            )
        pidfd = bool(hello.get("pidfd"))
        if not pidfd:
            self._reasons["pidfd"] = "os.pidfd_open unavailable (polling instead)"
        return {
            "bubblewrap": bwrap_ok,
            "unprivileged": bool(unprivileged),
            "seccomp": seccomp_ok,
            "rlimits": True,
            "process_group": True,
            "pidfd": pidfd,
            "output_cap": True,
        }

    def _new_worker(self) -> WorkerProcess:
        worker = WorkerProcess(self._argv, self._popen_kw)
        self._spawner.run(worker.start)
        with self._lock:
            self._workers.append(worker)
        return worker

    def _replace(self, worker: WorkerProcess) -> WorkerProcess | None:
        worker.kill()
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)
            if self._closed:
                return None
        try:
            return self._new_worker()
        except SandboxError:
            return None

    # -- running ------------------------------------------------------------------------------
    def _take_worker(self) -> WorkerProcess:
        """An idle worker; raises instead of waiting forever when none is left."""
        while True:
            try:
                return self._idle.get(timeout=1.0)
            except queue.Empty:
                with self._lock:
                    alive = len(self._workers)
                if self._closed or alive == 0:
                    raise SandboxError(
                        "no sandbox worker is available (closed, or none could be restarted)"
                    ) from None

    def describe(self) -> str:
        """One line naming the active and missing protections."""
        on = ", ".join(p for p in PROTECTIONS if self.protections[p])
        off = ", ".join(self.missing) or "none"
        return f"sandbox: {self.num_workers} worker(s), {self.python}; active: {on}; missing: {off}"

    def run(
        self,
        code: str,
        tests: Sequence[str],
        *,
        setup: str = "",
        keep: Sequence[str] = (),
        prelude: str = "",
        timeout_s: float | None = None,
        memory_mb: int | None = None,
    ) -> RunResult:
        """Run ``code`` in the program's process and ``prelude``, ``setup`` and each test in the
        judge; see :class:`RunResult` and :class:`Program` (``keep``, ``prelude``)."""
        if self._closed:
            raise SandboxError("the sandbox is closed")
        if os.getpid() != self._pid:
            raise SandboxError(
                "this Sandbox was created in another process (fork); create a new one here "
                "(gbmpo.sandbox.get_default_sandbox() does this automatically)"
            )
        if isinstance(tests, str):
            raise TypeError("tests must be a sequence of test snippets, not one string")
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        tests = [str(t) for t in tests]
        sent = [strict_test_source(t) for t in tests] if self.strict_compare else tests
        timeout = float(timeout_s if timeout_s is not None else self.timeout_s)
        if timeout <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout}")
        marker = secrets.token_hex(16)
        request = {
            "code": code,
            "tests": sent,
            "setup": setup,
            "prelude": str(prelude),
            "keep": [str(k) for k in keep],
            "marker": marker,
            "timeout_s": timeout,
            "memory_mb": int(memory_mb if memory_mb is not None else self.memory_mb),
            "fsize_mb": self.fsize_mb,
            "max_output_bytes": self.max_output_bytes,
            "max_answer_bytes": self.max_answer_bytes,
            "strict_compare": self.strict_compare,
        }
        worker = self._take_worker()
        try:
            response = worker.call(request, time.monotonic() + timeout + _GRACE_S)
        except SandboxError as exc:
            replacement = self._replace(worker)
            if replacement is not None:
                self._idle.put(replacement)
            return RunResult(status="killed", passed=0, total=len(tests),
                             test_passed=(False,) * len(tests), detail=str(exc))
        except BaseException:
            replacement = self._replace(worker)
            if replacement is not None:
                self._idle.put(replacement)
            raise
        self._idle.put(worker)
        if "worker_error" in response:
            return RunResult(status="error", passed=0, total=len(tests),
                             test_passed=(False,) * len(tests),
                             detail=f"sandbox worker error: {response['worker_error']}")
        return judge(response, marker, len(tests), self.keep_output_bytes)

    def run_many(
        self,
        programs: Iterable[Program],
        *,
        timeout_s: float | None = None,
        memory_mb: int | None = None,
    ) -> list[RunResult]:
        """Run many programs on all workers at once; results keep the input order."""
        progs = list(programs)
        if not progs:
            return []

        def one(p: Program) -> RunResult:
            return self.run(p.code, list(p.tests), setup=p.setup, keep=p.keep,
                            prelude=p.prelude, timeout_s=timeout_s, memory_mb=memory_mb)

        if self.num_workers == 1 or len(progs) == 1:
            return [one(p) for p in progs]
        with ThreadPoolExecutor(max_workers=min(self.num_workers, len(progs))) as pool:
            return list(pool.map(one, progs))

    def close(self) -> None:
        """Stop every worker and remove the work area."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
            self._workers.clear()
        if os.getpid() == self._pid:
            for w in workers:
                w.close()
            if getattr(self, "_spawner", None) is not None:
                self._spawner.stop()
            if self._base_dir is not None:
                shutil.rmtree(self._base_dir, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the real API
        with contextlib.suppress(Exception):
            self.close()


# --------------------------------------------------------------------------------------------
# module-level convenience


_default: Sandbox | None = None
_default_lock = threading.Lock()


def get_default_sandbox() -> Sandbox:
    """The process-wide sandbox used by :func:`run_program` (created on first use)."""
    global _default
    with _default_lock:
        if _default is None or _default._closed or _default._pid != os.getpid():
            _default = Sandbox()
        return _default


def require_sandbox(allow_unsandboxed: bool = False) -> Sandbox:
    """Start the process-wide sandbox now, before a command writes anything: where an isolation
    layer is missing this raises :class:`SandboxUnavailableError` (naming the layers) unless the
    user opted in, by ``allow_unsandboxed`` (exported as ``$GBMPO_ALLOW_UNSANDBOXED_CODE`` so the
    processes a run starts inherit it) or by that variable itself."""
    if allow_unsandboxed:
        os.environ[ALLOW_ENV] = "1"
    return get_default_sandbox()


def _close_default() -> None:
    if _default is not None and _default._pid == os.getpid():
        _default.close()


atexit.register(_close_default)


def run_program(
    code: str,
    tests: Sequence[str],
    *,
    setup: str = "",
    keep: Sequence[str] = (),
    prelude: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    sandbox: Sandbox | None = None,
) -> RunResult:
    """Run untrusted ``code`` in the sandbox and judge it with each snippet of ``tests``.

    Each test is Python source (typically ``assert f(1) == 2``) executed in the judge, where
    the program's names are proxies to the program's process (module docstring); it passes iff
    it runs to completion without raising and needed none of the program's own objects.
    ``setup`` is trusted code executed in the judge after the program ran and before the tests
    (imports or inputs the tests need, MBPP's ``test_setup_code``); ``keep``, ``prelude``: see
    :class:`Program`.
    """
    box = sandbox if sandbox is not None else get_default_sandbox()
    return box.run(code, tests, setup=setup, keep=keep, prelude=prelude, timeout_s=timeout_s,
                   memory_mb=memory_mb)


def run_programs(
    programs: Iterable[Program],
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    sandbox: Sandbox | None = None,
) -> list[RunResult]:
    """Run many programs in parallel on the sandbox's workers (input order preserved)."""
    box = sandbox if sandbox is not None else get_default_sandbox()
    return box.run_many(programs, timeout_s=timeout_s, memory_mb=memory_mb)


