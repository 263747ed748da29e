"""The largest differences a parity test measured, kept for docs/results.md#parity: with
``$GBMPO_PARITY_JSON`` set, :func:`record` adds the figures to that file under the running
test's id (``scripts/collect_parity.py`` sets it and merges the files); unset, it does nothing.
The tests of tests_verl (verl's environment) import it too (tests_verl/conftest.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def record(loss_diff: float, grad_diff: float, key: str | None = None) -> None:
    """Keep max |Δ loss| and max |Δ gradient| under ``key`` (default: the running test's id);
    a key recorded twice keeps the larger of each."""
    target = os.environ.get("GBMPO_PARITY_JSON")
    if not target:
        return
    key = key or os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
    path = Path(target)
    data = json.loads(path.read_text()) if path.exists() else {}
    old = data.get(key, {"loss": 0.0, "grad": 0.0})
    data[key] = {"loss": max(old["loss"], float(loss_diff)),
                 "grad": max(old["grad"], float(grad_diff))}  # fmt: skip
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
