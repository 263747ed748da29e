"""Hardened execution of untrusted Python programs against unit tests (the code rewards' sandbox).

:func:`run_program` / :func:`run_programs` run programs on the process-wide :class:`Sandbox`
(:func:`get_default_sandbox`); :func:`require_sandbox` starts it before a command writes anything
and fails closed, naming the missing isolation layers. See :mod:`gbmpo.sandbox.client` for the
layers and the reward-hacking defences.
"""

from gbmpo.sandbox.client import (
    Sandbox,
    get_default_sandbox,
    require_sandbox,
    run_program,
    run_programs,
)
from gbmpo.sandbox.errors import SandboxError, SandboxUnavailableError, SandboxWarning
from gbmpo.sandbox.isolation import ALLOW_ENV, ISOLATION_LAYERS, PROTECTIONS
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
    "judge",
    "require_sandbox",
    "run_program",
    "run_programs",
    "strict_test_source",
]
