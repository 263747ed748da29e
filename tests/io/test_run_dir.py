"""The run-directory primitives of :mod:`gbmpo.io.run_dir`: atomic writes, the newest intact
checkpoint, file hashes, the root cause of a write error and the run-directory lock."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest

from gbmpo.io import (
    LOCK_FILE,
    CheckpointError,
    RunDirInUseError,
    RunLock,
    atomic_path,
    file_sha256,
    is_nonempty,
    newest_intact,
    root_cause,
    write_atomic,
    write_json_atomic,
)


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "summary.json"
    write_atomic(target, "old")
    write_json_atomic(target, {"step": 3, "name": "é"})
    assert json.loads(target.read_text(encoding="utf-8")) == {"step": 3, "name": "é"}
    assert target.read_text(encoding="utf-8").endswith("}\n")
    write_atomic(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_an_interrupted_atomic_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "config.yaml"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".") and tmp.suffix == ".tmp"
        tmp.write_text("half of the new")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_newest_intact_skips_damaged_checkpoints_and_refuses_when_all_are(tmp_path: Path) -> None:
    found = [(2, tmp_path / "step-2"), (6, tmp_path / "step-6"), (4, tmp_path / "step-4")]
    damaged = {"step-6": "model.safetensors: sha256 mismatch"}
    said: list[str] = []
    pick = newest_intact(found, lambda p: damaged.get(p.name), tmp_path, said.append)
    assert pick == tmp_path / "step-4"
    assert "step-6" in said[0] and "sha256 mismatch" in said[0] and "step-4" in said[1]
    assert newest_intact(found, lambda p: None, tmp_path, said.append) == tmp_path / "step-6"
    assert newest_intact([], lambda p: "never called", tmp_path, said.append) is None
    with pytest.raises(CheckpointError, match="no intact checkpoint") as err:
        newest_intact(found, lambda p: "truncated", tmp_path, said.append)
    assert all(name in str(err.value) for name in ("step-2", "step-4", "step-6"))


def test_file_sha256_is_the_digest_of_the_whole_file(tmp_path: Path) -> None:
    data = os.urandom((1 << 20) + 17)  # more than one 1 MiB block
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    assert file_sha256(path) == hashlib.sha256(data).hexdigest()


def test_root_cause_finds_the_os_error_in_the_chain() -> None:
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise RuntimeError("could not save the checkpoint") from exc
    except RuntimeError as err:
        assert root_cause(err) == f"[Errno {errno.ENOSPC}] No space left on device"
    assert root_cause(ValueError("plain")) == "plain"


def test_is_nonempty_ignores_the_lock_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert not is_nonempty(run)
    run.mkdir()
    assert not is_nonempty(run)
    (run / LOCK_FILE).write_text("123\n")
    assert not is_nonempty(run)
    (run / "metrics.jsonl").write_text("{}\n")
    assert is_nonempty(run) and is_nonempty(run / "metrics.jsonl")


def test_run_lock_is_exclusive_and_names_the_owner(tmp_path: Path) -> None:
    run = tmp_path / "new" / "run"
    with RunLock(run) as lock:
        assert lock.path == run / LOCK_FILE
        assert lock.path.read_text() == f"{os.getpid()}\n"
        with pytest.raises(RunDirInUseError, match=rf"pid {os.getpid()}\b"):
            RunLock(run, what="ES").acquire()
    assert not (run / LOCK_FILE).exists()  # released: the file is removed
    # the next owner gets it
    RunLock(run).acquire().release()
    assert not (run / LOCK_FILE).exists()


def test_a_lock_taken_on_a_removed_file_is_retaken(tmp_path: Path) -> None:
    """The owner removes the file as it releases the lock: a process that opened the old file
    just before must not believe it holds the lock while a third one locks the new file."""
    import fcntl

    run = tmp_path / "run"
    first = RunLock(run).acquire()
    stale = open(first.path)  # noqa: SIM115 - opened before the owner's release
    first.release()
    fcntl.flock(stale.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # locks the removed file
    with RunLock(run) as lock:  # a lock on the path's file, not on the removed one
        assert lock.path.read_text() == f"{os.getpid()}\n"
    stale.close()


def test_check_free_refuses_a_held_directory_and_creates_nothing(tmp_path: Path) -> None:
    """The probe before slow checks: free (absent or released) passes without creating
    anything; held by another open lock, it raises the error ``acquire`` raises."""
    run = tmp_path / "run"
    RunLock(run).check_free()  # absent: nothing created
    assert not run.exists()
    held = RunLock(run).acquire()
    msg = f"in use by another gbmpo process \\(pid {os.getpid()}\\)"
    with pytest.raises(RunDirInUseError, match=msg):
        RunLock(run).check_free()
    held.release()
    RunLock(run).check_free()
    assert not (run / LOCK_FILE).exists()
