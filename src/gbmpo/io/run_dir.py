"""The run directory's plumbing: atomic writes, one owner at a time, the "not empty" check.

* :func:`write_atomic` (text or bytes), :func:`write_json_atomic` and, for writers that take a
  path (safetensors, ``torch.save``), :func:`atomic_path`: readers see the old file or the new
  one, never a partial one, and a failed write leaves no temporary file behind.
* :class:`RunLock`: an exclusive ``flock`` on ``<dir>/.gbmpo.lock`` (which records the owner's
  pid); a second process started on the same directory stops with :class:`RunDirInUseError`
  before writing anything.
* :func:`is_nonempty`: whether an output directory already holds something (a lock file alone
  does not count).
* :class:`CheckpointError` and :func:`root_cause`: a state that could not be written or read,
  named by the operating-system error behind it ("No space left on device").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = [
    "LOCK_FILE",
    "CheckpointError",
    "RunDirInUseError",
    "RunLock",
    "atomic_path",
    "is_nonempty",
    "root_cause",
    "write_atomic",
    "write_json_atomic",
]

LOCK_FILE = ".gbmpo.lock"


class CheckpointError(RuntimeError):
    """No usable checkpoint (every one is damaged), or one could not be written."""


class RunDirInUseError(ValueError):
    """Another live process owns the run directory (the message names it and its pid)."""


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A fresh temporary path beside ``path`` to write to; when the block ends normally the file
    is flushed to disk and renamed onto ``path`` (``os.replace``), otherwise it is removed.

    The temporary name starts with a dot and ends in ``.tmp``; the file is created empty with
    the permissions a plain ``open`` would give it (``0o666`` less the umask).
    """
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{secrets.token_hex(4)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` (text, as UTF-8, or bytes) to ``path`` so that readers see the old or the
    new file, never a partial one."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(raw)


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON (plus a newline) to ``path`` atomically
    (:func:`write_atomic`)."""
    write_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def newest_intact(
    found: Sequence[tuple[int, Path]],
    verify: Callable[[Path], str | None],
    folder: Path,
    log: Callable[[str], None] | None = None,
) -> Path | None:
    """The newest of the ``(step, path)`` checkpoints ``found`` that ``verify`` passes (it
    returns ``None`` for an intact one, else what is wrong): damaged ones are skipped with a
    message to ``log`` (default stderr); ``CheckpointError`` names them when every one is damaged
    (starting over would silently redo the run); ``None`` when there is none."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    bad: list[str] = []
    for _, path in sorted(found, key=lambda item: item[0], reverse=True):
        problem = verify(path)
        if problem is None:
            if bad:
                say(f"gbmpo: resuming from {path.name} instead")
            return path
        bad.append(f"{path.name}: {problem}")
        say(f"gbmpo: checkpoint {path} is damaged ({problem}); skipping it")
    if bad:
        raise CheckpointError(
            f"no intact checkpoint in {str(folder)!r} ({'; '.join(bad)}); delete that directory "
            "to restart the run from step 0"
        )
    return None


def file_sha256(path: str | Path) -> str:
    """The sha256 hex digest of a file, read in 1 MiB blocks (checkpoint manifests)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def root_cause(err: BaseException) -> str:
    """The OSError behind ``err`` (e.g. "[Errno 28] No space left on device") if there is one in
    its cause/context chain, else ``err`` itself."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return f"[Errno {seen.errno}] {seen.strerror}"
        seen = seen.__cause__ or seen.__context__
    return str(err)


def is_nonempty(path: str | Path) -> bool:
    """True for an existing file or a directory with something in it (besides a lock file)."""
    p = Path(path)
    return p.exists() and (not p.is_dir() or any(c.name != LOCK_FILE for c in p.iterdir()))


class RunLock:
    """Exclusive ownership of a run directory: ``flock`` on ``<dir>/.gbmpo.lock``.

    ``release`` removes the lock file, so a run that ends (finished, failed, stopped on a
    signal) leaves none behind. The lock itself is released when the process exits, however it
    exits: the file a kill -9 leaves behind never blocks a resume. ``acquire`` creates the
    directory if needed and raises :class:`RunDirInUseError` naming the owner's pid when another
    process holds the lock.
    """

    def __init__(self, directory: str | Path, what: str = "run") -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.what = what
        self._file: IO[str] | None = None

    def acquire(self) -> RunLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            f = self._try_lock()
            # the owner before removes the file when it releases it: a lock taken on a file
            # that is no longer at the path locks nothing; take the new file's instead
            try:
                if os.path.samestat(os.fstat(f.fileno()), os.stat(self.path)):
                    break
            except FileNotFoundError:
                pass
            f.close()
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f
        return self

    def _try_lock(self) -> IO[str]:
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the lifetime of the lock
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                f.close()
                raise
            f.seek(0)
            owner = f.read().strip() or "unknown"
            f.close()
            raise self._in_use(owner) from None
        return f

    def _in_use(self, owner: str) -> RunDirInUseError:
        return RunDirInUseError(
            f"{self.what} directory {str(self.directory)!r} is in use by another gbmpo "
            f"process (pid {owner}); wait for it to finish or choose another output directory"
        )

    def check_free(self) -> None:
        """Raise :class:`RunDirInUseError` (as :meth:`acquire` would) if another process holds
        the lock now; creates nothing. A probe before slow checks, so that a second run on a
        directory in use is refused at once; :meth:`acquire` still decides."""
        try:
            f = open(self.path)  # noqa: SIM115 - closed below
        except (FileNotFoundError, NotADirectoryError):
            return
        with f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                raise self._in_use(f.read().strip() or "unknown") from None
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def release(self) -> None:
        """Remove the lock file (while still holding the lock) and release the lock."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(self._file.fileno()), os.stat(self.path)):
                    os.unlink(self.path)
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
