"""The host side of one sandbox worker: start it, speak its protocol (a 4-byte big-endian length,
then that many bytes of UTF-8 JSON; see :mod:`gbmpo.sandbox.worker`), kill it."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import signal
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from gbmpo.sandbox.errors import SandboxError

__all__ = ["HELLO_TIMEOUT_S", "Spawner", "WorkerProcess"]

HELLO_TIMEOUT_S = 30.0

T = TypeVar("T")


class WorkerProcess:
    """A sandbox worker process and its pipes (used by one thread at a time)."""

    def __init__(self, argv: list[str], popen_kw: dict[str, Any]) -> None:
        self.argv = argv
        self.popen_kw = popen_kw
        self.proc: subprocess.Popen[bytes] | None = None
        self.hello: dict[str, Any] = {}
        self._stderr: Any = None

    def start(self) -> dict[str, Any]:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the worker
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            bufsize=0,
            close_fds=True,
            start_new_session=True,
            **self.popen_kw,
        )
        try:
            self.hello = self._recv(time.monotonic() + HELLO_TIMEOUT_S)
        except SandboxError as exc:
            err = self._stderr_text()
            self.kill()
            raise SandboxError(f"sandbox worker did not start ({exc}); stderr: {err}") from None
        return self.hello

    def _stderr_text(self) -> str:
        try:
            self._stderr.seek(0)
            return self._stderr.read(4000).decode("utf-8", "replace").strip() or "(empty)"
        except Exception:  # noqa: BLE001
            return "(unavailable)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def call(self, request: dict[str, Any], deadline: float) -> dict[str, Any]:
        if self.proc is None or self.proc.stdin is None or self.proc.poll() is not None:
            raise SandboxError("sandbox worker is gone")
        data = json.dumps(request).encode("utf-8")
        try:
            self.proc.stdin.write(struct.pack(">I", len(data)) + data)
        except (BrokenPipeError, OSError) as exc:
            raise SandboxError(f"sandbox worker is gone ({exc})") from None
        return self._recv(deadline)

    def _read(self, n: int, deadline: float) -> bytes:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        out = bytearray()
        while len(out) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SandboxError("sandbox worker did not answer in time")
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise SandboxError("sandbox worker closed its output")
            out += chunk
        return bytes(out)

    def _recv(self, deadline: float) -> dict[str, Any]:
        (length,) = struct.unpack(">I", self._read(4, deadline))
        if length > 64 << 20:
            raise SandboxError(f"sandbox worker sent an oversized message ({length} bytes)")
        return json.loads(self._read(length, deadline).decode("utf-8"))

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        if self._stderr is not None:
            self._stderr.close()
        self.proc = None

    def close(self) -> None:
        """Ask the worker to exit (EOF on its input); kill it if it lingers."""
        if self.proc is None:
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class Spawner:
    """A long-lived thread that starts every worker.

    ``bwrap --die-with-parent`` (like ``PR_SET_PDEATHSIG``) fires when the *thread* that started
    the sandbox exits, so workers must not be started from short-lived pool threads.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="gbmpo-sandbox-spawner",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def run(self, fn: Callable[[], T]) -> T:
        fut: Future[T] = Future()
        self._jobs.put((fn, fut))
        return fut.result()

    def stop(self) -> None:
        self._jobs.put(None)
