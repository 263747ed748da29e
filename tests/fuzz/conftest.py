"""Hypothesis profiles of the fuzz tests and what every fuzzed command runs under.

``HYPOTHESIS_PROFILE=ci`` (the default): a few examples per target, the whole directory in
about a minute. ``HYPOTHESIS_PROFILE=long``: at least 2,000 examples per target (a soak to run
by hand: ``HYPOTHESIS_PROFILE=long pytest tests/fuzz``). The profiles apply to the tests of
this directory only (each test takes them through ``fuzzlib.FUZZ``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

_COMMON = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                              HealthCheck.function_scoped_fixture,
                              HealthCheck.filter_too_much],
    "derandomize": False,
}
settings.register_profile("fuzz-ci", max_examples=12, **_COMMON)
settings.register_profile("fuzz-long", max_examples=2000, **_COMMON)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
    raise pytest.UsageError(f"HYPOTHESIS_PROFILE must be 'ci' or 'long', got {PROFILE!r}")
os.environ["GBMPO_FUZZ_PROFILE"] = f"fuzz-{PROFILE}"  # read by fuzzlib.FUZZ


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No fuzzed input may reach the network: the hub is off, and HF reads offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("GBMPO_ALLOW_HUB", "0")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    yield
