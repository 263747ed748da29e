"""Markers of the ES tests."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "ray: starts a local Ray instance (~5 s); deselect with -m 'not ray'"
    )
