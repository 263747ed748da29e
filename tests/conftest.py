"""Fixtures shared by the whole suite.

``data_mode`` runs a test twice: with the data sets as this checkout has them (``packed``:
GSM8K/MBPP packed into the package at install, where the install found them) and as a user's
own clone has them (``hidden``: no package data, no ``GBMPO_DATA_DIR``, no hub), so CI, which
has the data, still proves what a user without it gets.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(params=["packed", "hidden"])
def data_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
              tmp_path: Path) -> str:  # fmt: skip
    """``packed``: this checkout's data; ``hidden``: a user's clone (no data anywhere)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if request.param == "hidden":
        from gbmpo.tasks import _common

        monkeypatch.delenv(_common.DATA_DIR_ENV, raising=False)
        monkeypatch.setenv(_common.HUB_ENV, "0")
        monkeypatch.setattr(_common, "package_data_dir", lambda: tmp_path / "no-package-data")
    return str(request.param)
