"""Tests of gbmpo.integrations.verl; they need verl, which lives in its own environment.

Run them with ``.venv-verl/bin/python -m pytest tests_verl`` (``bash scripts/install_verl_env.sh``
builds ``.venv-verl``); the main suite does so through ``tests/engines/test_verl_env.py``.
Where verl is not importable (e.g. the main ``.venv``) nothing here is collected.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# tests/parity_record.py (the parity tests' measured differences), one copy for both suites
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("verl") is None:
    collect_ignore_glob = ["test_*.py"]
