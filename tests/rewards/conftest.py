"""Shared fixtures of the reward tests: one fully protected sandbox per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gbmpo.sandbox import Sandbox, SandboxError, SandboxUnavailableError

REPO = Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def sandbox() -> Iterator[Sandbox]:
    """A strict 2-worker sandbox; skips when this machine lacks a protection layer."""
    try:
        box = Sandbox(workers=2, strict=True, timeout_s=5.0)
    except SandboxUnavailableError as exc:
        pytest.skip(f"full sandbox unavailable here: {exc}")
    except SandboxError as exc:  # e.g. no /usr/bin/python3
        pytest.skip(f"sandbox cannot start here: {exc}")
    yield box
    box.close()
